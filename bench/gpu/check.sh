#!/usr/bin/env bash
# One-shot GPU check (see check.py): writes an LLaDA-8B-shaped checkpoint, loads it onto the GPU, and times
# baseline / fast-dllm / polestar eager and compiled at batch 1 and 16. Run from anywhere on a machine with one
# H100/H200. Stops at the first failing command. POLESTAR_SKIP_INSTALL=1 skips the editable install (offline
# machines where the package is already installed); extra arguments go to check.py (e.g. --tiny --device cpu).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python}"
if [[ "${POLESTAR_SKIP_INSTALL:-0}" != 1 ]]; then
    "$PYTHON" -m pip install -q -e '.[triton]'
fi
"$PYTHON" -c 'import polestar, torch; print(f"# polestar from {polestar.__file__}; torch {torch.__version__}, cuda {torch.cuda.is_available()}")'
# optional dependencies, before the first step: say which step is skipped and what to install
"$PYTHON" -c 'import importlib.util as u; print("# triton " + ("found" if u.find_spec("triton") else "not installed: step 4 (Triton kernels) is skipped; pip install triton to run it"))'
timeout "${POLESTAR_CHECK_TIMEOUT:-480}" "$PYTHON" bench/gpu/check.py "$@"
