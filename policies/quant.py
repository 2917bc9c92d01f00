"""Quantizers (kind ``quant``): how stored window hidden states (cluster residuals) are kept.

``encode(x [..., D]) → packed``, ``decode(packed) → [..., D]``. ``lossless`` quantizers store the values themselves
(exact); lossy ones store the residual member − centroid, as the paper describes for NVFP4.

Every quantizer is **row-wise**: row ``x[..., i, :]`` is encoded from that row alone (no scale shared across rows),
so a store can gather and scatter rows in encoded form. ``to_leaves(packed)`` gives the encoded form as a tuple of
plain tensors, each ``[..., k]`` with the input's leading dims (float8 payloads viewed as uint8, so the leaves can be
indexed and compared byte for byte on any device); ``from_leaves(leaves, dim, dtype)`` rebuilds the form ``decode``
takes, for leaves gathered at any leading shape.
"""

from __future__ import annotations

import attrs
import torch

from polestar.contracts import expect_tensor, fail
from polestar.kernels.quant import (
    FP8Tensor,
    NVFP4Tensor,
    fp8_dequantize,
    fp8_quantize,
    nvfp4_dequantize,
    nvfp4_quantize,
)
from polestar.registry import register
from polestar.stage_kinds import StageKind, register_kind
from polestar.stages import Stage


class Quantizer(Stage):
    """A row-wise quantizer (see the module docstring).

    ``encode(x [..., D])`` → encoded form; ``decode(encoded)`` → ``[..., D]`` in the input dtype;
    ``to_leaves(encoded)`` → ``tuple`` of tensors ``[..., k_j]`` (the input's leading dims, row ``i`` of each leaf
    depends only on ``x[..., i, :]``); ``from_leaves(leaves, dim, dtype)`` → the encoded form of those rows
    (``dim`` = ``D``, ``dtype`` = the dtype ``decode`` returns).
    """

    lossless: bool = False
    #: the encoded form is the values themselves: ``to_leaves(encode(x))`` is ``(x,)`` (checked by the laws), so a
    #: store may read and write its rows without encoding (fused row operations)
    plain: bool = False

    def encode(self, x):  # pragma: no cover - abstract
        raise NotImplementedError

    def decode(self, packed):  # pragma: no cover - abstract
        raise NotImplementedError

    def to_leaves(self, packed) -> tuple[torch.Tensor, ...]:  # pragma: no cover - abstract
        raise NotImplementedError

    def from_leaves(self, leaves, dim: int, dtype: torch.dtype):  # pragma: no cover - abstract
        raise NotImplementedError


def check_quant_decode(stage, out, packed) -> None:
    """``decode(packed)`` is a floating tensor."""
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        fail(stage, "decode", out, "expected a floating tensor [..., D]")


def check_quant_round_trip(stage, x: torch.Tensor, y) -> None:
    """``y = decode(encode(x))`` has ``x``'s shape and dtype."""
    expect_tensor(stage, "decode", y, tuple(x.shape), f"a {x.dtype} tensor")
    if y.dtype != x.dtype:
        fail(stage, "decode", y, f"expected dtype {x.dtype} (the encoded input's)")


def quant_examples(gen: torch.Generator, n: int):
    """``n`` inputs ``(x [N, D],)`` of random sizes and magnitudes (1e-4 to 300), every other one with a zero row."""
    for i in range(n):
        rows, d = int(torch.randint(1, 5, (1,), generator=gen)), int(torch.randint(1, 49, (1,), generator=gen))
        x = torch.randn(rows, d, generator=gen) * (1e-4, 1.0, 300.0)[i % 3]
        if i % 2:
            x[0] = 0.0
        yield (x,)


def quant_laws(stage: Quantizer, x: torch.Tensor) -> None:
    """``decode(encode(x))``: ``x``'s shape and dtype, finite, exact for a lossless quantizer, the same twice, and
    ``from_leaves(to_leaves(...))`` decodes to the same values."""
    packed = stage.encode(x)
    y = stage.decode(packed)
    check_quant_round_trip(stage, x, y)
    assert torch.isfinite(y).all(), f"quant stage {stage.name!r} decoded non-finite values from finite input"
    if stage.lossless:
        assert torch.equal(y, x), f"quant stage {stage.name!r} is declared lossless but changed values"
    assert torch.equal(y, stage.decode(stage.encode(x.clone()))), f"quant stage {stage.name!r} is not deterministic"
    leaves = stage.to_leaves(packed)
    rebuilt = stage.decode(stage.from_leaves(tuple(leaves), x.shape[-1], x.dtype))
    assert torch.equal(rebuilt, y), f"quant stage {stage.name!r}: from_leaves(to_leaves(...)) decodes differently"
    if stage.plain:
        assert len(leaves) == 1 and leaves[0].dtype == x.dtype and torch.equal(leaves[0], x), (
            f"quant stage {stage.name!r} is declared plain but its leaves are not the values themselves")


QUANT = register_kind(StageKind(
    "quant", Quantizer, "how stored window hidden states are kept (row-wise encode / decode)",
    contract={"decode": check_quant_decode}, examples=quant_examples, laws=quant_laws, default="none"))


@register("quant", "none")
class NoQuant(Quantizer):
    """Identity: values kept in the model dtype. Leaves: ``(x [..., D],)``."""

    lossless = True
    plain = True

    @attrs.frozen
    class Config:
        pass

    def encode(self, x):
        return x

    def decode(self, packed):
        return packed

    def to_leaves(self, packed):
        return (packed,)

    def from_leaves(self, leaves, dim, dtype):
        return leaves[0]


@register("quant", "nvfp4")
class NVFP4Quant(Quantizer):
    """NVFP4 (NVIDIA Blackwell format; torchao ``NVFP4Tensor`` conventions): FP4 e2m1 values, one FP8 e4m3 scale per
    16 values, and one fp32 global scale per row ``amax(|row|) / (448 · 6)`` (the format's per-tensor scale taken
    per row, so rows encode independently); 2 values per byte, rows zero-padded to ``Dp = 16 · ⌈D / 16⌉``.

    ``[..., D]`` → :class:`~polestar.kernels.quant.NVFP4Tensor` with ``packed [..., Dp/2]`` uint8,
    ``block_scale [..., Dp/16]`` float8_e4m3fn, ``global_scale [..., 1]`` fp32. Leaves: ``(packed [..., Dp/2]
    uint8, block_scale bits [..., Dp/16] uint8, global_scale [..., 1] fp32)``.
    """

    @attrs.frozen
    class Config:
        pass

    def encode(self, x):
        return nvfp4_quantize(x, per_row=True)

    def decode(self, packed):
        return nvfp4_dequantize(packed)

    def to_leaves(self, packed):
        return packed.packed, packed.block_scale.view(torch.uint8), packed.global_scale

    def from_leaves(self, leaves, dim, dtype):
        codes, scale_bits, global_scale = leaves
        shape = torch.Size((*codes.shape[:-1], dim))
        return NVFP4Tensor(codes, scale_bits.view(torch.float8_e4m3fn), global_scale, shape, dtype)


@register("quant", "fp8")
class FP8Quant(Quantizer):
    """FP8 e4m3 with one fp32 scale per row ``amax(|row|) / 448`` (standard per-token scaling).

    ``[..., D]`` → :class:`~polestar.kernels.quant.FP8Tensor` with ``data [..., D]`` float8_e4m3fn and
    ``scale [..., 1]`` fp32. Leaves: ``(data bits [..., D] uint8, scale [..., 1] fp32)``.
    """

    @attrs.frozen
    class Config:
        pass

    def encode(self, x):
        return fp8_quantize(x)

    def decode(self, packed):
        return fp8_dequantize(packed)

    def to_leaves(self, packed):
        return packed.data.view(torch.uint8), packed.scale

    def from_leaves(self, leaves, dim, dtype):
        data_bits, scale = leaves
        return FP8Tensor(data_bits.view(torch.float8_e4m3fn), scale, dtype)
