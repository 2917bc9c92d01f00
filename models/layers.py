"""Numeric building blocks shared by the LLaDA and Dream backbones: RMSNorm, half-split RoPE, SwiGLU."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back before the affine weight (LLaDA ``RMSLayerNorm``, Qwen2 ``RMSNorm``).

    Input ``[..., d]`` → output ``[..., d]`` in the input dtype.
    """

    def __init__(self, d: int, eps: float, bias: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.bias, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """:class:`RMSNorm` as a function of its weight, bias (or None) and epsilon. Inside ``torch.compile`` it is one
    opaque operator (:func:`_rms_norm_op`) that runs this same eager code, so a compiled layer normalizes bit for bit
    as an eager one: a compiler's own reduction order would change the last bits, and a decode's near-tie decisions
    (a confidence at the threshold, a drift rank) with them."""
    if torch.compiler.is_compiling():
        return _rms_norm_op(x, weight, bias, eps)
    return _rms_norm_eager(x, weight, bias, eps)


def _rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    dtype = x.dtype
    if dtype == weight.dtype == torch.float32 and bias is None:  # one fused op, bit-identical in fp32
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(dtype)
    return out if bias is None else out + bias


@torch.library.custom_op("polestar_models::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """:func:`rms_norm`'s eager code as one operator (what a compiled region calls)."""
    return _rms_norm_eager(x, weight, bias, eps)


@_rms_norm_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


class RopeTable(NamedTuple):
    """Rotary factors of ``X`` rows, laid out for rows of heads ``[B, X, n_heads, hd]``: ``factors [B, X, 2, hd]``
    fp32, the cosine at index 0 and the sine with its first half negated at index 1 (:meth:`Rotary.table`), so one
    gather looks both up and one concatenation joins two tables; :attr:`cos` and :attr:`sin` are their ``[B, X, 1,
    hd]`` views. Built once per plan and step, then shared by every layer that runs those rows."""

    factors: torch.Tensor

    @property
    def cos(self) -> torch.Tensor:
        return self.factors[:, :, 0:1]

    @property
    def sin(self) -> torch.Tensor:
        return self.factors[:, :, 1:2]

    def rows(self, index: torch.Tensor) -> RopeTable:
        """The factors of rows ``index [B, R]`` (indices into this table's ``X`` rows) → ``[B, R, 2, hd]``."""
        slot = index[:, :, None, None].expand(-1, -1, *self.factors.shape[2:])
        return RopeTable(self.factors.gather(1, slot))

    @staticmethod
    def join(tables) -> RopeTable:
        """The tables' rows one after another (one concatenation)."""
        tables = list(tables)
        if len(tables) == 1:
            return tables[0]
        return RopeTable(torch.cat([t.factors for t in tables], dim=1))

    def cat(self, other: RopeTable) -> RopeTable:
        """This table's rows followed by ``other``'s."""
        return RopeTable.join((self, other))


class Rotary(nn.Module):
    """Half-split rotary embedding (``rotate_half``), as LLaDA and Qwen2/Dream apply it.

    ``cos_sin(positions [B, C])`` → cos, sin ``[B, 1, C, head_dim]`` in fp32; ``apply(x [B, H, C, hd], cos, sin)``
    rotates in fp32 and returns the input dtype. The layer pass uses the same rotation in a form of fewer operations:
    :meth:`table` once per plan (``[B, X, 1, hd]`` factors, the sine's first half negated), then per layer
    :meth:`rotate` on rows of heads ``[B, X, n, hd]`` (q and k heads together): ``x cos + roll(x, hd/2) sin``, which is
    ``apply``'s ``x cos + rotate_half(x) sin`` exactly (a roll by half and a negated factor give the same products).
    """

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        # computed on the CPU and moved where the module is built: the first ``arange`` on the meta device (a model
        # built there to know its shapes, as every load does) costs ~1.3 s of one-time setup
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
        inv_freq = (1.0 / theta**exponents).to(torch.get_default_device())
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos(), emb.sin()

    def table(self, positions: torch.Tensor) -> RopeTable:
        """:class:`RopeTable` of RoPE ``positions [B, X]`` (the same cos and sin values as :meth:`cos_sin`)."""
        cos, sin = self.cos_sin(positions)
        half = sin.shape[-1] // 2
        signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return RopeTable(torch.cat((cos, signed), dim=1).transpose(1, 2).contiguous())

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [B, X, n, hd]`` rotated by a :class:`RopeTable`'s ``cos`` and ``sin`` (``[B, X, 1, hd]``), in fp32,
        returned in ``x``'s dtype."""
        xf = x.float()
        return (xf * cos + xf.roll(xf.shape[-1] // 2, dims=-1) * sin).to(x.dtype)
