"""Adaptive-refresh baselines as refresh selectors: Elastic-Cache (dLLM-Cache: ``refresh_dllm``).

It keeps every layer's input hidden states (``needs_hidden``) and, between full refreshes, runs the block plus
a per-layer sparse update: chosen positions are recomputed through the layer from their stored input and their
outputs overwrite the next layer's stored inputs and K/V. It is the same mechanism as Polestar's
(:class:`~polestar.policies.sparse_update.SparseUpdate`, riding along each layer's one weight pass); only the
:class:`~polestar.policies.sparse_update.MemberStrategy` differs.

* ``elastic`` — Elastic-Cache (Nguyen-Tri et al. 2025, "Attention Is All You Need for KV Cache in Diffusion
  LLMs"): at each layer the ``track_num`` keys most attended by the block in the previous forward are tracked;
  when the cosine similarity between their current and previous attention rows drops below ``gamma``, every
  position is recomputed from that layer upward. The tracked keys' queries ride along the layer's q pass; the
  layer where a row first triggers projects the members' queries in a q pass of its own (the method decides
  after the layer's attention), which the cost counters include.

Shapes: candidates ``[B, N]`` positions; attention rows ``[B, H, R, T + 1]``; selection masks ``[B, N]``.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from attrs import validators as v

from polestar.models.backbone import ExtraRows, LayerQKV
from polestar.models.plan import DecodeCache, Plan
from polestar.registry import register
from polestar.stages import LayerHook, RefreshSelector
from polestar.state import DecodeState, StepPosition

from .refresh_basic import block_plan, block_start_plan
from .sparse_update import HiddenStore, MemberStrategy, Packet, Selection, SparseUpdate


def outside_block_count(position: StepPosition, state: DecodeState, lo: int) -> int:
    """How many positions of ``[lo, T)`` lie outside the recomputed block span ``[block_start - shift, block_end)``
    at ``position`` (host ints)."""
    s = position.block_start - state.logit_shift
    return (s - min(lo, s)) + (state.length - position.block_end)


def _outside_block(state: DecodeState, cache: DecodeCache, lo: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` candidate positions ``[B, n]`` of ``[lo, T)`` minus the recomputed block span (``n`` from
    :func:`outside_block_count`; the block's start from the device clock), valid where not padding."""
    shift = state.logit_shift
    s = state.clock.block_start - shift
    cols = torch.minimum(s, torch.full_like(s, lo)) + torch.arange(n, device=state.x.device)
    cols = torch.where(cols < s, cols, cols + state.block_length + shift)
    cand = cols[None, :].expand(state.batch_size, -1)
    return cand, cache.key_valid.gather(1, cand) & state.active[:, None]


class _CandidateStrategy(MemberStrategy):
    """Members drawn from candidate positions ``cand [B, N]`` (``cand_valid [B, N]``), stored in the cache's
    per-layer hidden states (store rows are cache slots)."""

    def __init__(self, state: DecodeState, cache: DecodeCache, model, cand: torch.Tensor, cand_valid: torch.Tensor):
        self.state, self.cache, self.model = state, cache, model
        self.cand, self.cand_valid = cand, cand_valid
        self.store = HiddenStore(cache)
        self.trash = cache.trash
        self.cand_pos = cache.positions.gather(1, cand)

    def slots(self, rows: torch.Tensor) -> torch.Tensor:
        return rows

    def candidate_inputs(self, layer: int, meter) -> torch.Tensor:
        """Current layer inputs of every candidate ``[B, N, d]`` (layer 0: the token embeddings)."""
        if layer == 0:
            tokens = self.state.x.gather(1, self.cand)
            meter.embedding(self.model.embedding_weight(), tokens.numel())
            return self.model.embed(tokens)
        return self.store.read(layer, self.cand)


@register("refresh", "elastic")
class ElasticRefresh(RefreshSelector):
    """Elastic-Cache trigger (see module docstring): ``gamma`` cosine bound, ``track_num`` tracked keys."""

    @attrs.frozen
    class Config:
        gamma: float = attrs.field(default=0.9, validator=[v.ge(0.0), v.le(1.0)])
        track_num: int = attrs.field(default=1, validator=v.ge(1))

    needs_hidden = True

    def init_state(self, state: DecodeState) -> ElasticState:
        B, L, k, device = state.batch_size, state.n_layers, self.config.track_num, state.x.device
        return ElasticState(torch.zeros(L, B, k, dtype=torch.long, device=device),
                            torch.zeros(L, B, state.n_heads, k, state.length + 1, device=device))

    def phase(self, position: StepPosition, state: DecodeState, local: ElasticState):
        """0 at a block start, else the number of candidate positions outside the block."""
        return 0 if position.at_block_start else outside_block_count(position, state, 0)

    def plan(self, state: DecodeState, cache: DecodeCache, local: ElasticState) -> Plan:
        if state.phase.refresh == 0:
            return block_start_plan(state)
        return block_plan(state)

    def hook(self, state, plan, cache, model, local: ElasticState):
        if state.phase.refresh == 0:  # the block start's full forward picks the tracked keys
            return _ElasticBuild(self, state, cache, model, local, plan.target_offset)
        strategy = _ElasticMembers(self, state, cache, model, local, plan.target_offset)
        return SparseUpdate(strategy, model, cache, state.batch_size, state.x.device)


@attrs.define
class ElasticState:
    """Per-generation state of :class:`ElasticRefresh` (preallocated, rewritten in place at each block start): per
    layer the tracked keys ``tracked [L, B, track_num]`` and their previous attention rows
    ``prev [L, B, H, track_num, T+1]``."""

    tracked: torch.Tensor
    prev: torch.Tensor


class _ElasticBuild(LayerHook):
    """Block start (full plan: slot == position): at each layer pick the tracked keys from the block's attention
    mass and record their attention rows, all from the layer's own q pass."""

    def __init__(self, sel, state: DecodeState, cache: DecodeCache, model, local: ElasticState, block_slots: int):
        self.sel, self.state, self.cache, self.model, self.local = sel, state, cache, model, local
        self.block_slots = block_slots
        self.evals = torch.zeros(state.batch_size, dtype=torch.long, device=state.x.device)

    def members(self, layer: int, qkv: LayerQKV) -> None:
        cache, local = self.cache, self.local
        tracked = _most_attended(self.model, cache, layer, qkv, self.block_slots, self.state.block_length,
                                 self.sel.config.track_num)
        H, hd = qkv.q.shape[1], qkv.q.shape[3]
        q_tracked = qkv.q.gather(2, tracked[:, None, :, None].expand(-1, H, -1, hd))
        local.tracked[layer].copy_(tracked)
        local.prev[layer].copy_(self.model.attention_probs(q_tracked, cache.k[layer], cache.key_valid, qkv.meter))
        return None


def _most_attended(model, cache: DecodeCache, layer: int, qkv: LayerQKV, block_slots: int, bl: int, k: int):
    """The ``k`` keys ``[B, k]`` the block's queries (plan slots ``[block_slots, block_slots + bl)``) attend to most,
    summed over heads and queries."""
    q_block = qkv.q.index_select(2, block_slots + torch.arange(bl, device=qkv.q.device))
    mass = model.attention_probs(q_block, cache.k[layer], cache.key_valid, qkv.meter).sum(dim=(1, 2))  # [B, T+1]
    return mass[:, : cache.length].topk(k, dim=1).indices


class _ElasticMembers(_CandidateStrategy):
    """Elastic-Cache's member choice: every candidate of a row, from the layer where its tracked keys' attention
    drifted past ``gamma`` upward.

    Fixed shape, decided in the graph per row: at every layer every candidate rides along the layer's q/k/v pass
    with its current input (the previous layer's output where its row has triggered, else its stored input;
    its K/V are rewritten only where its input changed) and goes through attention and the MLP as a member, valid
    only in rows that have triggered at this layer or below. The tracked keys' queries ride along as query-only
    rows. So a row's trigger needs no host read and no second q pass, and the counters count every candidate row
    at every layer: the price of deciding on the device what the method decides per layer.
    """

    def __init__(self, sel, state, cache, model, local: ElasticState, block_slots: int):
        cand, valid = _outside_block(state, cache, 0, state.phase.refresh)
        super().__init__(state, cache, model, cand, valid)
        self.sel, self.local, self.block_slots = sel, local, block_slots
        self.triggered = torch.zeros(state.batch_size, dtype=torch.bool, device=state.x.device)

    def extra_rows(self, layer: int, h: torch.Tensor, packet: Packet | None, kv: ExtraRows | None,
                   meter) -> ExtraRows:
        tracked = self.local.tracked[layer]
        t_in = self.store.read(layer, tracked)
        t_pos = self.cache.positions.gather(1, tracked)
        probes = ExtraRows(t_in, t_pos, torch.full_like(tracked, self.cache.trash))
        # rows triggered below this layer have new inputs (the packet, already stored): their K/V are re-projected
        changed = self.triggered[:, None] & self.cand_valid
        kv_index = torch.where(changed, self.cand, self.cache.trash)
        self.cand_inputs = self.candidate_inputs(layer, meter)
        cand = ExtraRows(self.cand_inputs, self.cand_pos, kv_index)
        return ExtraRows(*(torch.cat([a, b.to(a.dtype)], dim=1) for a, b in zip(cand, probes)))

    def select(self, layer: int, qkv: LayerQKV, packet: Packet | None) -> Selection:
        cache, local, model = self.cache, self.local, self.model
        C, n = qkv.n_plan, self.cand.shape[1]
        q_tracked = qkv.q[:, :, C + n :]
        now = model.attention_probs(q_tracked, cache.k[layer], cache.key_valid, qkv.meter)
        prev = local.prev[layer]
        sim = F.cosine_similarity(now.flatten(2), prev.flatten(2), dim=-1).mean(dim=1)  # [B]
        self.triggered = self.triggered | ((sim < self.sel.config.gamma) & self.state.active)
        if self.state.detail is not None:  # an observer records: the similarity and the rows triggered so far
            self.state.detail.similarity[layer] = sim
            self.state.detail.triggered[layer] = self.triggered
        local.prev[layer].copy_(now)
        local.tracked[layer].copy_(_most_attended(model, cache, layer, qkv, self.block_slots, self.state.block_length,
                                                  self.sel.config.track_num))
        # a row triggered here or below is recomputed from this layer upward, whatever the other rows do
        valid = self.triggered[:, None] & self.cand_valid
        rows = torch.where(valid, self.cand, self.trash)
        return Selection(rows, valid, qkv.q[:, :, C : C + n], self.cand_inputs)  # the inputs read for this pass
