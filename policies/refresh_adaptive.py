"""Adaptive-refresh baselines as refresh selectors: Elastic-Cache and dLLM-Cache.

Both keep every layer's input hidden states (``needs_hidden``) and, between full refreshes, run the block plus
a per-layer sparse update: chosen positions are recomputed through the layer from their stored input and their
outputs overwrite the next layer's stored inputs and K/V (the same update-packet mechanism as Polestar).

* ``elastic`` — Elastic-Cache (Nguyen-Tri et al. 2025, "Attention Is All You Need for KV Cache in Diffusion
  LLMs"): at each layer the ``track_num`` keys most attended by the block in the previous forward are tracked;
  when the cosine similarity between their current and previous attention rows drops below ``gamma``, every
  position is recomputed from that layer upward.
* ``dllm-cache`` — dLLM-Cache (Liu et al. 2025): the prompt is refreshed every ``prompt_interval`` steps and the
  response every ``response_interval`` steps; in between, each layer recomputes the ``ratio`` of response
  positions whose value vectors (re-projected from their current inputs) differ most from the cached ones.

Shapes: candidates ``[B, N]`` positions; attention rows ``[B, H, R, T + 1]``; selection masks ``[B, N]``.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from attrs import validators as v

from polestar.models.plan import DecodeCache, Plan, span_plan
from polestar.registry import register
from polestar.stages import LayerHook, RefreshSelector
from polestar.state import DecodeState

from .refresh_basic import block_plan, block_start_plan


class _PacketHook(LayerHook):
    """Per-layer sparse update over candidate positions ``cand [B, N]`` using the cache's stored inputs;
    ``pending`` holds the previous layer's outputs ``[B, N, d]`` and members ``[B, N]`` until the next layer."""

    def __init__(self, state: DecodeState, cache: DecodeCache, model, cand: torch.Tensor, cand_valid: torch.Tensor):
        self.state, self.cache, self.model = state, cache, model
        self.cand, self.cand_valid = cand, cand_valid
        self.rope_pos = cache.positions.gather(1, cand)
        self.pending = None
        self.evals = torch.zeros(state.batch_size, dtype=torch.long, device=state.x.device)

    def select(self, layer: int, inputs: torch.Tensor, h: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError  # pragma: no cover

    def before_attention(self, layer: int, h: torch.Tensor, index: torch.Tensor) -> None:
        self.apply_pending(layer)
        self.recompute(layer, h, index)

    def apply_pending(self, layer: int) -> None:
        """Write the previous layer's member outputs as this layer's stored inputs and re-project their K/V."""
        if self.pending is None:
            return
        model, cache = self.model, self.cache
        stored = cache.hidden[layer]
        out, members = self.pending
        target = torch.where(members, self.cand, cache.trash)
        stored.scatter_(1, target[..., None].expand(-1, -1, stored.shape[-1]), out)
        k, v = model.layer_kv(layer, out, self.rope_pos)
        model.write_kv(cache, layer, target, k, v)
        self.evals += members.sum(-1)

    def recompute(self, layer: int, h: torch.Tensor, index: torch.Tensor) -> None:
        """Run this layer for the members ``select`` picks; their outputs become ``pending``."""
        model, cache = self.model, self.cache
        stored = cache.hidden[layer]
        inputs = stored.gather(1, self.cand[..., None].expand(-1, -1, stored.shape[-1]))
        if layer == 0:
            inputs = model.embed(self.state.x.gather(1, self.cand))
        members = self.select(layer, inputs, h, index) & self.cand_valid
        out, _ = model.layer_rows(layer, inputs, self.rope_pos, cache)
        self.evals += members.sum(-1)
        self.pending = (out, members)


def _outside_block(state: DecodeState, cache: DecodeCache, lo: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate positions ``[lo, T)`` minus the recomputed block span, valid where not padding."""
    s = state.block_start - state.logit_shift
    cols = torch.cat([torch.arange(min(lo, s), s), torch.arange(state.block_end, state.length)]).to(state.x.device)
    cand = cols[None, :].expand(state.batch_size, -1)
    return cand, cache.key_valid.gather(1, cand) & state.active[:, None]


@register("refresh", "elastic")
class ElasticRefresh(RefreshSelector):
    """Elastic-Cache trigger (see module docstring): ``gamma`` cosine bound, ``track_num`` tracked keys."""

    @attrs.frozen
    class Config:
        gamma: float = attrs.field(default=0.9, validator=[v.ge(0.0), v.le(1.0)])
        track_num: int = attrs.field(default=1, validator=v.ge(1))

    needs_hidden = True

    def init_state(self, state: DecodeState) -> ElasticState:
        return ElasticState()

    def begin_block(self, local: ElasticState, state: DecodeState) -> None:
        local.tracked.clear()
        local.prev.clear()

    def plan(self, state: DecodeState, cache: DecodeCache, local: ElasticState) -> Plan:
        if state.at_block_start:
            return block_start_plan(state)
        return block_plan(state)

    def hook(self, state, plan, cache, model, local: ElasticState):
        # the block start's full forward picks the tracked keys (nothing tracked yet since ``begin_block``)
        return _ElasticHook(self, state, cache, model, local, plan, build=not local.tracked)


@attrs.define
class ElasticState:
    """Per-generation state of :class:`ElasticRefresh`, reset at each block start: per layer the tracked keys
    ``tracked[l] [B, track_num]`` and their previous attention rows ``prev[l] [B, H, track_num, T+1]``."""

    tracked: list = attrs.field(factory=list)
    prev: dict = attrs.field(factory=dict)


class _ElasticHook(_PacketHook):
    compilable = False  # the trigger decides on the host, layer by layer
    def __init__(self, sel, state, cache, model, local: ElasticState, plan: Plan, build: bool):
        cand, valid = _outside_block(state, cache, 0)
        super().__init__(state, cache, model, cand, valid)
        self.sel, self.local, self.build = sel, local, build
        self.triggered = torch.zeros(state.batch_size, dtype=torch.bool, device=state.x.device)
        self.block_slots = plan.target_offset

    def _tracked_rows(self, layer, h, index):
        """Attention rows of the tracked keys' queries now ``[B, H, track, T+1]`` and the block's attention mass."""
        model, cache = self.model, self.cache
        bl = self.state.block_length
        hb = h[:, self.block_slots : self.block_slots + bl]
        pos_b = cache.positions.gather(1, index[:, self.block_slots : self.block_slots + bl])
        mass = model.query_probs(layer, hb, pos_b, cache).sum(dim=(1, 2))  # [B, T+1]
        return mass

    def before_attention(self, layer, h, index):
        model, cache, local = self.model, self.cache, self.local
        k = self.sel.config.track_num
        if self.build:  # block start (full plan: slot == position): pick tracked keys, record their rows
            mass = self._tracked_rows(layer, h, index)
            tracked = mass[:, : cache.length].topk(k, dim=1).indices
            local.tracked.append(tracked)
            t_in = h.gather(1, tracked[..., None].expand(-1, -1, h.shape[-1]))
            local.prev[layer] = model.query_probs(layer, t_in, cache.positions.gather(1, tracked), cache)
            return
        tracked = local.tracked[layer]
        d = cache.hidden[layer].shape[-1]
        t_in = cache.hidden[layer].gather(1, tracked[..., None].expand(-1, -1, d))
        self.apply_pending(layer)  # rows triggered below this layer: their new inputs and K/V here
        t_pos = cache.positions.gather(1, tracked)
        now = model.query_probs(layer, t_in, t_pos, cache)
        prev = local.prev.get(layer)
        if prev is not None:
            sim = F.cosine_similarity(now.flatten(2), prev.flatten(2), dim=-1).mean(dim=1)  # [B]
            self.triggered |= (sim < self.sel.config.gamma) & self.state.active
        local.prev[layer] = now
        # a row triggered here is recomputed from this layer upward, whatever the other rows do. Host read per
        # layer until some row triggers (skips the recompute while none has); the hook is not compilable for it
        if self.pending is not None or bool(self.triggered.any()):
            self.recompute(layer, h, index)
        mass = self._tracked_rows(layer, h, index)
        local.tracked[layer] = mass[:, : cache.length].topk(k, dim=1).indices

    def select(self, layer, inputs, h, index):
        return self.triggered[:, None].expand_as(self.cand)


@register("refresh", "dllm-cache")
class DLLMCacheRefresh(RefreshSelector):
    """dLLM-Cache (see module docstring): interval refreshes plus value-similarity-driven partial updates."""

    @attrs.frozen
    class Config:
        prompt_interval: int = attrs.field(default=50, validator=v.ge(1))
        response_interval: int = attrs.field(default=7, validator=v.ge(1))
        ratio: float = attrs.field(default=0.25, validator=[v.ge(0.0), v.le(1.0)])

    needs_hidden = True

    def plan(self, state: DecodeState, cache: DecodeCache, local=None) -> Plan:
        g = state.global_step
        if state.at_block_start or g % self.config.prompt_interval == 0:
            return block_start_plan(state)
        if g % self.config.response_interval == 0:
            lo = state.prompt_len - state.logit_shift
            return span_plan(state.batch_size, lo, state.length, state.x.device, state.active,
                             state.block_start - state.logit_shift - lo)
        return block_plan(state)

    def hook(self, state, plan, cache, model, local=None):
        g = state.global_step
        if state.at_block_start or g % self.config.prompt_interval == 0 or g % self.config.response_interval == 0:
            return None
        cand, valid = _outside_block(state, cache, state.prompt_len)
        if cand.shape[1] == 0:
            return None
        return _ValueChangeHook(state, cache, model, cand, valid, self.config.ratio)


class _ValueChangeHook(_PacketHook):
    def __init__(self, state, cache, model, cand, valid, ratio: float):
        super().__init__(state, cache, model, cand, valid)
        self.n_pick = max(1, round(ratio * cand.shape[1])) if ratio > 0 else 0

    def select(self, layer, inputs, h, index):
        if self.n_pick == 0:
            return torch.zeros_like(self.cand_valid)
        _, v_new = self.model.layer_kv(layer, inputs, self.rope_pos)
        hkv = v_new.shape[1]
        v_old = self.cache.v[layer].gather(2, self.cand[:, None, :, None].expand(-1, hkv, -1, v_new.shape[-1]))
        sim = F.cosine_similarity(v_new.float(), v_old.float(), dim=-1).mean(dim=1)  # [B, N]
        sim = sim.masked_fill(~self.cand_valid, float("inf"))
        pick = sim.topk(min(self.n_pick, sim.shape[1]), dim=1, largest=False).indices
        return torch.zeros_like(self.cand_valid).scatter_(1, pick, True)
