#!/usr/bin/env bash
# One-shot GPU check (see check.py). Run from the repository root on a machine with one H100/H200.
set -euo pipefail
python -m pip install -q -e '.[triton]' 2>/dev/null || true
timeout 480 python bench/gpu/check.py "$@"
