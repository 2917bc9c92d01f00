"""The one sparse-update mechanism shared by Polestar-Cache, Elastic-Cache and dLLM-Cache.

A sparse update recomputes, at each layer ``l``, some positions outside the current block (*members*) from their
stored layer input: their queries attend over the layer's current K/V and the MLP runs, giving their layer output,
the *update packet*. At layer ``l + 1`` the packet overwrites those positions' stored inputs and their K/V are
re-projected before any query attends (Polestar, Lee et al. 2026, "Polestar-Cache"; Elastic-Cache and dLLM-Cache
refresh the same way). All of it rides along the layer's one pass over its weights
(:meth:`polestar.models.backbone.DiffusionLM.layer_step`): the packet's rows and the strategy's query-only rows go
through q, k, v with the block's rows, and the members, gathered into a fixed-capacity buffer, go through
attention, o and the MLP with them. Nothing outside the chosen members is computed.

What differs between the three methods is a :class:`MemberStrategy`: which query-only rows it adds (Polestar's
cluster centroids, Elastic-Cache's tracked keys, dLLM-Cache's value probes), how it picks the members from what the
layer's pass shows it, where the stored inputs live (a :class:`RowStore` of the local window for Polestar, the
cache's per-layer hidden states for the baselines) and where members' queries come from.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from polestar.models.hooks import ExtraRows, LayerQKV, MemberRows
from polestar.models.layer_ops import LayerOps
from polestar.models.plan import DecodeCache
from polestar.stages import LayerHook


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


def make_window(block_start: int | torch.Tensor, block_length: int, shift: int, prefix: int, n_post: int,
                cache: DecodeCache) -> Window:
    """``prefix`` columns before the block starting at ``block_start`` (a 0-d long tensor inside a step, so a new
    block is a new value, not a new graph), stopping ``shift`` early (Dream recomputes ``block_start - 1`` with the
    block), and the ``n_post`` columns after the block (the caller clips them at the end of the sequence). The prefix
    always has ``prefix`` columns: the ones before column 0 stand at column 0 and are invalid, as left padding is,
    so a row's window (its size, its cluster split, the columns of its valid tokens counted from the block) is the
    same alone and in a batch with longer prompts."""
    device = cache.key_valid.device
    pre = block_start - shift - prefix + torch.arange(prefix, device=device)
    post = block_start + block_length + torch.arange(n_post, device=device)
    positions = torch.cat([pre.clamp_min(0), post])
    inside = torch.cat([pre >= 0, torch.ones(n_post, dtype=torch.bool, device=device)])
    valid = cache.key_valid.index_select(1, positions) & inside[None, :]
    return Window(positions, valid, prefix)


class Selection(NamedTuple):
    """The members a strategy picked at one layer.

    ``rows``: ``[B, M]`` long store rows (the store's trash row where not valid); ``valid``: ``[B, M]`` bool;
    ``q``: ``[B, H, M, hd]`` their queries after RoPE, or None (the mechanism then projects them from their inputs:
    one more pass over the layer's q weight, counted); ``inputs``: ``[B, M, d]`` their layer inputs, or None (read
    from the store); ``slots``: ``[B, M]`` their cache slots, or None (``strategy.slots(rows)``); ``joined``: ``q``
    and ``inputs`` already hold the plan's rows first (``[B, H, C + M, hd]``, ``[B, C + M, d]``: a strategy that
    gathers its members straight into the layer's attention rows, one operation).
    """

    rows: torch.Tensor
    valid: torch.Tensor
    q: torch.Tensor | None = None
    inputs: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    joined: bool = False


class Packet(NamedTuple):
    """One layer's member outputs on their way to the next layer: ``rows``, ``valid``, ``slots`` (their cache slots)
    ``[B, M]``, ``out [B, M, d]``."""

    rows: torch.Tensor
    valid: torch.Tensor
    out: torch.Tensor
    slots: torch.Tensor


class HiddenStore:
    """The cache's per-layer input hidden states as a row store: rows are cache slots (``T`` is the trash slot).

    ``read(layer, rows [B, M])`` → ``[B, M, d]``; ``write(layer, rows, valid, values [B, M, d])`` overwrites the
    valid rows in place.
    """

    def __init__(self, cache: DecodeCache):
        self.cache = cache
        self.trash = cache.trash

    def read(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        stored = self.cache.hidden[layer]
        return stored.gather(1, rows[..., None].expand(-1, -1, stored.shape[-1]))

    def write(self, layer: int, rows: torch.Tensor, valid: torch.Tensor, values: torch.Tensor) -> None:
        stored = self.cache.hidden[layer]
        target = torch.where(valid, rows, self.trash)
        stored.scatter_(1, target[..., None].expand(-1, -1, stored.shape[-1]), values.to(stored.dtype))


class MemberStrategy:
    """How a sparse-refresh method picks its members (see the module docstring).

    ``store``: where members' layer inputs live (``read`` / ``write`` by row, see :class:`HiddenStore`);
    ``trash``: the store's trash row; ``wants_old``: :meth:`on_write` needs the rows' previous values;
    ``wants_head``: the last layer's members get logits (the update packet handed to the commit rule).
    """

    store: object
    trash: int
    wants_old = False
    wants_head = False

    def slots(self, rows: torch.Tensor) -> torch.Tensor:
        """Cache slots ``[B, M]`` of store rows ``[B, M]`` (the cache's trash slot for the trash row)."""
        raise NotImplementedError  # pragma: no cover

    def extra_rows(self, layer: int, h: torch.Tensor, packet: Packet | None, kv: ExtraRows | None,
                   meter) -> ExtraRows | tuple[ExtraRows, ...] | None:
        """The rows this layer's q/k/v pass computes besides the plan's: ``kv`` (the packet's K/V rows, or None)
        plus any query-only rows of the strategy (several :class:`ExtraRows` as a tuple; ``meter``: for embedding
        reads)."""
        return kv

    def select(self, layer: int, qkv: LayerQKV, packet: Packet | None) -> Selection | None:
        raise NotImplementedError  # pragma: no cover

    def on_write(self, layer: int, packet: Packet, old: torch.Tensor | None) -> None:
        """Called after the packet was written into the store at ``layer`` (``old``: previous values or None)."""

    def write_packet(self, layer: int, packet: Packet) -> None:
        """Write ``packet`` into the store at ``layer`` (its unused rows are the trash row) and call :meth:`on_write`
        with the rows' previous values when :attr:`wants_old`. A strategy may do all of it in one operation."""
        old = self.store.read(layer, packet.rows) if self.wants_old else None
        self.store.write(layer, packet.rows, None, packet.out)
        self.on_write(layer, packet, old)


class SparseUpdate(LayerHook):
    """The per-step :class:`~polestar.stages.LayerHook` of a sparse update driven by a :class:`MemberStrategy`.

    At each layer: the previous layer's packet is written into the store and its rows' K/V re-projected in the
    layer's q/k/v pass (:meth:`extra_rows`); the strategy picks members from what the pass shows it
    (:meth:`members`); their outputs become the next layer's packet (:meth:`after_layer`). ``evals [B]``: valid
    members per sequence, summed over layers (rows through the MLP, as ``token_layer_evals`` counts them; the
    packet's K/V re-projection rides along as a query-only row). With ``strategy.wants_head`` the last layer's
    members are exposed as ``head_rows [B, M, d]`` (with ``head_positions``, ``head_valid [B, M]``) for the LM head.
    ``ops``: the model operations it runs (:class:`~polestar.models.layer_ops.LayerOps`: members' queries the
    strategy did not give).
    """

    def __init__(self, strategy: MemberStrategy, ops: LayerOps, cache: DecodeCache, batch: int, device):
        self.strategy, self.ops, self.cache = strategy, ops, cache
        self.n_layers = ops.spec.n_layers
        self.packet_rows: Packet | None = None
        self.current: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.chosen: list[torch.Tensor] = []  # each layer's valid members [B, M_l], counted once after the pass
        self._none = torch.zeros(batch, dtype=torch.long, device=device)

    @property
    def evals(self) -> torch.Tensor:
        """``[B]`` long: valid members per sequence summed over the layers (one sum over the pass, read after it)."""
        if not self.chosen:
            return self._none
        return torch.cat(self.chosen, dim=1).sum(-1)

    def extra_rows(self, layer: int, h: torch.Tensor, meter) -> ExtraRows | tuple[ExtraRows, ...] | None:
        strategy, packet = self.strategy, self.packet_rows
        kv = None
        if packet is not None:
            strategy.write_packet(layer, packet)  # unused rows are the trash row (Selection)
            kv = ExtraRows(packet.out, None, packet.slots)  # rotated by their slots' positions (trash: the trash slot)
        return strategy.extra_rows(layer, h, packet, kv, meter)

    def members(self, layer: int, qkv: LayerQKV) -> MemberRows | None:
        sel = self.strategy.select(layer, qkv, self.packet_rows)
        self.packet_rows = None
        if sel is None:
            self.current = None
            return None
        inputs = sel.inputs if sel.inputs is not None else self.strategy.store.read(layer, sel.rows)
        slots = sel.slots if sel.slots is not None else self.strategy.slots(sel.rows)
        q = sel.q
        if q is None:
            positions = self.cache.positions.gather(1, slots)
            q = self.ops.project_queries(layer, inputs, positions, qkv.meter)
        self.current = (sel.rows, sel.valid, slots)
        self.chosen.append(sel.valid)
        if self.detail is not None:  # an observer records: the members' cache positions
            self.detail.refreshed[layer] = (slots, sel.valid)
        return MemberRows(q, inputs, sel.joined)

    def after_layer(self, layer: int, out: torch.Tensor) -> None:
        rows, valid, slots = self.current
        if layer < self.n_layers - 1:
            self.packet_rows = Packet(rows, valid, out, slots)
        elif self.strategy.wants_head:
            self.head_rows = out
            self.head_positions = slots
            self.head_valid = valid
