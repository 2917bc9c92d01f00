"""Test setup for ``polestar.kernels``: Triton kernels run on CPU through the interpreter.

``TRITON_INTERPRET`` must be set before ``triton.jit`` decorates the kernels, so it is set here,
at conftest import.  ``setdefault`` lets a GPU run opt out with ``TRITON_INTERPRET=0``, in which
case the Triton tests use CUDA tensors (see :func:`kernel_device`).
"""

from __future__ import annotations

import importlib
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

# A parent conftest may already have imported the kernel modules (tests/conftest.py imports the
# policies, which import polestar.kernels) before the variable was set: rebuild their @triton.jit
# functions so that they honour TRITON_INTERPRET, shared helpers first.  The kernels avoid
# triton.language.standard's jit functions (tl.sum, tl.max, tl.zeros), which cannot be rebuilt.
_loaded = [m for m in sys.modules if m.startswith("polestar.kernels._") and m.endswith("_kernels")]
for _name in sorted(_loaded, key=lambda m: not m.endswith("._common_kernels")):
    importlib.reload(sys.modules[_name])

import pytest  # noqa: E402
import torch  # noqa: E402


def kernel_device() -> str:
    """Device for Triton-backend tests: CUDA only when interpretation is switched off."""
    if os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available():
        return "cuda"
    return "cpu"


@pytest.fixture(scope="session")
def kdev() -> str:
    """The device Triton-backend tests put their tensors on (``"cpu"`` under the interpreter)."""
    return kernel_device()
