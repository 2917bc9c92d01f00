"""Quantizers (kind ``quant``): how stored window hidden states (cluster residuals) are kept.

``encode(x [..., D]) → packed``, ``decode(packed) → [..., D]``. ``lossless`` quantizers store the values themselves
(exact); lossy ones store the residual member − centroid, as the paper describes for NVFP4.
"""

from __future__ import annotations

import attrs

from polestar.kernels.quant import fp8_dequantize, fp8_quantize, nvfp4_dequantize, nvfp4_quantize
from polestar.registry import register
from polestar.stages import Stage


class Quantizer(Stage):
    lossless: bool = False

    def encode(self, x):  # pragma: no cover - abstract
        raise NotImplementedError

    def decode(self, packed):  # pragma: no cover - abstract
        raise NotImplementedError


@register("quant", "none")
class NoQuant(Quantizer):
    """Identity: values kept in the model dtype."""

    lossless = True

    @attrs.frozen
    class Config:
        pass

    def encode(self, x):
        return x

    def decode(self, packed):
        return packed


@register("quant", "nvfp4")
class NVFP4Quant(Quantizer):
    """NVFP4: FP4 e2m1 values, one FP8 e4m3 scale per 16 values, one fp32 scale per tensor, 2 values per byte
    (NVIDIA Blackwell format; torchao ``NVFP4Tensor``). ``[..., D]`` → packed ``[..., D/2]`` uint8 + scales."""

    @attrs.frozen
    class Config:
        pass

    def encode(self, x):
        return nvfp4_quantize(x)

    def decode(self, packed):
        return nvfp4_dequantize(packed)


@register("quant", "fp8")
class FP8Quant(Quantizer):
    """FP8 e4m3 with one scale per row. ``[..., D]`` → e4m3 ``[..., D]`` + scale ``[..., 1]``."""

    @attrs.frozen
    class Config:
        pass

    def encode(self, x):
        return fp8_quantize(x)

    def decode(self, packed):
        return fp8_dequantize(packed)
