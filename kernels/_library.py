"""``torch.library`` registration of the Triton kernels as opaque ``polestar::*`` operators.

Every ``*_triton`` wrapper of :mod:`polestar.kernels` calls a custom operator
``torch.ops.polestar.<name>`` whose implementation launches the Triton kernel and whose *fake*
(meta) implementation only allocates outputs of the right shape / dtype / strides.  Dynamo and
AOTAutograd therefore trace each kernel as one opaque graph node (no graph break, no attempt to
run Triton on FakeTensors); Inductor calls it as an extern kernel.

Why ``torch.library.custom_op`` + ``register_fake`` and not ``torch.library.triton_op``:
``triton_op`` derives its fake implementation by running the Python body on FakeTensors with
``wrap_triton`` turning launches into no-op HOP calls, and lets AOTAutograd inline the body.
Under ``TRITON_INTERPRET=1`` (how the CPU test-suite runs every kernel) ``@triton.jit`` yields an
``InterpretedFunction``, for which ``wrap_triton`` (torch 2.13) returns the raw kernel: the fake
pass then *executes* the interpreter on FakeTensors and fails ("Attempted to set the storage of
a tensor on device meta ..."), so neither ``torch.compile`` nor ``torch.library.opcheck`` work
on such ops.  ``custom_op`` behaves identically with and without the interpreter, so the
registered ops are exactly what the tests check.  (Switching to ``triton_op`` on a GPU-only code
path would let Inductor fuse around the kernels; it is not done because it could not be tested.)

Registration is skipped when Triton is not importable (the ``*_triton`` wrappers raise first),
never launches a kernel at import time, and is idempotent: if ``polestar::<name>`` already
exists (e.g. a module was reloaded) the existing operator is kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ._backend import HAS_TRITON

NAMESPACE = "polestar"

F = TypeVar("F", bound=Callable[..., Any])

def is_registered(name: str) -> bool:
    """True if the operator ``polestar::<name>`` exists (registered by this module or earlier)."""
    try:
        getattr(getattr(torch.ops, NAMESPACE), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def register_op(name: str, fake: Callable[..., Any]) -> Callable[[F], F]:
    """Decorator: register ``fn`` as the opaque custom op ``polestar::<name>`` with ``fake``.

    ``fn`` needs type annotations (they define the schema, e.g. ``(Tensor p, Tensor q, float
    eps) -> Tensor``) and must return fresh tensors (no aliasing of inputs or of each other).
    ``fake`` has the same signature and returns empty tensors with the shapes / dtypes / strides
    ``fn`` would return.  The decorated function is returned unchanged; call the op as
    ``torch.ops.polestar.<name>(...)``.  Without Triton nothing is registered.
    """

    def deco(fn: F) -> F:
        qualname = f"{NAMESPACE}::{name}"
        if not HAS_TRITON:
            return fn
        if not is_registered(name):
            op = torch.library.custom_op(qualname, fn, mutates_args=())
            op.register_fake(fake)
        return fn

    return deco


#: namespace of the ops a decoding step calls (see :func:`fused_op`)
FUSED_NAMESPACE = "polestar_fused"


def fused_op(name: str, fake: Callable[..., Any], cuda: Callable[..., Any] | None = None,
             mutates_args: tuple[str, ...] = ()) -> Callable[[F], Any]:
    """Decorator: register the torch reference ``fn`` as ``torch.ops.polestar_fused.<name>``, one opaque operation
    on every device, and return that op.

    What a decoding step calls through ``backend="auto"``: on a CUDA device with Triton the op runs ``cuda`` (the
    Triton kernel's launch, one kernel), elsewhere the reference ``fn``. So the step is one graph node per fused
    operation wherever it runs (``torch.compile`` traces the op, not the reference's body) and an operation count
    taken on a CPU is the count of launches a GPU sees. ``fn`` and ``fake`` as for :func:`register_op`; registered
    with or without Triton (then the reference runs on CUDA too), once per process. ``mutates_args``: the names of
    the arguments ``fn`` writes in place (an op that writes a buffer returns None or fresh tensors only; a compiler
    sees the write and keeps its order)."""

    def deco(fn: F) -> Any:
        namespace = getattr(torch.ops, FUSED_NAMESPACE)
        try:
            return getattr(namespace, name)
        except (AttributeError, RuntimeError):
            pass
        op = torch.library.custom_op(f"{FUSED_NAMESPACE}::{name}", fn, mutates_args=mutates_args)
        op.register_fake(fake)
        if cuda is not None and HAS_TRITON:
            op.register_kernel("cuda", cuda)
        return getattr(namespace, name)

    return deco
