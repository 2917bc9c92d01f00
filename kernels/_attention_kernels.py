"""Triton kernel for proxy attention (imported only when Triton is available).

The kernel computes scores ``(q . k) * scale`` with fp32 accumulation, masks keys whose
``key_valid`` byte is 0 (and the padding past ``T``) with ``-inf`` and uses a max-subtracted
softmax whose running maximum is replaced by 0 while it is still ``-inf``, so rows without any
valid key give all-zero probabilities instead of NaN.  GQA: query head ``h`` reads kv
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
    cos_base,
    sin_base,
    stride_ct,
    stride_cd,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROPE: tl.constexpr,
):
    """Scores ``[BLOCK_T]`` fp32 of one query ``q [BLOCK_D]`` against keys ``start .. start+BLOCK_T``; with
    ``ROPE`` the keys are first rotated by ``cos``/``sin`` (``k cos + rotate_half(k) sin`` in fp32, rounded to the
    keys' dtype, as the torch reference does)."""
    offs_t = start + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    in_t = offs_t < T
    in_td = in_t[:, None] & (offs_d < HD)[None, :]
    k_raw = tl.load(k_base + offs_t[:, None] * stride_kt + offs_d[None, :] * stride_kd, mask=in_td, other=0.0)
    k = k_raw.to(tl.float32)
    if ROPE:
        half = HD // 2
        partner = tl.where(offs_d < half, offs_d + half, offs_d - half)
        k_partner = tl.load(
            k_base + offs_t[:, None] * stride_kt + partner[None, :] * stride_kd, mask=in_td, other=0.0
        ).to(tl.float32)
        rotated = tl.where((offs_d < half)[None, :], -k_partner, k_partner)
        cs = offs_t[:, None] * stride_ct + offs_d[None, :] * stride_cd
        cos = tl.load(cos_base + cs, mask=in_td, other=0.0)
        sin = tl.load(sin_base + cs, mask=in_td, other=0.0)
        k = (k * cos + rotated * sin).to(k_raw.dtype).to(tl.float32)
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
    cos_ptr,  # [B, T, HD] fp32 (any strides) when ROPE, else unused
    sin_ptr,
    stride_cb,
    stride_ct,
    stride_cd,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROPE: tl.constexpr,
):
    """out[b, h, p, :] = softmax over valid keys of (q[b,h,p] . k[b, h // GROUP, t]) * scale (with ``ROPE`` the
    keys rotated by ``cos[b, t]``, ``sin[b, t]`` first).

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
    cos_base = cos_ptr + b * stride_cb
    sin_base = sin_ptr + b * stride_cb
    # pass 1: per-lane running max / rescaled sum (no cross-lane reduction inside the loop)
    m_vec = tl.full([BLOCK_T], NEG_INF, dtype=tl.float32)
    l_vec = tl.full([BLOCK_T], 0.0, dtype=tl.float32)
    for start in range(0, T, BLOCK_T):
        s, offs_t, in_t = _proxy_scores(
            q, k_base, valid_base, start, T, HD, scale, stride_kt, stride_kd, stride_vt,
            cos_base, sin_base, stride_ct, stride_cd, BLOCK_T, BLOCK_D, ROPE,
        )  # fmt: skip
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
            q, k_base, valid_base, start, T, HD, scale, stride_kt, stride_kd, stride_vt,
            cos_base, sin_base, stride_ct, stride_cd, BLOCK_T, BLOCK_D, ROPE,
        )  # fmt: skip
        prob = tl.where(has_valid, tl.exp(s - m_safe) / safe_den, 0.0)
        tl.store(out_row + offs_t, prob, mask=in_t)

