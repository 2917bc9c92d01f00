"""d2Cache as a refresh selector (Jiang et al. 2025, "d2Cache: Accelerating Diffusion-Based LLMs via Dual Adaptive
Caching"), as its released code (Research dLLM) runs it.

The first forward of a generation computes every position. Every later forward recomputes only the *chosen rows*
(their K/V rewritten at every layer, their queries attending over all cached keys); every other position keeps the
K/V it was last computed with. The rows a forward recomputes are chosen after the previous step's commits:

1. **certainty density** of the masked positions: ``density[g]`` is the Gaussian-weighted (``sigma``) share of
   decoded positions around generation position ``g`` (left of the generation counts as decoded; right of it as the
   last position is). The score of a masked position is its confidence times its density; the current block's
   positions that were masked before the step get the row's highest score added (they rank first). The search
   range runs from the first of those to the first multiple of their count ``m`` at or after the ``current_k``-th
   masked position (``m``, not the block length: the released loop's block mask holds only the block's masked
   positions by then, ``check_can_generate`` narrows it in place); its ``current_k`` best-scoring masked positions
   are chosen (their predicting rows, one position earlier for Dream's shifted logits);
2. the positions the step just committed are chosen (their token changed: a revokable rule's re-masked positions
   too);
3. **attention rollout**: the forward's attention (mean over heads) of the recomputed rows at each layer, with the
   identity added and rows renormalised, multiplied layer after layer (rows not recomputed keep the identity); a
   position's importance is its column sum. Among the positions not yet chosen the nucleus of importance mass
   ``rollout_p`` (at least the most important one) is chosen;
4. with ``inflate_w > 0``, every position between two chosen positions at most ``inflate_w`` apart is chosen.

The density is computed exactly (a linear map, :func:`~polestar.policies.certainty.density_kernel`); the released
code convolves by FFT, whose rounding reaches about 1e-7 of the kernel's weight far from any decoded position (on
the comparisons with the released code in ``docs/policies.md`` the choice is the same either way). As the released
code runs it, the confidence of step 1 is the one every position had at the generation's first forward (the
released code's later updates of its confidence cache write into a copy and are lost), so this selector keeps that
one: at the first
forward the response rows' last layer is run a second time as extra rows and their logits taken once (counted).
Differences from the released code, each named where it is made:

* the rows of the current block's masked positions are always recomputed (the released code gives a masked block
  position it did not choose zero logits; at ``current_k >= block_length`` it always chooses them);
* a batch is not topped up to one row count per sequence (the released code pads every sequence to the batch's
  largest count), so a sequence recomputes the same rows alone and in a batch; the block bias is the row's own
  highest score, not the batch's;
* ``rollout_p = 1`` chooses every remaining position (the released code's cumulative sum can stop a few short of 1 by
  rounding).

Fixed shapes: ``("first",)`` every position (plan ``[B, T]``); ``("cached", C)``: the chosen rows in position order in
``C`` plan slots, the most chosen rows of a sequence rounded up to a multiple of :data:`GRANULE` (``C`` rides along
the loop's one host read, a thermometer code from :meth:`D2CacheRefresh.after_step`; at a block's first step, where
the loop reads no flags, the most rows the rules can choose, :meth:`D2CacheRefresh.most_rows`); unused slots are
invalid (they count in the run's totals, not in a sequence's own). Shapes: rollout ``[B, T + 1, T]`` (row ``T`` the
trash slot's), density and scores ``[B, G]``, attention of the plan rows ``[B, H, C, T + 1]``.
"""

from __future__ import annotations

import attrs
import torch
from attrs import validators as v

from polestar.models.cost import CostMeter
from polestar.models.hooks import MemberRows
from polestar.models.layer_ops import LayerOps
from polestar.models.plan import DecodeCache, Plan
from polestar.registry import register
from polestar.stages import AfterStep, Capability, LayerHook, RefreshSelector
from polestar.state import DecodeState, StepPosition

from .certainty import DensityKernel, certainty_density, density_kernel
from .refresh_basic import block_start_plan
from .refresh_elastic import GRANULE, query_slots

FIRST, CACHED = "first", "cached"


@attrs.define
class D2State:
    """Per-generation state of :class:`D2CacheRefresh` (allocated at the first generation of a shape, rewritten in
    place): ``member [B, T]`` bool the rows the next forward recomputes; ``before [B, T]`` long the tokens before the
    step; ``stepped [B]`` bool the rows the step decoded; ``rollout [B, T + 1, T]`` fp32 the step's attention
    rollout; ``eye [T + 1, T]`` its start; ``confidence [B, G]`` fp32 each generation position's confidence at the
    first forward; ``kernel`` the density's :class:`DensityKernel` (read-only); ``final [B, G, d]`` the last layer's
    outputs of the response's predicting rows at the first forward."""

    member: torch.Tensor
    before: torch.Tensor
    stepped: torch.Tensor
    rollout: torch.Tensor
    eye: torch.Tensor
    confidence: torch.Tensor
    kernel: DensityKernel
    final: torch.Tensor | None = None


@register("refresh", "d2cache")
class D2CacheRefresh(RefreshSelector):
    """d2Cache (see the module docstring): ``current_k`` masked positions chosen by certainty density (``sigma`` the
    Gaussian's width), the attention-rollout nucleus ``rollout_p`` over the other positions, gaps of at most
    ``inflate_w`` between chosen positions filled (0: none, the released configuration; its class default is 4)."""

    not_served = {Capability.ATTENTION_PROBE: "the block positions it does not recompute have no query row in the "
                                              "forward"}

    @attrs.frozen
    class Config:
        rollout_p: float = attrs.field(default=0.1, converter=float, validator=[v.ge(0.0), v.le(1.0)])
        current_k: int = attrs.field(default=32, validator=[v.instance_of(int), v.ge(1)])
        sigma: float = attrs.field(default=10.0, converter=float, validator=v.gt(0.0))
        inflate_w: int = attrs.field(default=0, validator=[v.instance_of(int), v.ge(0)])

    def init_state(self, state: DecodeState) -> D2State:
        B, T, device = state.batch_size, state.length, state.x.device
        G = T - state.prompt_len
        eye = torch.eye(T + 1, T, device=device)
        return D2State(member=torch.zeros(B, T, dtype=torch.bool, device=device),
                       before=torch.zeros(B, T, dtype=torch.long, device=device),
                       stepped=torch.zeros(B, dtype=torch.bool, device=device),
                       rollout=eye.expand(B, -1, -1).clone(), eye=eye,
                       confidence=torch.zeros(B, G, device=device),
                       kernel=density_kernel(G, self.config.sigma, device))

    def begin_generation(self, local: D2State, state: DecodeState, cache: DecodeCache, model) -> None:
        if local.final is None:  # the model's width is known here
            G = state.length - state.prompt_len
            local.final = torch.zeros(state.batch_size, G, model.spec.d_model, dtype=cache.k[0].dtype,
                                      device=state.x.device)
        for t in (local.member, local.before, local.stepped, local.confidence, local.final):
            t.zero_()
        local.rollout.copy_(local.eye)

    def buckets(self, state: DecodeState) -> int:
        """How many plan sizes a ``cached`` step may take (multiples of :data:`GRANULE` up to ``T``)."""
        return -(-state.length // GRANULE)

    def phase(self, position: StepPosition, state: DecodeState, local: D2State) -> tuple:
        """``("first",)`` at the generation's first forward, else ``("cached", C)`` with ``C`` the most chosen rows
        of a sequence rounded up to :data:`GRANULE` (from the previous step's flags)."""
        if position.global_step == 0:
            return (FIRST,)
        if not position.flags:  # a block's first step: the loop reads no flags across blocks
            return (CACHED, self.most_rows(state))
        return (CACHED, min(state.length, GRANULE * (1 + sum(position.flags))))

    def most_rows(self, state: DecodeState) -> int:
        """The most rows a forward can choose, rounded up to :data:`GRANULE` (at most ``T``): ``current_k`` by
        density, a block of commits, a block of masked rows, the nucleus (at most ``rollout_p`` of the positions
        left, and one); every position with ``inflate_w > 0``."""
        T, c = state.length, self.config
        if c.inflate_w > 0 or c.rollout_p >= 1.0:
            return T
        most = c.current_k + 2 * state.block_length + int(c.rollout_p * T) + 1
        return min(T, GRANULE * -(-most // GRANULE))

    def plan(self, state: DecodeState, cache: DecodeCache, local: D2State) -> Plan:
        local.stepped.copy_(state.active)
        local.before.copy_(state.x)
        if state.phase.refresh[0] == FIRST:
            return block_start_plan(state)
        shift = state.logit_shift
        member = (local.member | region_rows(state)) & state.active[:, None] & cache.key_valid[:, : state.length]
        C = state.phase.refresh[1]
        index = torch.sort((~member).to(torch.int8), dim=1, stable=True).indices[:, :C]
        return Plan(index, member.gather(1, index), query_slots(member, state.region - shift, C))

    def hook(self, state: DecodeState, plan: Plan, cache: DecodeCache, model, local: D2State) -> LayerHook:
        return _RolloutHook(state, cache, LayerOps(model), local, state.phase.refresh[0] == FIRST)

    def after_step(self, state: DecodeState, cache: DecodeCache, model, local: D2State) -> AfterStep:
        """After the step's commits: at the first forward the response's confidences; then the rows the next
        forward recomputes (:func:`choose_rows`) for the rows that stepped, and the thermometer code of the plan
        size (the most chosen rows of a sequence exceeds ``GRANULE · i``, ``i = 1 ..``)."""
        cost = None
        if state.phase.refresh[0] == FIRST:
            meter = CostMeter()
            meter.weight(model.final_norm_weight())
            logits = model.logits(model.final_norm(local.final), meter)
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            local.confidence.copy_(torch.softmax(logits, dim=-1).amax(dim=-1))
            cost = meter.result()
        T = state.length
        masked = state.x == state.mask_id
        valid = cache.key_valid[:, :T]
        importance = (local.rollout[:, :T] * valid[:, :, None]).sum(dim=1)
        P = state.prompt_len
        block = torch.zeros(state.batch_size, T - P + 1, dtype=torch.bool, device=state.x.device)
        was_masked = (local.before.gather(1, state.region) == state.mask_id) & state.region_valid
        block.scatter_(1, torch.where(was_masked, state.region - P, T - P), True)
        chosen = choose_rows(self.config, local.kernel, local.confidence, masked, local.before != state.x,
                             importance, valid, block[:, : T - P], P, state.logit_shift)
        chosen = chosen | next_region_rows(state, masked)
        local.member.copy_(torch.where(local.stepped[:, None], chosen & valid, local.member))
        most = local.member.sum(dim=1).amax()
        steps = GRANULE * torch.arange(1, self.buckets(state), device=state.x.device)
        return AfterStep(most > steps, cost)


def region_rows(state: DecodeState) -> torch.Tensor:
    """``[B, T]`` bool: the predicting rows of the current region's masked columns."""
    B, T = state.batch_size, state.length
    rows = torch.where(state.block_masked(), state.region - state.logit_shift, T)
    return torch.zeros(B, T + 1, dtype=torch.bool, device=state.x.device).scatter_(1, rows, True)[:, :T]


def next_region_rows(state: DecodeState, masked: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool: the predicting rows of the masked columns of the block the next step decodes (the current one
    while it has masked columns, else the next; ``masked [B, T]`` after the step's commits)."""
    B, T = masked.shape
    columns = state.region.clamp(max=T - 1)
    left = (masked.gather(1, columns) & state.region_valid).any(dim=1, keepdim=True)
    columns = torch.where(left, state.region, state.region + state.block_length)
    inside = columns < T
    columns = columns.clamp(max=T - 1)
    rows = torch.where(inside & masked.gather(1, columns), columns - state.logit_shift, T)
    return torch.zeros(B, T + 1, dtype=torch.bool, device=masked.device).scatter_(1, rows, True)[:, :T]


def nucleus(importance: torch.Tensor, allowed: torch.Tensor, p: float) -> torch.Tensor:
    """``[B, T]`` bool: among ``allowed [B, T]`` the most important positions whose normalised importance sums to at
    most ``p`` (in descending order), and at least the most important one; ``p >= 1``: every allowed position."""
    if p >= 1.0:
        return allowed.clone()
    scores = torch.where(allowed, importance, 0.0)
    share = scores / (scores.sum(dim=-1, keepdim=True) + 1e-9)
    ordered, order = torch.sort(share, dim=-1, descending=True, stable=True)
    keep = ordered.cumsum(dim=-1) <= p
    keep[:, 0] = True
    keep = keep & allowed.gather(1, order)
    return torch.zeros_like(allowed).scatter_(1, order, keep)


def inflate(chosen: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, T]`` bool: ``chosen`` plus every position between two chosen positions at most ``width`` apart."""
    if width <= 0:
        return chosen
    B, T = chosen.shape
    at = torch.arange(T, device=chosen.device).expand(B, T)
    after = torch.where(chosen, at, T).flip(-1).cummin(dim=-1).values.flip(-1)
    before = torch.where(chosen, at, -1).cummax(dim=-1).values
    return chosen | ((after - before <= width) & (before >= 0) & (after < T))


def choose_rows(config, kernel: DensityKernel, confidence: torch.Tensor, masked: torch.Tensor,
                committed: torch.Tensor, importance: torch.Tensor, valid: torch.Tensor, block: torch.Tensor, P: int,
                shift: int) -> torch.Tensor:
    """The rows the next forward recomputes, ``[B, T]`` bool (see the module docstring, steps 1-4).

    ``kernel`` the density's (:func:`density_kernel`); ``confidence [B, G]`` the first forward's; ``masked [B, T]``
    the mask tokens after the step's commits; ``committed [B, T]`` the positions whose token the step changed;
    ``importance [B, T]`` the rollout's column sums; ``valid [B, T]`` the real (not padding) positions;
    ``block [B, G]`` the current block's positions that were masked before the step; ``P`` the prompt width;
    ``shift`` 1 for shifted logits (Dream)."""
    B, T = masked.shape
    G = T - P
    remaining = masked[:, P:]
    scores = confidence * certainty_density(~remaining, kernel).float()
    scores = scores + block * scores.amax(dim=1, keepdim=True)
    width = block.sum(dim=1, keepdim=True).clamp_min(1)
    start = block.long().argmax(dim=1, keepdim=True)
    reach = remaining.long().cumsum(dim=1) >= config.current_k
    end = torch.where(reach.any(dim=1, keepdim=True), reach.long().argmax(dim=1, keepdim=True), G - 1)
    end = (end // width + 1) * width - 1
    col = torch.arange(G, device=masked.device)
    candidate = remaining & (col >= start) & (col <= end)
    top = torch.where(candidate, scores, float("-inf")).topk(min(config.current_k, G), dim=1).indices
    picked = torch.zeros_like(remaining).scatter_(1, top, True) & candidate
    chosen = torch.zeros(B, T, dtype=torch.bool, device=masked.device)
    chosen[:, P : T - shift] = picked[:, shift:]  # with shifted logits, row P - 1 is set after the nucleus
    chosen = chosen | committed
    chosen = chosen | nucleus(importance, ~chosen & valid, config.rollout_p)
    if shift:
        chosen[:, P - 1] = picked[:, 0]
    return inflate(chosen, config.inflate_w)


class _RolloutHook(LayerHook):
    """One forward of :class:`D2CacheRefresh`: at each layer the plan rows' attention probabilities (mean over heads)
    extend the attention rollout; at the first forward the last layer runs the response's predicting rows a second
    time as member rows, whose outputs give the confidences. ``evals [B]``: those member rows (first forward only)."""

    def __init__(self, state: DecodeState, cache: DecodeCache, ops: LayerOps, local: D2State, first: bool):
        self.state, self.cache, self.ops, self.local, self.first = state, cache, ops, local, first
        T, P, s = state.length, state.prompt_len, state.logit_shift
        self.response = slice(P - s, T - s)
        local.rollout.copy_(local.eye)
        if first:
            self.own = cache.key_valid[:, self.response] & state.active[:, None]
            self.evals = self.own.sum(dim=1)
        else:
            self.evals = torch.zeros(state.batch_size, dtype=torch.long, device=state.x.device)

    def members(self, layer: int, qkv) -> MemberRows | None:
        T, C = self.state.length, qkv.n_plan
        probs = self.ops.attention_probs(qkv.q[:, :, :C], self.cache.k[layer], self.cache.key_valid, qkv.meter)
        attn = probs.mean(dim=1)  # [B, C, T + 1]
        attn = attn.scatter_add(2, qkv.index[..., None], torch.ones_like(attn[..., :1]))
        attn = attn / attn.sum(dim=-1, keepdim=True)
        rollout = self.local.rollout
        rows = attn[..., :T] @ rollout[:, :T]
        rollout.scatter_(1, qkv.index[..., None].expand(-1, -1, T), rows)
        if self.first and layer == self.state.n_layers - 1:
            if self.detail is not None:  # an observer records: the second pass's rows, at their cache slots
                self.detail.refreshed[layer] = (qkv.index[:, self.response], self.own)
            return MemberRows(qkv.q[:, :, self.response], qkv.h[:, self.response])
        return None

    def after_layer(self, layer: int, out: torch.Tensor) -> None:
        self.local.final.copy_(out)
