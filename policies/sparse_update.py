"""Machinery shared by the sparse-refresh selectors: the local window, the member store and the update packet.

A sparse update recomputes, at each layer ``l``, some window positions (*members*) from their stored layer input:
their queries attend over the layer's current K/V and the MLP runs, giving their layer output — the *update
packet*. At layer ``l + 1`` the packet overwrites those positions' stored inputs and their K/V are re-projected
before any query attends (Polestar, Lee et al. 2026, "Polestar-Cache"). Which members a layer picks is the only
thing that differs between Polestar (top-k drifting clusters), Elastic-Cache (everything from a layer upward) and
dLLM-Cache (the positions whose values changed most).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from polestar.models.plan import DecodeCache


class Window(NamedTuple):
    """Local window around the current block (the block itself excluded).

    ``positions``: ``[Nw]`` long, prefix columns then suffix columns; ``valid``: ``[B, Nw]`` bool (not padding);
    ``n_prefix``: number of prefix columns.
    """

    positions: torch.Tensor
    valid: torch.Tensor
    n_prefix: int

    @property
    def size(self) -> int:
        return self.positions.numel()


def make_window(block_start: int, block_end: int, shift: int, prefix: int, suffix: int, cache: DecodeCache) -> Window:
    """``prefix`` columns before the block (stopping ``shift`` early: Dream recomputes ``block_start - 1`` with the
    block) and ``suffix`` columns after it (clipped at the end of the sequence); columns are Python ints, so no host
    sync. The prefix always has ``prefix`` columns: the ones before column 0 stand at column 0 and are invalid, as
    left padding is, so a row's window (its size, its cluster split, the columns of its valid tokens counted from
    the block) is the same alone and in a batch with longer prompts."""
    device = cache.key_valid.device
    pre = torch.arange(block_start - shift - prefix, block_start - shift, device=device)
    post = torch.arange(block_end, min(cache.length, block_end + suffix), device=device)
    before_start = torch.cat([pre < 0, torch.zeros_like(post, dtype=torch.bool)])
    positions = torch.cat([pre.clamp_min(0), post])
    valid = cache.key_valid.index_select(1, positions) & ~before_start[None, :]
    return Window(positions, valid, pre.numel())


class MemberStore:
    """Per-layer stored inputs of the window positions, kept through a quantizer and an offloader.

    Lossless quantizers keep the values (``[B, Nw, d]``); lossy ones keep ``value − anchor`` (the residual to the
    block-start centroid of the member's cluster, ``anchor [B, Nw, d]``), as the paper stores NVFP4 residuals.
    ``get(layer)`` → ``[B, Nw, d]`` on the compute device; ``update(layer, mask [B, Nw], values [B, Nw, d])``
    re-encodes the rows where ``mask``.
    """

    def __init__(self, quant, offload, n_layers: int, device: torch.device, dtype: torch.dtype):
        self.quant, self.offload = quant, offload
        self.device, self.dtype = device, dtype
        self.stored: list = [None] * n_layers
        self.anchor: list = [None] * n_layers

    def put(self, layer: int, values: torch.Tensor, anchor: torch.Tensor | None) -> None:
        if self.quant.lossless or anchor is None:
            self.anchor[layer] = None
            payload = values
        else:
            self.anchor[layer] = anchor
            payload = values - anchor
        self.stored[layer] = self.offload.put(self.quant.encode(payload.contiguous()))

    def get(self, layer: int) -> torch.Tensor:
        payload = self.quant.decode(self.offload.fetch(self.stored[layer], self.device)).to(self.dtype)
        anchor = self.anchor[layer]
        return payload if anchor is None else payload + anchor

    def update(self, layer: int, mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Overwrite rows; returns the previous values ``[B, Nw, d]`` (for centroid shifts)."""
        old = self.get(layer)
        new = torch.where(mask[..., None], values.to(old.dtype), old)
        self.put(layer, new, self.anchor[layer])
        return old
