"""Backend selection shared by the numeric ops in ``polestar.kernels``.

Every op exists twice with the same signature: a pure-torch ``reference_*`` function and a
``*_triton`` kernel wrapper.  The public dispatchers (``kl_drift``, ``kmeans_assign``,
``nvfp4_quantize`` ...) call :func:`pick` with a table ``{"reference": fn, "triton": fn}``.

``backend="auto"`` selects Triton when it is importable and every tensor argument lives on a
CUDA device, else the reference.  Triton is optional: this module never fails to import, and
:data:`HAS_TRITON` tells whether the kernels are available.  On CPU the Triton kernels can still
be run explicitly (``backend="triton"``) under the interpreter (``TRITON_INTERPRET=1``), which is
how the tests exercise them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

import torch

try:  # pragma: no cover - exercised implicitly by the import
    import triton  # noqa: F401
    import triton.language  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton is installed in CI
    HAS_TRITON = False

BACKENDS: tuple[str, ...] = ("auto", "triton", "reference")

F = TypeVar("F", bound=Callable)


def resolve_backend(backend: str, *tensors: torch.Tensor) -> str:
    """Turn ``"auto" | "triton" | "reference"`` into a concrete backend name.

    ``"auto"`` gives ``"triton"`` when Triton is importable and all ``tensors`` (any shapes) are
    CUDA tensors, otherwise ``"reference"``.  Raises ``ValueError`` for an unknown name and
    ``RuntimeError`` when ``"triton"`` is requested but Triton is not installed.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        on_cuda = len(tensors) > 0 and all(t.is_cuda for t in tensors)
        return "triton" if HAS_TRITON and on_cuda else "reference"
    if backend == "triton" and not HAS_TRITON:
        raise RuntimeError("backend='triton' requested but triton is not importable")
    return backend


def pick(impls: Mapping[str, F], backend: str, *tensors: torch.Tensor) -> F:
    """Return ``impls[resolve_backend(backend, *tensors)]`` (see :func:`resolve_backend`); ``"auto"`` gives
    ``impls["fused"]`` where the op has one (:func:`polestar.kernels._library.fused_op`: Triton on CUDA, the
    reference elsewhere, one opaque operation either way)."""
    if backend == "auto" and "fused" in impls:
        return impls["fused"]
    return impls[resolve_backend(backend, *tensors)]


def require_triton() -> None:
    """Raise ``RuntimeError`` if Triton is not importable (called by every ``*_triton`` wrapper)."""
    if not HAS_TRITON:
        raise RuntimeError("this function needs triton (pip install 'polestar-dllm[triton]')")


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``max(n, 1)`` (Triton block sizes must be powers of two)."""
    return 1 << max(int(n) - 1, 0).bit_length()

