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
from polestar.stages import RefreshSelector
from polestar.state import DecodeState

from .refresh_basic import block_plan, block_start_plan


class _PacketHook:
    """Per-layer sparse update over candidate positions ``cand [B, N]`` using the cache's stored inputs."""

    def __init__(self, state: DecodeState, cache: DecodeCache, model, cand: torch.Tensor, cand_valid: torch.Tensor):
        self.state, self.cache, self.model = state, cache, model
        self.cand, self.cand_valid = cand, cand_valid
        self.rope_pos = cache.positions.gather(1, cand)
        self.packet = None
        self.evals = torch.zeros(state.batch_size, dtype=torch.long, device=state.x.device)

    def select(self, layer: int, inputs: torch.Tensor, h: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError  # pragma: no cover

    def before_attention(self, layer: int, h: torch.Tensor, index: torch.Tensor) -> None:
        model, cache = self.model, self.cache
        stored = cache.hidden[layer]
        d = stored.shape[-1]
        if self.packet is not None:
            out, members = self.packet
            target = torch.where(members, self.cand, cache.trash)
            stored.scatter_(1, target[..., None].expand(-1, -1, d), out)
            k, v = model.layer_kv(layer, out, self.rope_pos)
            model.write_kv(cache, layer, target, k, v)
            self.evals += members.sum(-1)
        inputs = stored.gather(1, self.cand[..., None].expand(-1, -1, d))
        if layer == 0:
            inputs = model.embed(self.state.x.gather(1, self.cand))
        members = self.select(layer, inputs, h, index) & self.cand_valid
        out, _ = model.layer_rows(layer, inputs, self.rope_pos, cache)
        self.evals += members.sum(-1)
        self.packet = (out, members)

    def after_layer(self, layer: int) -> None:
        pass


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

    def plan(self, state: DecodeState, cache: DecodeCache) -> Plan:
        if state.step == 0:
            return block_start_plan(state)
        return block_plan(state)

    def hook(self, state, plan, cache, model):
        ctx = state.extras.setdefault("elastic", {})
        if state.step == 0:
            ctx.clear()
            return _ElasticHook(self, state, cache, model, ctx, plan, build=True)
        return _ElasticHook(self, state, cache, model, ctx, plan, build=False)


class _ElasticHook(_PacketHook):
    compilable = False  # the trigger decides on the host, layer by layer
    def __init__(self, sel, state, cache, model, ctx, plan: Plan, build: bool):
        cand, valid = _outside_block(state, cache, 0)
        super().__init__(state, cache, model, cand, valid)
        self.sel, self.ctx, self.build = sel, ctx, build
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
        model, cache, ctx = self.model, self.cache, self.ctx
        k = self.sel.config.track_num
        if self.build:  # block start (full plan: slot == position): pick tracked keys, record their rows
            mass = self._tracked_rows(layer, h, index)
            tracked = mass[:, : cache.length].topk(k, dim=1).indices
            ctx.setdefault("tracked", []).append(tracked)
            t_in = h.gather(1, tracked[..., None].expand(-1, -1, h.shape[-1]))
            ctx.setdefault("prev", {})[layer] = model.query_probs(layer, t_in, cache.positions.gather(1, tracked), cache)
            return
        tracked = ctx["tracked"][layer]
        d = cache.hidden[layer].shape[-1]
        t_in = cache.hidden[layer].gather(1, tracked[..., None].expand(-1, -1, d))
        if self.packet is not None:
            super().before_attention(layer, h, index)  # applies the packet and recomputes (members = triggered)
        t_pos = cache.positions.gather(1, tracked)
        now = model.query_probs(layer, t_in, t_pos, cache)
        prev = ctx.setdefault("prev", {}).get(layer)
        if prev is not None:
            sim = F.cosine_similarity(now.flatten(2), prev.flatten(2), dim=-1).mean(dim=1)  # [B]
            self.triggered |= sim < self.sel.config.gamma
        ctx["prev"][layer] = now
        if self.packet is None and bool(self.triggered.any()):
            super().before_attention(layer, h, index)
        mass = self._tracked_rows(layer, h, index)
        ctx["tracked"][layer] = mass[:, : cache.length].topk(k, dim=1).indices

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

    def plan(self, state: DecodeState, cache: DecodeCache) -> Plan:
        g = state.extras.setdefault("dllm_step", 0)
        if state.step == 0 or g % self.config.prompt_interval == 0:
            return block_start_plan(state)
        if g % self.config.response_interval == 0:
            lo = state.prompt_len - state.logit_shift
            return span_plan(state.batch_size, lo, state.length, state.x.device, state.active,
                             state.block_start - state.logit_shift - lo)
        return block_plan(state)

    def hook(self, state, plan, cache, model):
        g = state.extras["dllm_step"]
        state.extras["dllm_step"] = g + 1
        if state.step == 0 or g % self.config.prompt_interval == 0 or g % self.config.response_interval == 0:
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
