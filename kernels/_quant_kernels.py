"""Triton kernels for NVFP4 quantization (imported only when Triton is available).

All roundings are done with explicit integer / comparison arithmetic and IEEE ``div_rn`` so the
codes and scales are bit-identical to the torch reference in :mod:`polestar.kernels.quant`, on
GPU and under the interpreter alike.  A program handles ``BLOCK_B`` quantization blocks of 16
elements; even and odd elements are loaded as two ``[BLOCK_B, 8]`` tiles, which makes the
packing (low nibble = even element) a plain ``lo | hi << 4``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common_kernels import reduce_max

E4M3_MIN_NORMAL = tl.constexpr(0.015625)  # 2**-6
E4M3_MAX = tl.constexpr(448.0)
FP4_MAX = tl.constexpr(6.0)


@triton.jit
def fp4_codes(v):
    """fp32 -> e2m1 code (sign << 3 | index into {0,.5,1,1.5,2,3,4,6}), RNE ties, saturating."""
    a = tl.abs(v)
    idx = (
        (a > 0.25).to(tl.uint8)
        + (a >= 0.75).to(tl.uint8)
        + (a > 1.25).to(tl.uint8)
        + (a >= 1.75).to(tl.uint8)
        + (a > 2.5).to(tl.uint8)
        + (a >= 3.5).to(tl.uint8)
        + (a > 5.0).to(tl.uint8)
    )
    return idx | ((v < 0.0).to(tl.uint8) << 3)


@triton.jit
def fp4_values(code):
    """e2m1 code (uint8, low 4 bits) -> fp32 value."""
    idx = (code & 7).to(tl.int32)
    e = idx >> 1
    m = (idx & 1).to(tl.float32)
    pow2 = (1 << (tl.maximum(e, 1) - 1)).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * pow2)
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def e4m3_round(s):
    """Round positive fp32 in [2**-6, 448] to float8 e4m3fn (RNE): returns (byte uint8, value fp32)."""
    bits = s.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFFF + ((bits >> 20) & 1)
    bits = (bits >> 20) << 20
    byte = (((bits >> 23) - 120) << 3) | ((bits >> 20) & 7)
    return byte.to(tl.uint8), bits.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_decode(byte):
    """float8 e4m3fn bit pattern (uint8) -> fp32 (normals and subnormals; NaN not handled)."""
    b = byte.to(tl.uint32)
    e = (b >> 3) & 15
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # m * 2**-9
    mag = tl.where(e == 0, sub, normal)
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def bf16_rne_bits(v):
    """fp32 -> bfloat16 bit pattern (int16) with round-to-nearest-even (finite inputs)."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def nvfp4_quant_kernel(x_ptr, gs_ptr, packed_ptr, scale_ptr, NB, BPR, BLOCK_B: tl.constexpr):
    """x [NB*16] -> packed [NB*8] uint8, scale [NB] e4m3 bytes.

    Block ``b`` uses the global scale ``gs_ptr[b // BPR]``: ``BPR`` = blocks per row for per-row
    scales (``gs [NB // BPR]``), ``BPR >= NB`` for one per-tensor scale (``gs [1]``).
    """
    blk = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    mask_b = blk < NB
    i = tl.arange(0, 8)
    mask = mask_b[:, None]
    even = blk[:, None] * 16 + 2 * i[None, :]
    xe = tl.load(x_ptr + even, mask=mask, other=0.0).to(tl.float32)
    xo = tl.load(x_ptr + even + 1, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gs_ptr + blk // BPR, mask=mask_b, other=1.0)
    amax = tl.maximum(reduce_max(tl.abs(xe), axis=1), reduce_max(tl.abs(xo), axis=1))
    six = tl.full([BLOCK_B], FP4_MAX, dtype=tl.float32)
    s = tl.math.div_rn(tl.math.div_rn(amax, six), g)
    s = tl.minimum(tl.maximum(s, E4M3_MIN_NORMAL), E4M3_MAX)
    byte, s_q = e4m3_round(s)
    total = tl.broadcast_to((g * s_q)[:, None], (BLOCK_B, 8))
    lo = fp4_codes(tl.math.div_rn(xe, total))
    hi = fp4_codes(tl.math.div_rn(xo, total))
    tl.store(packed_ptr + blk[:, None] * 8 + i[None, :], lo | (hi << 4), mask=mask)
    tl.store(scale_ptr + blk, byte, mask=mask_b)


@triton.jit
def nvfp4_dequant_kernel(
    packed_ptr, scale_ptr, gs_ptr, out_ptr, NB, BPR, BF16_BITS: tl.constexpr, BLOCK_B: tl.constexpr
):
    """packed [NB*8], scale [NB] e4m3 bytes -> out [NB*16] = fp4 * (gs[b // BPR] * block scale).

    ``BPR`` as in :func:`nvfp4_quant_kernel` (blocks per row, or ``>= NB`` for a per-tensor scale).
    """
    blk = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    mask_b = blk < NB
    i = tl.arange(0, 8)
    mask = mask_b[:, None]
    p = tl.load(packed_ptr + blk[:, None] * 8 + i[None, :], mask=mask, other=0)
    sb = tl.load(scale_ptr + blk, mask=mask_b, other=0)
    g = tl.load(gs_ptr + blk // BPR, mask=mask_b, other=1.0)
    total = (g * e4m3_decode(sb))[:, None]
    ve = fp4_values(p & 15) * total
    vo = fp4_values(p >> 4) * total
    even = blk[:, None] * 16 + 2 * i[None, :]
    if BF16_BITS:
        tl.store(out_ptr + even, bf16_rne_bits(ve), mask=mask)
        tl.store(out_ptr + even + 1, bf16_rne_bits(vo), mask=mask)
    else:
        tl.store(out_ptr + even, ve.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptr + even + 1, vo.to(out_ptr.dtype.element_ty), mask=mask)
