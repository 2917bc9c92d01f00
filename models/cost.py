"""What one forward pass actually executes: weight bytes read, K/V bytes read, rows through each layer.

At small batch on a GPU a decoding step costs about the bytes it reads, so the backbone reports, as it runs, every
projection call (its whole weight is read once per call, whatever the number of rows), every embedding lookup
(only the gathered rows are read), every attention read of a layer's K/V cache, and every row that goes through a
layer. The counts are plain Python ints derived from tensor shapes, so a ``torch.compile``-d step returns them as
well (dynamo replays them, symbolic sizes included) and no host sync is needed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class StepCost(NamedTuple):
    """Counters of one forward pass (whole batch).

    ``weight_bytes``: bytes of weights read; ``kv_bytes``: bytes of cached K/V read by attention (proxy attention
    reads K only); ``layer_rows``: rows that went through a layer's MLP, summed over layers (block slots including
    padding and frozen rows, plus sparse-update member buffers at their full capacity); ``probe_rows``: rows that
    went only through a layer's input projections (proxy and tracking queries, and the update packet's K/V
    re-projection), summed over layers.
    """

    weight_bytes: int = 0
    kv_bytes: int = 0
    layer_rows: int = 0
    probe_rows: int = 0


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _linear_bytes(module: nn.Linear) -> int:
    return _bytes(module.weight) + _bytes(module.bias)


class LayerBytes(NamedTuple):
    """Bytes of one layer's weights as a pass reads them, computed once per model on the host
    (:meth:`of`): each projection's weight and bias, each norm's scale; ``qkv_pass`` (attention norm, q, k, v) and
    ``out_mlp_pass`` (o, MLP norm, gate, up, down) are the two parts of a layer's pass. A traced step adds these ints
    instead of deriving them from the tensors at every layer (what dynamo would otherwise trace once per layer)."""

    attn_norm: int
    q: int
    k: int
    v: int
    o: int
    mlp_norm: int
    gate: int
    up: int
    down: int
    qkv_pass: int
    out_mlp_pass: int

    @classmethod
    def of(cls, attn_norm: nn.Module, q: nn.Linear, k: nn.Linear, v: nn.Linear, o: nn.Linear, mlp_norm: nn.Module,
           gate: nn.Linear, up: nn.Linear, down: nn.Linear) -> LayerBytes:
        """From a layer's modules (norms count their scale only, projections weight and bias)."""
        an, mn = _bytes(attn_norm.weight), _bytes(mlp_norm.weight)
        qb, kb, vb, ob = (_linear_bytes(m) for m in (q, k, v, o))
        gb, ub, db = (_linear_bytes(m) for m in (gate, up, down))
        return cls(an, qb, kb, vb, ob, mn, gb, ub, db, an + qb + kb + vb, ob + mn + gb + ub + db)


class CostMeter:
    """Accumulates a :class:`StepCost` while a forward pass runs (one meter per pass)."""

    def __init__(self) -> None:
        self.weight_bytes = 0
        self.kv_bytes = 0
        self.layer_rows = 0
        self.probe_rows = 0

    def read(self, weight_bytes: int) -> None:
        """One pass over weights of ``weight_bytes`` bytes (a layer's part, from its :class:`LayerBytes`)."""
        self.weight_bytes += weight_bytes

    def weight(self, weight: torch.Tensor) -> None:
        """One pass over a raw weight (a norm's scale, a tied LM head)."""
        self.weight_bytes += _bytes(weight)

    def embedding(self, weight: torch.Tensor, rows: int) -> None:
        """An embedding lookup of ``rows`` rows reads only those rows."""
        self.weight_bytes += rows * weight.shape[-1] * weight.element_size()

    def attention(self, keys: torch.Tensor, values: torch.Tensor | None) -> None:
        """An attention read of the cached ``keys`` (and ``values``, None for probabilities only)."""
        self.kv_bytes += keys.numel() * keys.element_size()
        if values is not None:
            self.kv_bytes += values.numel() * values.element_size()

    def rows(self, layer_rows: int = 0, probe_rows: int = 0) -> None:
        self.layer_rows += layer_rows
        self.probe_rows += probe_rows

    def add(self, weight_bytes: int = 0, kv_bytes: int = 0, layer_rows: int = 0, probe_rows: int = 0) -> None:
        """Counts worked out by the caller, added in one call (a layer region's glue counts its whole layer at once:
        each call a compiled step traces costs it compile time at every layer)."""
        self.weight_bytes += weight_bytes
        self.kv_bytes += kv_bytes
        self.layer_rows += layer_rows
        self.probe_rows += probe_rows

    def result(self) -> StepCost:
        return StepCost(self.weight_bytes, self.kv_bytes, self.layer_rows, self.probe_rows)
