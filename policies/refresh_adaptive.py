"""Adaptive-refresh baselines as refresh selectors: Elastic-Cache and dLLM-Cache.

Both keep every layer's input hidden states (``needs_hidden``) and, between full refreshes, run the block plus
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
* ``dllm-cache`` — dLLM-Cache (Liu et al. 2025): the prompt is refreshed every ``prompt_interval`` steps and the
  response every ``response_interval`` steps; in between, each layer recomputes the ``ratio`` of response
  positions whose value vectors (re-projected from their current inputs) differ most from the cached ones. The
  value probes of every response position ride along the layer's q/k/v pass (the method's own cost: it compares
  every candidate's value); only the chosen ones go through attention and the MLP.

Shapes: candidates ``[B, N]`` positions; attention rows ``[B, H, R, T + 1]``; selection masks ``[B, N]``.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from attrs import validators as v

from polestar.models.backbone import ExtraRows, LayerQKV
from polestar.models.plan import DecodeCache, Plan, span_plan
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


@register("refresh", "dllm-cache")
class DLLMCacheRefresh(RefreshSelector):
    """dLLM-Cache (see module docstring): interval refreshes plus value-similarity-driven partial updates."""

    @attrs.frozen
    class Config:
        prompt_interval: int = attrs.field(default=50, validator=v.ge(1))
        response_interval: int = attrs.field(default=7, validator=v.ge(1))
        ratio: float = attrs.field(default=0.25, validator=[v.ge(0.0), v.le(1.0)])

    needs_hidden = True

    def phase(self, position: StepPosition, state: DecodeState, local=None) -> tuple[str, int]:
        """``("full", 0)``, ``("response", 0)`` (the response refresh), ``("sparse", n)`` with ``n`` candidate
        positions outside the block, or ``("block", 0)`` when there are none."""
        g = position.global_step
        if position.at_block_start or g % self.config.prompt_interval == 0:
            return "full", 0
        if g % self.config.response_interval == 0:
            return "response", 0
        n = outside_block_count(position, state, state.prompt_len)
        return ("sparse", n) if n > 0 else ("block", 0)

    def plan(self, state: DecodeState, cache: DecodeCache, local=None) -> Plan:
        kind = state.phase.refresh[0]
        if kind == "full":
            return block_start_plan(state)
        if kind == "response":
            lo = state.prompt_len - state.logit_shift
            return span_plan(state.batch_size, lo, state.length - lo, state.x.device, state.active,
                             state.clock.block_start - state.logit_shift - lo)
        return block_plan(state)

    def hook(self, state, plan, cache, model, local=None):
        kind, n = state.phase.refresh
        if kind != "sparse":
            return None
        cand, valid = _outside_block(state, cache, state.prompt_len, n)
        return SparseUpdate(_ValueChangeMembers(state, cache, model, cand, valid, self.config.ratio), model, cache,
                            state.batch_size, state.x.device)


class _ValueChangeMembers(_CandidateStrategy):
    """dLLM-Cache's member choice: the ``ratio`` of candidates whose value vectors, re-projected from their current
    inputs in the layer's pass, are least cosine-similar to the cached ones. Every candidate is a query-only row
    (its K/V are written only where it is in the packet, i.e. its input just changed)."""

    def __init__(self, state, cache, model, cand, valid, ratio: float):
        super().__init__(state, cache, model, cand, valid)
        self.n_pick = min(cand.shape[1], max(1, round(ratio * cand.shape[1]))) if ratio > 0 else 0

    def extra_rows(self, layer: int, h: torch.Tensor, packet: Packet | None, kv: ExtraRows | None,
                   meter) -> ExtraRows:
        self.inputs = self.candidate_inputs(layer, meter)
        kv_index = torch.full_like(self.cand, self.cache.trash)
        if packet is not None:  # the packet's rows re-project their K/V from their new inputs (already stored)
            in_packet = torch.zeros_like(self.cache.key_valid).scatter_(1, packet.rows, packet.valid)
            kv_index = torch.where(in_packet.gather(1, self.cand) & self.cand_valid, self.cand, self.cache.trash)
        return ExtraRows(self.inputs, self.cand_pos, kv_index)

    def select(self, layer: int, qkv: LayerQKV, packet: Packet | None) -> Selection:
        C, N = qkv.n_plan, self.cand.shape[1]
        if self.n_pick == 0:
            none = torch.zeros_like(self.cand_valid[:, :0])
            return Selection(self.cand[:, :0], none, qkv.q[:, :, C:C], self.inputs[:, :0])
        v_new = qkv.v[:, :, C : C + N]
        hkv = v_new.shape[1]
        v_old = self.cache.v[layer].gather(2, self.cand[:, None, :, None].expand(-1, hkv, -1, v_new.shape[-1]))
        sim = F.cosine_similarity(v_new.float(), v_old.float(), dim=-1).mean(dim=1)  # [B, N]
        # unchanged candidates sit at 1 - rounding noise, and that noise depends on the matmul's shape (the batch
        # size, the rows riding along): rounded to 2^-16 they tie, and ties go to the earlier column, so a row
        # picks the same members alone and in a batch
        sim = torch.round(sim * 65536.0).masked_fill(~self.cand_valid, float("inf"))
        pick = sim.argsort(dim=1, stable=True)[:, : self.n_pick]  # [B, n_pick]
        valid = self.cand_valid.gather(1, pick)
        rows = torch.where(valid, self.cand.gather(1, pick), self.trash)
        H, hd = qkv.q.shape[1], qkv.q.shape[3]
        q = qkv.q[:, :, C : C + N].gather(2, pick[:, None, :, None].expand(-1, H, -1, hd))
        inputs = self.inputs.gather(1, pick[..., None].expand(-1, -1, self.inputs.shape[-1]))
        return Selection(rows, valid, q, inputs)
