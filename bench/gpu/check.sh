#!/usr/bin/env bash
# The GPU check as one offline command (see check.py): on a machine with torch, triton and transformers installed
# and no network, installs this checkout, writes an LLaDA-8B-shaped checkpoint, and reports load, forward, eager
# and compiled decoding (CUDA-graph replays and skips per policy), fp8 and the Triton kernels; < 8 minutes on one
# H100/H200. Run from anywhere: bash bench/gpu/check.sh [check.py options, e.g. --tiny --device cpu].
#
# Install (POLESTAR_INSTALL): "pip" (default) installs the checkout in editable mode with
# `pip install --no-index --no-build-isolation --no-deps -e .`, which needs no network (setuptools and wheel must
# already be installed); when that fails it falls back to "source". "source" installs nothing: it links the
# checkout's folders into a package tree in a temporary folder (the package maps policies/, kernels/, models/,
# bench/ and training/ to polestar.policies, ... so the checkout itself is not importable as it is) and puts it on
# PYTHONPATH. "skip" (or POLESTAR_SKIP_INSTALL=1) uses whatever `import polestar` finds.
# Stops at the first failing command; check.py stops after POLESTAR_CHECK_TIMEOUT seconds (default 480).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PYTHON="${PYTHON:-python}"
INSTALL="${POLESTAR_INSTALL:-pip}"
if [[ "${POLESTAR_SKIP_INSTALL:-0}" == 1 ]]; then
    INSTALL=skip
fi
SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/polestar-check.XXXXXX")"
trap 'rm -rf "$SCRATCH"' EXIT
case "$INSTALL" in
    pip)
        echo "# install: $PYTHON -m pip install --no-index --no-build-isolation --no-deps -e $ROOT"
        if "$PYTHON" -m pip install -q --no-index --no-build-isolation --no-deps -e "$ROOT" >"$SCRATCH/pip.log" 2>&1; then
            echo "# install: done"
        else
            tail -n 5 "$SCRATCH/pip.log"
            echo "# install: pip failed (its last lines above); running from the source tree instead"
            INSTALL=source
        fi
        ;;
    source | skip) ;;
    *)
        echo "error: POLESTAR_INSTALL is pip, source or skip, not '$INSTALL'" >&2
        exit 2
        ;;
esac
if [[ "$INSTALL" == source ]]; then
    "$PYTHON" "$ROOT/bench/gpu/source_tree.py" "$ROOT" "$SCRATCH/src"
    export PYTHONPATH="$SCRATCH/src${PYTHONPATH:+:$PYTHONPATH}"
    echo "# install: none; polestar runs from $ROOT through the package tree $SCRATCH/src"
fi
# from a neutral folder: a checkout's polestar/ folder in the current one must not shadow the installed package
(cd "$SCRATCH" && "$PYTHON" -c 'import polestar, torch; print(f"# polestar from {polestar.__file__}; torch {torch.__version__}, cuda {torch.cuda.is_available()}")')
# optional dependencies, before the first step: say which step is skipped and what to install
(cd "$SCRATCH" && "$PYTHON" -c 'import importlib.util as u; print("# triton " + ("found" if u.find_spec("triton") else "not installed: step 6 (Triton kernels) is skipped; pip install triton to run it"))')
timeout "${POLESTAR_CHECK_TIMEOUT:-480}" "$PYTHON" "$ROOT/bench/gpu/check.py" "$@"
