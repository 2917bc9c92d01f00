"""Triton kernels for proxy and gathered attention (imported only when Triton is available).

Both kernels compute scores ``(q . k) * scale`` with fp32 accumulation, mask keys whose
``key_valid`` byte is 0 (and the padding past ``T``) with ``-inf`` and use a max-subtracted
softmax whose running maximum is replaced by 0 while it is still ``-inf``, so rows without any
valid key give all-zero probabilities / outputs instead of NaN.  GQA: query head ``h`` reads kv
head ``h // GROUP``.  Reductions use :mod:`._common_kernels` (see there why not ``tl.sum``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common_kernels import reduce_max, reduce_sum

NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _proxy_scores(
    q,
    k_base,
    valid_base,
    start,
    T,
    HD,
    scale,
    stride_kt,
    stride_kd,
    stride_vt,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Scores ``[BLOCK_T]`` fp32 of one query ``q [BLOCK_D]`` against keys ``start .. start+BLOCK_T``."""
    offs_t = start + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    in_t = offs_t < T
    k = tl.load(
        k_base + offs_t[:, None] * stride_kt + offs_d[None, :] * stride_kd,
        mask=in_t[:, None] & (offs_d < HD)[None, :],
        other=0.0,
    ).to(tl.float32)
    s = reduce_sum(k * q[None, :], axis=1) * scale
    ok = tl.load(valid_base + offs_t * stride_vt, mask=in_t, other=0) != 0
    return tl.where(ok, s, NEG_INF), offs_t, in_t


@triton.jit
def proxy_attention_kernel(
    q_ptr,  # [B, H, P, HD] any float dtype
    k_ptr,  # [B, HKV, T, HD] any float dtype
    valid_ptr,  # [B, T] uint8 (bool bytes)
    out_ptr,  # [B, H, P, T] fp32, contiguous
    H,
    P,
    T,
    HD,
    GROUP,
    scale,
    stride_qb,
    stride_qh,
    stride_qp,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,
    stride_vb,
    stride_vt,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[b, h, p, :] = softmax over valid keys of (q[b,h,p] . k[b, h // GROUP, t]) * scale.

    One program per (b, h, p) row; pass 1 keeps a running max / rescaled sum over ``BLOCK_T``
    chunks (online softmax, per lane, combined once at the end), pass 2 recomputes the scores
    and writes the normalised probabilities.
    """
    row = tl.program_id(0).to(tl.int64)
    p = row % P
    bh = row // P
    h = bh % H
    b = bh // H
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(
        q_ptr + b * stride_qb + h * stride_qh + p * stride_qp + offs_d * stride_qd,
        mask=offs_d < HD,
        other=0.0,
    ).to(tl.float32)
    k_base = k_ptr + b * stride_kb + (h // GROUP) * stride_kh
    valid_base = valid_ptr + b * stride_vb
    # pass 1: per-lane running max / rescaled sum (no cross-lane reduction inside the loop)
    m_vec = tl.full([BLOCK_T], NEG_INF, dtype=tl.float32)
    l_vec = tl.full([BLOCK_T], 0.0, dtype=tl.float32)
    for start in range(0, T, BLOCK_T):
        s, offs_t, in_t = _proxy_scores(
            q, k_base, valid_base, start, T, HD, scale, stride_kt, stride_kd, stride_vt, BLOCK_T, BLOCK_D
        )
        m_new = tl.maximum(m_vec, s)
        m_lane = tl.where(m_new == NEG_INF, 0.0, m_new)
        l_vec = l_vec * tl.exp(m_vec - m_lane) + tl.exp(s - m_lane)
        m_vec = m_new
    m = reduce_max(m_vec, axis=0)
    m_safe = tl.where(m == NEG_INF, 0.0, m)
    den = reduce_sum(l_vec * tl.exp(m_vec - m_safe), axis=0)
    has_valid = den > 0.0
    safe_den = tl.where(has_valid, den, 1.0)
    out_row = out_ptr + row * T
    for start in range(0, T, BLOCK_T):
        s, offs_t, in_t = _proxy_scores(
            q, k_base, valid_base, start, T, HD, scale, stride_kt, stride_kd, stride_vt, BLOCK_T, BLOCK_D
        )
        prob = tl.where(has_valid, tl.exp(s - m_safe) / safe_den, 0.0)
        tl.store(out_row + offs_t, prob, mask=in_t)


@triton.jit
def gathered_attention_kernel(
    q_ptr,  # [B, H, C, HD]
    k_ptr,  # [B, HKV, T, HD], same dtype as q
    v_ptr,  # [B, HKV, T, HD], same dtype as q
    valid_ptr,  # [B, T] uint8 (bool bytes)
    o_ptr,  # [B, H, C, HD] dtype of q, contiguous
    H,
    C,
    T,
    HD,
    GROUP,
    scale,
    stride_qb,
    stride_qh,
    stride_qc,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_vd,
    stride_mb,
    stride_mt,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """o[b, h, c] = softmax_t((q[b,h,c] . k[b,g,t]) * scale, valid keys) @ v[b,g], g = h // GROUP.

    Flash-attention style: one program per (b * H + h, block of ``BLOCK_M`` queries); keys and
    values stream in ``BLOCK_N`` chunks with an online softmax (running max ``m``, rescaled
    denominator ``l`` and accumulator ``acc`` in fp32).

    ``DOT_FP32=False`` (fp16 / bf16 inputs on GPU): both dots take the input dtype with fp32
    accumulation, the probabilities being cast to the value dtype for ``p @ v`` as in
    FlashAttention.  ``DOT_FP32=True`` (fp32 inputs, and any dtype under ``TRITON_INTERPRET=1``,
    whose ``tl.dot`` multiplies the raw uint16 storage of bf16 tiles as integers): q / k / v are
    upcast to fp32 and both dots use ``ieee`` precision (no TF32).  A bf16 x bf16 product is
    exact in fp32, so this differs from the GPU bf16 path only by summation order and by not
    rounding ``p`` to bf16.
    """
    bh = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1)
    h = bh % H
    b = bh // H
    g = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    in_m = offs_m < C
    in_d = offs_d < HD
    q = tl.load(
        q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qc + offs_d[None, :] * stride_qd,
        mask=in_m[:, None] & in_d[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    k_base = k_ptr + b * stride_kb + g * stride_kh
    v_base = v_ptr + b * stride_vb + g * stride_vh
    valid_base = valid_ptr + b * stride_mb
    m_i = tl.full([BLOCK_M], NEG_INF, dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
    for start in range(0, T, BLOCK_N):
        offs_t = start + offs_n
        in_t = offs_t < T
        kv_mask = in_t[:, None] & in_d[None, :]
        k = tl.load(
            k_base + offs_t[:, None] * stride_kt + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0
        )
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        ok = tl.load(valid_base + offs_t * stride_mt, mask=in_t, other=0) != 0
        s = tl.where(ok[None, :], s, NEG_INF)
        m_new = tl.maximum(m_i, reduce_max(s, axis=1))
        m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + reduce_sum(p, axis=1)
        v = tl.load(
            v_base + offs_t[:, None] * stride_vt + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0
        )
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    has_valid = l_i > 0.0
    out = tl.where(has_valid[:, None], acc / tl.where(has_valid, l_i, 1.0)[:, None], 0.0)
    o_rows = o_ptr + (bh * C + offs_m[:, None]) * HD + offs_d[None, :]
    tl.store(o_rows, out.to(o_ptr.dtype.element_ty), mask=in_m[:, None] & in_d[None, :])
