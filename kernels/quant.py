"""Quantization of cluster residuals: NVFP4 (paper default), per-row FP8 and identity.

Polestar (Lee et al., 2026, "Polestar: Drift-Aware Cache Calibration and Token Commitment") stores each cluster
member as its residual ``member - centroid`` quantized to NVFP4 to keep the cache small.  NVFP4 (NVIDIA Blackwell
format; conventions as in torchao ``prototype/mx_formats/nvfp4_tensor.py``) is two-level:

* fp32 global scale ``g = amax(|x|) / (448 * 6)`` (``g = 1`` for an all-zero tensor), either one per
  tensor (``global_scale []``, the default) or, with ``per_row=True``, one per row ``x[..., i, :]``
  (``global_scale [..., 1]``, amax over the last dim; ``g = 1`` for an all-zero row).  Per-row
  scales make every row's encoding depend on that row only, so encoded rows can be gathered and
  scattered on their own (the row store of the sparse refresh relies on this);
* per 16-element block scale ``s = clamp(amax(block) / 6 / g, 2**-6, 448)`` rounded (RNE) to
  ``float8_e4m3fn`` (the lower clamp is torchao's ``E4M3_EPS``: scales are always e4m3 normals);
* elements ``x / (g * s)`` rounded to the FP4 e2m1 grid ``{0, .5, 1, 1.5, 2, 3, 4, 6}`` with sign,
  round-to-nearest-even on ties, saturating at 6.  A code is 4 bits: bit 3 = sign, bits 0-2 =
  index into the grid (this is the e2m1 bit pattern); two codes per uint8, the *even* element in
  the low nibble.  Dequantization is ``grid[code] * (g * s)`` in fp32, cast to the input dtype.

The last dim ``D`` must be a multiple of 16 for the hardware format; other sizes are zero-padded
to ``Dp = 16 * ceil(D / 16)`` (the padding is stored: ``packed`` is ``[..., Dp // 2]``) and
cropped on dequantization.  Inputs must be finite fp32 / fp16 / bf16.

The Triton kernels (:func:`nvfp4_quantize_triton`, :func:`nvfp4_dequantize_triton`) produce
bit-identical codes, scales and (fp32 / bf16 / fp16) outputs to the references, in both scale modes
(the dequantizers read the mode from ``global_scale``: ``[]`` per tensor, ``[..., 1]`` per row).  The
dispatchers :func:`nvfp4_quantize` / :func:`nvfp4_dequantize` pick one with ``backend``.
The quantizers by name are the ``quant`` stages of the stage registry (:mod:`polestar.policies.quant`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ._backend import HAS_TRITON, next_pow2, pick, require_triton
from ._library import register_op

if HAS_TRITON:
    from . import _quant_kernels

__all__ = [
    "FP4_E2M1_GRID",
    "FP4_E2M1_MAX",
    "FP8_E4M3_MAX",
    "HAS_TRITON",
    "NVFP4_BLOCK_SIZE",
    "FP8Tensor",
    "NVFP4Tensor",
    "fp4_decode",
    "fp4_encode",
    "fp8_dequantize",
    "fp8_quantize",
    "nvfp4_dequantize",
    "nvfp4_dequantize_triton",
    "nvfp4_global_scale",
    "nvfp4_quantize",
    "nvfp4_quantize_triton",
    "nvfp4_row_scale",
    "pack_fp4",
    "reference_nvfp4_dequantize",
    "reference_nvfp4_quantize",
    "sqnr_db",
    "unpack_fp4",
]

NVFP4_BLOCK_SIZE = 16
FP4_E2M1_MAX = 6.0
FP8_E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
FP4_E2M1_GRID: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Non-negative FP4 e2m1 values; code ``i`` (0..7) is ``FP4_E2M1_GRID[i]``, code ``8 + i`` its negation."""

# (threshold, inclusive) pairs: index = number of thresholds passed; ties go to the even mantissa
_FP4_THRESHOLDS: tuple[tuple[float, bool], ...] = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)
_BLOCK_B = 128  # quantization blocks per Triton program


class NVFP4Tensor(NamedTuple):
    """An NVFP4-quantized tensor (output of :func:`reference_nvfp4_quantize`).

    Attributes:
        packed: ``[..., Dp // 2]`` uint8, two e2m1 codes per byte (even element in the low nibble).
        block_scale: ``[..., Dp // 16]`` float8_e4m3fn per-block scales.
        global_scale: ``[]`` fp32 per-tensor scale, or ``[..., 1]`` fp32 per-row scales (``per_row=True``).
        shape: original shape ``[..., D]`` (``Dp`` = ``D`` rounded up to a multiple of 16).
        dtype: original dtype (dequantization returns it).
    """

    packed: Tensor
    block_scale: Tensor
    global_scale: Tensor
    shape: torch.Size
    dtype: torch.dtype


class FP8Tensor(NamedTuple):
    """A per-row FP8 (e4m3) quantized tensor (output of :func:`fp8_quantize`).

    Attributes:
        data: ``[..., D]`` float8_e4m3fn values ``x / scale``.
        scale: ``[..., 1]`` fp32 per-row scale ``amax(|row|) / 448`` (1 for zero rows).
        dtype: original dtype.
    """

    data: Tensor
    scale: Tensor
    dtype: torch.dtype


# ----------------------------------------------------------------------------- FP4 codes


def fp4_encode(v: Tensor) -> Tensor:
    """Round to the FP4 e2m1 grid and return 4-bit codes (RNE on ties, saturating at +-6).

    Method: e2m1 (OCP MX / NVFP4 element format); code = ``sign << 3 | grid index``.

    Args:
        v: ``[...]`` float tensor (already divided by its scale).

    Returns:
        ``[...]`` uint8 codes in ``[0, 15]``.
    """
    a = v.float().abs()
    idx = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for thr, inclusive in _FP4_THRESHOLDS:
        idx += (a >= thr if inclusive else a > thr).to(torch.uint8)
    return idx | ((v < 0).to(torch.uint8) << 3)


def fp4_decode(codes: Tensor) -> Tensor:
    """4-bit e2m1 codes ``[...]`` (uint8, low 4 bits used) -> fp32 values ``[...]``."""
    grid = torch.tensor(FP4_E2M1_GRID, dtype=torch.float32, device=codes.device)
    lut = torch.cat([grid, -grid])
    return lut[(codes & 15).long()]


def pack_fp4(codes: Tensor) -> Tensor:
    """Pack codes ``[..., 2M]`` uint8 (values < 16) into ``[..., M]`` uint8, even element low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"last dim must be even, got {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_fp4`: ``[..., M]`` uint8 -> ``[..., 2M]`` uint8 codes."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


# ----------------------------------------------------------------------------- NVFP4 reference


def _padded_dim(d: int) -> int:
    return NVFP4_BLOCK_SIZE * math.ceil(d / NVFP4_BLOCK_SIZE)


def _pad_last(x: Tensor) -> Tensor:
    """Zero-pad the last dim to a multiple of 16: ``[..., D] -> [..., Dp]`` (contiguous)."""
    pad = _padded_dim(x.shape[-1]) - x.shape[-1]
    return (F.pad(x, (0, pad)) if pad else x).contiguous()


def divide_correctly_rounded(x: Tensor, divisor: float) -> Tensor:
    """``x / divisor``, correctly rounded (IEEE) on every device: ``x`` any shape, same shape out.

    A plain ``x / 6.0`` is not: CUDA's eager kernels turn a division by a Python number into a multiplication by
    its (rounded) reciprocal, which is one ulp off for about a third of the inputs; for bf16 rows about one NVFP4
    block in 2,500 then has its scale moved across an e4m3 rounding tie, and the block's codes differ from the
    Triton kernel's (``div_rn``). Dividing by a tensor keeps the IEEE division. (Inductor's GPU code
    rewrites a division by a constant the same way: compiled on a GPU, the quantizers run the Triton kernel.)
    """
    return x / x.new_full((), divisor)  # a 0-dim tensor on x's device, not a Python number


def nvfp4_global_scale(x: Tensor) -> Tensor:
    """NVFP4 per-tensor scale ``amax(|x|) / (448 * 6)`` as a ``[]`` fp32 tensor (1 if it would be 0).

    Method: torchao ``per_tensor_amax_to_scale``; chosen so that the largest block scale is
    exactly the e4m3 maximum 448.  ``x``: any shape.  No host sync.
    """
    if x.numel() == 0:
        return torch.ones((), dtype=torch.float32, device=x.device)
    g = divide_correctly_rounded(x.detach().abs().amax().float(), FP8_E4M3_MAX * FP4_E2M1_MAX)
    return torch.where(g > 0, g, torch.ones_like(g))


def nvfp4_row_scale(x: Tensor) -> Tensor:
    """NVFP4 per-row scale ``amax(|x[..., i, :]|) / (448 * 6)``: ``x [..., D]`` -> ``[..., 1]`` fp32 (1 where 0).

    The per-tensor rule of :func:`nvfp4_global_scale` applied to each row on its own.  No host sync.
    """
    if x.shape[-1] == 0:
        return torch.ones((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    g = divide_correctly_rounded(x.detach().abs().amax(-1, keepdim=True).float(), FP8_E4M3_MAX * FP4_E2M1_MAX)
    return torch.where(g > 0, g, torch.ones_like(g))


def _scale_of(x: Tensor, per_row: bool) -> Tensor:
    return nvfp4_row_scale(x) if per_row else nvfp4_global_scale(x)


def _check_quant_input(x: Tensor) -> None:
    if x.dim() == 0:
        raise ValueError("NVFP4 quantization needs at least one dimension")
    if not x.is_floating_point():
        raise TypeError(f"expected a floating-point tensor, got {x.dtype}")


def reference_nvfp4_quantize(x: Tensor, per_row: bool = False) -> NVFP4Tensor:
    """Quantize to NVFP4 (torch reference): two-level scaling, e4m3 block scales, packed e2m1 codes.

    Method: NVIDIA NVFP4 as in torchao (see the module docstring for every rounding rule);
    used by Polestar for the cluster residuals.  The last dim is zero-padded to a multiple of 16.

    Args:
        x: ``[..., D]`` finite fp32 / fp16 / bf16.
        per_row: one global scale per row (``[..., 1]``) instead of one per tensor (``[]``).

    Returns:
        :class:`NVFP4Tensor` with ``packed [..., Dp // 2]`` uint8, ``block_scale [..., Dp // 16]``
        float8_e4m3fn, ``global_scale`` fp32 ``[]`` (or ``[..., 1]`` when ``per_row``),
        ``shape = x.shape``, ``dtype = x.dtype``.
    """
    _check_quant_input(x)
    g = _scale_of(x, per_row)
    xp = _pad_last(x.float())
    blocks = xp.unflatten(-1, (-1, NVFP4_BLOCK_SIZE))  # [..., Dp/16, 16]
    amax = blocks.abs().amax(-1)
    scale = divide_correctly_rounded(amax, FP4_E2M1_MAX) / g
    scale = scale.clamp(E4M3_MIN_NORMAL, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    total = g * scale.float()
    codes = fp4_encode(blocks / total.unsqueeze(-1)).flatten(-2)
    return NVFP4Tensor(pack_fp4(codes), scale, g, x.shape, x.dtype)


def reference_nvfp4_dequantize(t: NVFP4Tensor) -> Tensor:
    """Dequantize an :class:`NVFP4Tensor` (torch reference): ``grid[code] * (g * s)``.

    Args:
        t: NVFP4Tensor with ``packed [..., Dp // 2]``, ``block_scale [..., Dp // 16]``,
            ``global_scale []`` or ``[..., 1]`` (broadcast over the blocks of a row).

    Returns:
        ``t.shape`` (= ``[..., D]``) tensor of ``t.dtype``.
    """
    vals = fp4_decode(unpack_fp4(t.packed)).unflatten(-1, (-1, NVFP4_BLOCK_SIZE))
    total = t.global_scale.float() * t.block_scale.float()
    out = (vals * total.unsqueeze(-1)).flatten(-2)
    return out[..., : t.shape[-1]].to(t.dtype)


# ----------------------------------------------------------------------------- NVFP4 triton


def _grid(num_blocks: int) -> tuple[int]:
    return (-(-num_blocks // min(_BLOCK_B, next_pow2(num_blocks))),)


def _nvfp4_quantize_fake(x: Tensor, per_row: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    lead, dp = x.shape[:-1], _padded_dim(x.shape[-1])
    return (
        x.new_empty((*lead, dp // 2), dtype=torch.uint8),
        x.new_empty((*lead, dp // NVFP4_BLOCK_SIZE), dtype=torch.float8_e4m3fn),
        x.new_empty((*lead, 1) if per_row else (), dtype=torch.float32),
    )


def _blocks_per_scale(global_scale: Tensor, num_blocks: int, dp: int) -> int:
    """Kernel argument ``BPR``: blocks per row for per-row scales (``[..., 1]``), else ``>= num_blocks``."""
    return dp // NVFP4_BLOCK_SIZE if global_scale.dim() > 0 else max(num_blocks, 1)


@register_op("nvfp4_quantize", fake=_nvfp4_quantize_fake)
def _nvfp4_quantize_op(x: Tensor, per_row: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``polestar::nvfp4_quantize``: ``x [..., D]`` -> ``(packed, block_scale, global_scale)``.

    ``global_scale`` is ``[]`` (per tensor) or ``[..., 1]`` (``per_row``).
    """
    g = _scale_of(x, per_row)
    xp = _pad_last(x)
    dp = xp.shape[-1]
    num_blocks = xp.numel() // NVFP4_BLOCK_SIZE
    packed = torch.empty((*xp.shape[:-1], dp // 2), dtype=torch.uint8, device=x.device)
    scale = torch.empty((*xp.shape[:-1], dp // NVFP4_BLOCK_SIZE), dtype=torch.float8_e4m3fn, device=x.device)
    if num_blocks > 0:
        block_b = min(_BLOCK_B, next_pow2(num_blocks))
        _quant_kernels.nvfp4_quant_kernel[_grid(num_blocks)](
            xp,
            g.contiguous().reshape(-1),
            packed,
            scale.view(torch.uint8),
            num_blocks,
            _blocks_per_scale(g, num_blocks, dp),
            BLOCK_B=block_b,
        )
    return packed, scale, g


def nvfp4_quantize_triton(x: Tensor, per_row: bool = False) -> NVFP4Tensor:
    """Triton version of :func:`reference_nvfp4_quantize`; codes and scales are bit-identical.

    Runs as the opaque op ``torch.ops.polestar.nvfp4_quantize(x, per_row)`` (which returns the
    three tensors; the :class:`NVFP4Tensor` is built here).

    Args:
        x: ``[..., D]`` finite fp32 / fp16 / bf16 (zero-padded to a multiple of 16).
        per_row: one global scale per row (``[..., 1]``) instead of one per tensor (``[]``).

    Returns:
        :class:`NVFP4Tensor` (``packed [..., Dp // 2]``, ``block_scale [..., Dp // 16]``,
        ``global_scale []`` or ``[..., 1]``, ...).
    """
    require_triton()
    _check_quant_input(x)
    packed, scale, g = torch.ops.polestar.nvfp4_quantize(x, per_row)
    return NVFP4Tensor(packed, scale, g, x.shape, x.dtype)


def _nvfp4_dequantize_fake(
    packed: Tensor, scale_bits: Tensor, global_scale: Tensor, d: int, dtype: torch.dtype
) -> Tensor:
    out = packed.new_empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=dtype)
    return out[..., :d]


@register_op("nvfp4_dequantize", fake=_nvfp4_dequantize_fake)
def _nvfp4_dequantize_op(
    packed: Tensor, scale_bits: Tensor, global_scale: Tensor, d: int, dtype: torch.dtype
) -> Tensor:
    """``polestar::nvfp4_dequantize``: ``packed [..., Dp // 2]`` ... -> ``[..., d]`` of ``dtype``.

    ``global_scale`` is ``[]`` (one per tensor) or ``[..., 1]`` (one per row).

    ``scale_bits`` is the e4m3 block scale viewed as uint8 (float8 inputs break the CPU schema
    check of ``torch.library.opcheck``, which compares inputs with ``allclose``).
    """
    packed = packed.contiguous()
    scale = scale_bits.contiguous()
    num_blocks = scale.numel()
    out = torch.empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=dtype, device=packed.device)
    is_bf16 = dtype == torch.bfloat16
    if num_blocks > 0:
        block_b = min(_BLOCK_B, next_pow2(num_blocks))
        _quant_kernels.nvfp4_dequant_kernel[_grid(num_blocks)](
            packed,
            scale,
            global_scale.float().contiguous().reshape(-1),
            out.view(torch.int16) if is_bf16 else out,
            num_blocks,
            _blocks_per_scale(global_scale, num_blocks, packed.shape[-1] * 2),
            BF16_BITS=is_bf16,
            BLOCK_B=block_b,
        )
    return out[..., :d]


def nvfp4_dequantize_triton(t: NVFP4Tensor) -> Tensor:
    """Triton version of :func:`reference_nvfp4_dequantize` (bit-identical for fp32/fp16/bf16).

    Runs as the opaque op ``torch.ops.polestar.nvfp4_dequantize(packed, block_scale bits as
    uint8, global_scale, D, dtype)``.

    Args:
        t: NVFP4Tensor with ``packed [..., Dp // 2]``, ``block_scale [..., Dp // 16]``,
            ``global_scale []`` or ``[..., 1]``.

    Returns:
        ``t.shape`` tensor of ``t.dtype`` (a view cropping the padding when ``D % 16 != 0``).
    """
    require_triton()
    scale_bits = t.block_scale.view(torch.uint8)
    return torch.ops.polestar.nvfp4_dequantize(t.packed, scale_bits, t.global_scale, t.shape[-1], t.dtype)


_NVFP4_Q = {"reference": reference_nvfp4_quantize, "triton": nvfp4_quantize_triton}
_NVFP4_DQ = {"reference": reference_nvfp4_dequantize, "triton": nvfp4_dequantize_triton}


def nvfp4_quantize(x: Tensor, backend: str = "auto", per_row: bool = False) -> NVFP4Tensor:
    """NVFP4-quantize ``x [..., D]`` -> :class:`NVFP4Tensor` (``packed [..., Dp // 2]`` ...).

    ``backend``: ``"auto"`` (Triton on CUDA when available), ``"triton"`` or ``"reference"``.
    ``per_row``: global scale ``[..., 1]`` per row instead of ``[]`` per tensor.
    See :func:`reference_nvfp4_quantize`.
    """
    return pick(_NVFP4_Q, backend, x)(x, per_row)


def nvfp4_dequantize(t: NVFP4Tensor, backend: str = "auto") -> Tensor:
    """Dequantize an :class:`NVFP4Tensor` to ``t.shape`` / ``t.dtype``; ``backend`` as in :func:`nvfp4_quantize`."""
    return pick(_NVFP4_DQ, backend, t.packed)(t)


# ----------------------------------------------------------------------------- FP8 and identity


def fp8_quantize(x: Tensor) -> FP8Tensor:
    """Per-row FP8 e4m3 quantization: ``scale = amax(|row|) / 448`` (1 for zero rows), ``x / scale``.

    Method: standard per-row (per-token) e4m3 scaling, an ablation alternative to NVFP4.

    Args:
        x: ``[..., D]`` finite floating tensor.

    Returns:
        :class:`FP8Tensor` with ``data [..., D]`` float8_e4m3fn and ``scale [..., 1]`` fp32.
    """
    _check_quant_input(x)
    x32 = x.float()
    amax = x32.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    data = (x32 / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return FP8Tensor(data, scale, x.dtype)


def fp8_dequantize(t: FP8Tensor) -> Tensor:
    """Inverse of :func:`fp8_quantize`: ``data [..., D] * scale [..., 1]`` -> ``[..., D]`` of ``t.dtype``."""
    return (t.data.float() * t.scale).to(t.dtype)


def sqnr_db(x: Tensor, x_hat: Tensor) -> Tensor:
    """Signal-to-quantization-noise ratio ``10 log10(sum x^2 / sum (x - x_hat)^2)`` in dB.

    Args:
        x: reference tensor, any shape; x_hat: its reconstruction, same shape.

    Returns:
        ``[]`` fp32 (``inf`` for a perfect reconstruction).
    """
    x32, e = x.float(), (x.float() - x_hat.float())
    return 10 * torch.log10(x32.pow(2).sum() / e.pow(2).sum())
