"""Triton kernels for row-wise drift metrics (imported only when Triton is available).

Each kernel reduces one row of a ``[R, N]`` matrix per program, looping over the row in
``BLOCK``-wide chunks and accumulating in fp32.  The element-wise formulas are the same as in
the torch references of :mod:`polestar.kernels.drift`, so equal inputs give exactly 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common_kernels import cosine_dissimilarity, kl_terms, reduce_max, reduce_sum

NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _load_row_chunk(ptr, row, stride, start, N, other, BLOCK: tl.constexpr):
    offs = start + tl.arange(0, BLOCK)
    mask = offs < N
    return tl.load(ptr + row * stride + offs, mask=mask, other=other).to(tl.float32)


@triton.jit
def kl_rows_kernel(p_ptr, q_ptr, out_ptr, N, stride_p, stride_q, eps, BLOCK: tl.constexpr):
    """out[r] = max(0, sum_n p[r,n] (log max(p,eps) - log max(q,eps)))."""
    row = tl.program_id(0).to(tl.int64)
    acc = tl.full([BLOCK], 0.0, dtype=tl.float32)
    for start in range(0, N, BLOCK):
        p = _load_row_chunk(p_ptr, row, stride_p, start, N, 0.0, BLOCK)
        q = _load_row_chunk(q_ptr, row, stride_q, start, N, 0.0, BLOCK)
        acc += kl_terms(p, q, eps)
    tl.store(out_ptr + row, tl.maximum(reduce_sum(acc, axis=0), 0.0))


@triton.jit
def js_rows_kernel(p_ptr, q_ptr, out_ptr, N, stride_p, stride_q, eps, BLOCK: tl.constexpr):
    """out[r] = max(0, KL(p||m)/2 + KL(q||m)/2) with m = (p + q) / 2."""
    row = tl.program_id(0).to(tl.int64)
    acc = tl.full([BLOCK], 0.0, dtype=tl.float32)
    for start in range(0, N, BLOCK):
        p = tl.maximum(_load_row_chunk(p_ptr, row, stride_p, start, N, 0.0, BLOCK), 0.0)
        q = tl.maximum(_load_row_chunk(q_ptr, row, stride_q, start, N, 0.0, BLOCK), 0.0)
        m = (p + q) * 0.5
        acc += 0.5 * kl_terms(p, m, eps) + 0.5 * kl_terms(q, m, eps)
    tl.store(out_ptr + row, tl.maximum(reduce_sum(acc, axis=0), 0.0))


@triton.jit
def cosine_rows_kernel(p_ptr, q_ptr, out_ptr, N, stride_p, stride_q, BLOCK: tl.constexpr):
    """out[r] = clamp(1 - <p,q> / (|p| |q|), 0, 2); two zero rows give 0, one zero row gives 1."""
    row = tl.program_id(0).to(tl.int64)
    dot = tl.full([BLOCK], 0.0, dtype=tl.float32)
    pp = tl.full([BLOCK], 0.0, dtype=tl.float32)
    qq = tl.full([BLOCK], 0.0, dtype=tl.float32)
    for start in range(0, N, BLOCK):
        p = _load_row_chunk(p_ptr, row, stride_p, start, N, 0.0, BLOCK)
        q = _load_row_chunk(q_ptr, row, stride_q, start, N, 0.0, BLOCK)
        dot += p * q
        pp += p * p
        qq += q * q
    tl.store(out_ptr + row, cosine_dissimilarity(dot, pp, qq))


@triton.jit
def entropy_rows_kernel(x_ptr, out_ptr, N, stride_x, BLOCK: tl.constexpr):
    """out[r] = entropy of softmax(x[r]) = log s - sum(e z) / s, z = x - max, e = exp(z), s = sum e."""
    row = tl.program_id(0).to(tl.int64)
    vmax = tl.full([BLOCK], NEG_INF, dtype=tl.float32)
    for start in range(0, N, BLOCK):
        vmax = tl.maximum(vmax, _load_row_chunk(x_ptr, row, stride_x, start, N, NEG_INF, BLOCK))
    m = reduce_max(vmax, axis=0)
    m = tl.where(m > NEG_INF, m, 0.0)
    s = tl.full([BLOCK], 0.0, dtype=tl.float32)
    t = tl.full([BLOCK], 0.0, dtype=tl.float32)
    for start in range(0, N, BLOCK):
        z = _load_row_chunk(x_ptr, row, stride_x, start, N, NEG_INF, BLOCK) - m
        e = tl.exp(z)
        s += e
        t += e * tl.where(e > 0.0, z, 0.0)  # avoids 0 * -inf
    ssum = reduce_sum(s, axis=0)
    tsum = reduce_sum(t, axis=0)
    safe = tl.where(ssum > 0.0, ssum, 1.0)
    h = tl.where(ssum > 0.0, tl.log(safe) - tsum / safe, 0.0)
    tl.store(out_ptr + row, tl.maximum(h, 0.0))
