"""The refresh plan and the preallocated decoding cache that a backbone executes it against."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .layer_regions import LayerCache
from .spec import ModelSpec


class Plan(NamedTuple):
    """Which positions each layer recomputes in one forward pass.

    ``index``: LongTensor ``[B, C]`` (the same positions at every layer), ``[n_layers, B, C]`` (per layer) or a
    tuple of ``n_layers`` LongTensors ``[B, C_l]`` (per layer, each layer as wide as it needs: a layer's rows are
    gathered from the stored layer inputs), values in ``[0, T]`` where ``T`` (the cache's *trash slot*) marks an
    unused slot. ``valid``: BoolTensor(s) of the same shape(s), False for unused slots (their writes land in the
    trash slot and their outputs are ignored).
    ``target_offset``: the slot holding the hidden state that predicts the first position of the current block
    (the engine reads slots ``target_offset + arange(block_length)``; for Dream's shifted logits the plan starts
    one position before the block): a Python int, or a 0-d long tensor where it moves with the block, or a
    ``[B, R]`` long tensor of per-row slots (a commit region whose columns differ per row, e.g. a sliding window).
    ``first_layer``: the first layer the plan runs (a Python int; with ``first_layer > 0`` the plan is per layer and
    layer ``first_layer`` reads its inputs from the cache's stored layer inputs: a recomputation from a layer up).
    """

    index: torch.Tensor
    valid: torch.Tensor
    target_offset: int | torch.Tensor = 0
    first_layer: int = 0

    @property
    def per_layer(self) -> bool:
        return isinstance(self.index, tuple) or self.index.dim() == 3

    def at(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.per_layer:
            return self.index[layer], self.valid[layer]
        return self.index, self.valid


class DecodeCache:
    """K/V (and optionally layer-input hidden states) for every layer, allocated once per generation and never
    reallocated (finished sequences stay in the batch, frozen), so its buffers keep static addresses.

    Shapes (``T`` = sequence length, one extra *trash slot* at index ``T`` absorbs writes of unused plan slots):
    ``k, v``: tuples of ``n_layers`` tensors ``[B, n_kv_heads, T + 1, head_dim]``, layer ``l``'s keys (stored after
    RoPE) and values; ``hidden``: a tuple of ``n_layers`` tensors ``[B, T + 1, d_model]``, the input of each layer
    (only when ``store_hidden``, else None); ``key_valid``: ``[B, T + 1]`` bool, False for left padding and the trash
    slot; ``positions``: ``[B, T + 1]`` long RoPE positions (left padding does not shift a prompt's positions);
    ``position_rope``: the rotary factors (a :class:`~polestar.models.layers.RopeTable`, ``[B, T + 1, 2, hd]``) of the
    positions ``0 .. T``, and ``slot_rope`` those of each slot's position (``[B, T + 1, 2, hd]``, rewritten in place by
    :meth:`reset`), both set by the model that makes the cache (``DiffusionLM.new_cache``: :meth:`set_rope`), else
    None.

    ``k_stack, v_stack``: the same keys and values as one ``[n_layers, B, n_kv_heads, T + 1, head_dim]`` tensor
    each, whose rows ``k`` and ``v`` are, and ``hidden_stack`` the stored inputs as one ``[n_layers, B, T + 1,
    d_model]`` (one write clears them all). A cache made under autograd keeps one tensor per layer instead (None
    here): a full forward under autograd saves every layer's keys, and a write into one row of a stack would bump the
    autograd version of all of them.
    """

    def __init__(self, spec: ModelSpec, attention_mask: torch.Tensor, dtype: torch.dtype, store_hidden: bool = False):
        B, T = attention_mask.shape
        device = attention_mask.device
        self.spec = spec
        self.length = T
        L = spec.n_layers

        def per_layer(*shape: int) -> tuple[torch.Tensor, ...]:
            return tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(L))

        kv_shape = (B, spec.n_kv_heads, T + 1, spec.head_dim)
        if torch.is_grad_enabled():
            self.k_stack = self.v_stack = None
            self.k, self.v = per_layer(*kv_shape), per_layer(*kv_shape)
        else:
            self.k_stack, self.v_stack = (torch.zeros(L, *kv_shape, dtype=dtype, device=device) for _ in range(2))
            self.k, self.v = self.k_stack.unbind(0), self.v_stack.unbind(0)
        #: bytes of one layer's keys (and of its values): what a read of the layer's cache counts, kept as an int so
        #: that a traced step adds it rather than tracing a size query on the buffer at every layer
        self.layer_kv_bytes = self.k[0].numel() * self.k[0].element_size()
        #: the stored layer inputs as one ``[n_layers, B, T + 1, d_model]`` tensor (rows ``hidden``), where stacked
        self.hidden_stack = None
        if not store_hidden:
            self.hidden = None
        elif torch.is_grad_enabled():
            self.hidden = per_layer(B, T + 1, spec.d_model)
        else:
            self.hidden_stack = torch.zeros(L, B, T + 1, spec.d_model, dtype=dtype, device=device)
            self.hidden = self.hidden_stack.unbind(0)
        self.key_valid, self.positions = _validity_and_positions(attention_mask)
        self.position_rope = None
        self.slot_rope = None

    def set_rope(self, position_rope) -> None:
        """Keep the rotary factors of every position ``0 .. T`` (a :class:`~polestar.models.layers.RopeTable`
        ``[B, T + 1, 2, hd]``) and look up those of every slot's position once (``slot_rope``): a step then takes
        its rows' factors with one gather by slot."""
        self.position_rope = position_rope
        self.slot_rope = position_rope.rows(self.positions)

    def reset(self, attention_mask: torch.Tensor) -> None:
        """Reuse this cache for a generation of the same shape with ``attention_mask [B, T]``, in place: its validity
        and positions rewritten, K/V and stored inputs zeroed (the buffers keep their addresses)."""
        key_valid, positions = _validity_and_positions(attention_mask)
        self.key_valid.copy_(key_valid)
        self.positions.copy_(positions)
        if self.slot_rope is not None:
            self.slot_rope.factors.copy_(self.position_rope.rows(self.positions).factors)
        for t in (*self.k, *self.v, *(self.hidden or ())):
            t.zero_()

    def layer(self, layer: int) -> LayerCache:
        """Layer ``layer``'s K/V and the key validity, as the layer regions take them
        (:class:`~polestar.models.layer_regions.LayerCache`)."""
        return LayerCache(self.k[layer], self.v[layer], self.key_valid)

    @property
    def trash(self) -> int:
        return self.length

    @property
    def batch_size(self) -> int:
        return self.key_valid.shape[0]


def _validity_and_positions(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``key_valid [B, T + 1]`` (False for padding and the trash slot) and RoPE ``positions [B, T + 1]``."""
    B = attention_mask.shape[0]
    device = attention_mask.device
    am = attention_mask.to(torch.bool)
    key_valid = torch.cat([am, torch.zeros(B, 1, dtype=torch.bool, device=device)], dim=1)
    pos = (am.long().cumsum(-1) - 1).clamp_min(0)
    return key_valid, torch.cat([pos, torch.zeros(B, 1, dtype=torch.long, device=device)], dim=1)


def full_plan(batch: int, length: int, device) -> Plan:
    """Every position at every layer: the plain full forward."""
    index = torch.arange(length, device=device).expand(batch, length)
    return Plan(index, torch.ones(batch, length, dtype=torch.bool, device=device), 0)


def span_plan(batch: int, start: int | torch.Tensor, size: int, device, active: torch.Tensor | None = None,
              target_offset: int | torch.Tensor = 0) -> Plan:
    """``size`` positions from ``start`` (a Python int, or a 0-d long tensor so that a new start is a new value, not
    a new graph) at every layer; rows where ``active`` ([B] bool) is False are all unused."""
    index = (start + torch.arange(size, device=device)).expand(batch, size)
    valid = torch.ones(batch, size, dtype=torch.bool, device=device)
    if active is not None:
        valid = valid & active[:, None]
    return Plan(index, valid, target_offset)
