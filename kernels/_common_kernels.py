"""Reduction helpers shared by the Triton kernels (imported only when Triton is available).

``tl.sum`` / ``tl.max`` / ``tl.zeros`` are ``@triton.jit`` functions of ``triton.language.standard``
decorated when Triton is first imported; if that happened before ``TRITON_INTERPRET=1`` was set
(e.g. another module imported Triton first) they refuse to run under the interpreter.  The
kernels therefore reduce with the builtin ``tl.reduce`` and build zeros with ``tl.full``, so they
work whatever the import order.  The combine functions are Triton's own (what ``tl.sum`` /
``tl.max`` use, and what the interpreter recognises for its fast numpy path), with local
fallbacks should those private names disappear.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


SUM_COMBINE = getattr(tl.standard, "_sum_combine", _add)
MAX_COMBINE = getattr(tl.standard, "_elementwise_max", _max)


@triton.jit
def reduce_sum(x, axis: tl.constexpr):
    """``tl.sum(x, axis)`` built on the builtin ``tl.reduce``."""
    return tl.reduce(x, axis, SUM_COMBINE)


@triton.jit
def reduce_max(x, axis: tl.constexpr):
    """``tl.max(x, axis)`` built on the builtin ``tl.reduce``."""
    return tl.reduce(x, axis, MAX_COMBINE)
