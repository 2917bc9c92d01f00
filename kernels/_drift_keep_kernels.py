"""Triton kernel of :func:`polestar.kernels.drift_keep.drift_keep` (imported only when Triton is available).

One program per ``(b, r)``: for each head it reduces the row ``cur[b, h, r, :]`` against ``prev[b, h, r, :]`` in
``BLOCK``-wide chunks with the element-wise formulas of :mod:`polestar.kernels._drift_kernels` (fp32 accumulation),
averages the heads' divergences into ``drift[b, r]``, then, if ``due[b]``, copies ``cur[b, :, r, :]`` into
``prev[b, :, r, :]``.  All reads of ``prev`` come before the program's writes, and programs own disjoint rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common_kernels import cosine_dissimilarity, kl_terms, reduce_sum


@triton.jit
def _load_chunk(ptr, start, N, stride_n, BLOCK: tl.constexpr):
    offs = start + tl.arange(0, BLOCK)
    return tl.load(ptr + offs.to(tl.int64) * stride_n, mask=offs < N, other=0.0).to(tl.float32)


@triton.jit
def _head_divergence(c_ptr, p_ptr, N, stride_cn, stride_pn, eps, METRIC: tl.constexpr, BLOCK: tl.constexpr):
    """Divergence of one row pair: KL (0) / JS (1) as ``kl_rows_kernel`` / ``js_rows_kernel``, cosine (2) as
    ``cosine_rows_kernel``."""
    acc = tl.full([BLOCK], 0.0, dtype=tl.float32)
    pp = tl.full([BLOCK], 0.0, dtype=tl.float32)
    qq = tl.full([BLOCK], 0.0, dtype=tl.float32)
    for start in range(0, N, BLOCK):
        p = _load_chunk(c_ptr, start, N, stride_cn, BLOCK)
        q = _load_chunk(p_ptr, start, N, stride_pn, BLOCK)
        if METRIC == 0:
            acc += kl_terms(p, q, eps)
        elif METRIC == 1:
            p = tl.maximum(p, 0.0)
            q = tl.maximum(q, 0.0)
            m = (p + q) * 0.5
            acc += 0.5 * kl_terms(p, m, eps) + 0.5 * kl_terms(q, m, eps)
        else:
            acc += p * q
            pp += p * p
            qq += q * q
    if METRIC == 2:
        out = cosine_dissimilarity(acc, pp, qq)
    else:
        out = tl.maximum(reduce_sum(acc, axis=0), 0.0)
    return out


@triton.jit
def drift_keep_kernel(
    cur_ptr,  # [B, H, R, N] fp32, any strides
    prev_ptr,  # [B, H, R, N] fp32, any strides; rows of the due batch entries are overwritten with cur
    due_ptr,  # [B] uint8 (bool)
    out_ptr,  # [B, R] fp32, contiguous
    H, R, N,
    stride_cb, stride_ch, stride_cr, stride_cn,
    stride_pb, stride_ph, stride_pr, stride_pn,
    stride_due, eps,
    METRIC: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """drift[b, r] = mean_h divergence(cur[b, h, r], prev[b, h, r]); then prev[b, :, r] = cur[b, :, r] if due[b]."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // R
    r = pid % R
    cur_row = cur_ptr + b * stride_cb + r * stride_cr
    prev_row = prev_ptr + b * stride_pb + r * stride_pr
    c_ptr = cur_row
    p_ptr = prev_row
    total = tl.full([], 0.0, dtype=tl.float32)
    for _ in range(0, H):
        total += _head_divergence(c_ptr, p_ptr, N, stride_cn, stride_pn, eps, METRIC, BLOCK)
        c_ptr += stride_ch
        p_ptr += stride_ph
    tl.store(out_ptr + pid, total / H)
    if tl.load(due_ptr + b * stride_due) != 0:
        c_ptr = cur_row
        p_ptr = prev_row
        for _ in range(0, H):
            for start in range(0, N, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < N
                x = tl.load(c_ptr + offs.to(tl.int64) * stride_cn, mask=mask)
                tl.store(p_ptr + offs.to(tl.int64) * stride_pn, x, mask=mask)
            c_ptr += stride_ch
            p_ptr += stride_ph
