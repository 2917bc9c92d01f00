"""Reduction helpers and drift terms shared by the Triton kernels (imported only when Triton is available).

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


@triton.jit
def kl_terms(p, q, eps):
    """``p * (log max(p, eps) - log max(q, eps))`` element-wise, ``p`` clamped at 0 (``p == 0`` contributes 0)."""
    p = tl.maximum(p, 0.0)
    return p * (tl.log(tl.maximum(p, eps)) - tl.log(tl.maximum(q, eps)))


@triton.jit
def cosine_dissimilarity(dot, pp, qq):
    """``clamp(1 - <p,q> / (|p| |q|), 0, 2)`` from the chunk sums ``p·q``, ``p·p``, ``q·q`` of one row pair; two
    zero rows give 0, one zero row gives 1."""
    d = reduce_sum(dot, axis=0)
    np_ = reduce_sum(pp, axis=0)
    nq = reduce_sum(qq, axis=0)
    denom = tl.sqrt(np_) * tl.sqrt(nq)
    both_zero = (np_ == 0.0) & (nq == 0.0)
    cos = tl.where(denom > 0.0, d / tl.where(denom > 0.0, denom, 1.0), tl.where(both_zero, 1.0, 0.0))
    return tl.minimum(tl.maximum(1.0 - cos, 0.0), 2.0)
