"""A quantizer (kind ``quant``): int8 with one fp32 scale per row (``amax(|row|) / 127``).

Contract (row-wise: row ``x[..., i, :]`` is encoded from that row alone): ``encode(x [..., D])`` -> an encoded
form; ``decode(encoded)`` -> ``[..., D]`` in ``x``'s dtype; ``to_leaves(encoded)`` -> a tuple of tensors
``[..., k]`` with ``x``'s leading dims (what a row store gathers and scatters); ``from_leaves(leaves, dim, dtype)``
-> the encoded form again. ``lossless = True`` promises ``decode(encode(x)) == x``.
Consumer: the ``polestar`` refresh selector's row store of the window's hidden states.
"""

from typing import NamedTuple

import attrs
import torch

import polestar
from polestar.policies.quant import Quantizer
from polestar.testing import check_stage


class Int8Rows(NamedTuple):
    """``values [..., D]`` int8, ``scale [..., 1]`` fp32 and the dtype ``decode`` returns."""

    values: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


@polestar.register("quant", "int8")
class Int8Quant(Quantizer):
    """Symmetric int8 per row: ``round(x / s)`` with ``s = amax(|row|) / 127`` (1 for an all-zero row).
    Leaves: ``(values [..., D] int8, scale [..., 1] fp32)``."""

    @attrs.frozen
    class Config:
        pass

    def encode(self, x):
        amax = x.float().abs().amax(-1, keepdim=True)
        scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
        return Int8Rows((x.float() / scale).round().clamp(-127, 127).to(torch.int8), scale, x.dtype)

    def decode(self, packed):
        return (packed.values.float() * packed.scale).to(packed.dtype)

    def to_leaves(self, packed):
        return packed.values, packed.scale

    def from_leaves(self, leaves, dim, dtype):
        return Int8Rows(leaves[0], leaves[1], dtype)


if __name__ == "__main__":
    check_stage("quant", "int8", ["contract", "laws"])
    model = polestar.load("tiny-llada")
    out = polestar.generate(model, ["3+4*2-5"], task="arith", policy="polestar", quant="int8")
    print(out.texts[0], out.pipeline.describe()["quant"])
