"""Elastic-Cache as a refresh selector (Nguyen-Tri et al. 2025, "Attention Is All You Need for KV Cache in Diffusion
LLMs"), as its released code runs it (``generate_with_elastic_cache`` and its LLaDA / Dream attention).

Decoding commits from a sliding window: the first ``window_length`` still-masked positions of each row
(:class:`~polestar.region.WindowRegion`, crossing block boundaries). Every layer keeps the inputs, queries, keys
and values of every position. A forward:

* the first one computes every position at every layer;
* later ones compute the *query rows* only: the tracked tokens, the positions committed by the row's previous
  forward and the window's predicting rows (the window itself; one position earlier for Dream's shifted logits).
  Far masks and every other position keep their cached state (far-mask caching). At each layer the tracked tokens'
  attention over all keys, as it was (cached queries, keys before this forward's writes) and as it is now (fresh
  queries, keys after them), is compared: the cosine over heads, averaged over the tracked tokens and the key
  positions. The first layer ``l`` where it falls below ``gamma`` triggers a recomputation from layer ``l + 1``:
  layer ``l + 1`` takes every position, the query rows' fresh inputs and the others' cached ones, and every later
  layer recomputes every position;
* at every layer computed for the window, each layer's next tracked tokens are the ``track_num`` positions the
  window's rows attend to most (summed over heads and window rows), among positions that are not still masked;
  the tracked tokens of a forward are the union over layers.

Fixed shapes, one graph per step variant (:meth:`ElasticCacheRefresh.phase`), all chosen from flags read with the
loop's one host read per step:

* ``first``: every position at every layer;
* ``cached``: the query rows at every layer, ``C`` plan slots (the most query rows of a row, rounded up to a
  multiple of :data:`GRANULE`), the trigger decided per row on the device at layers ``1 ..``;
* ``fire0``: layer 0's trigger is decided at the end of the previous step (:meth:`ElasticCacheRefresh.after_step`:
  the query rows' layer-0 queries and keys projected from their embeddings); when it fires in some row, the step's
  plan is per layer: layer 0 computes the query rows in ``C`` slots as a ``cached`` step does, the layers above
  ``T`` slots (slot = position): every position in the rows that fired and the query rows in the others (which
  check the trigger from layer 1);
* ``rerun`` from layer ``s``: rows whose first trigger ``l ≥ 1`` leaves a layer above the merge layer
  (``l ≤ L - 3``) commit nothing in their ``cached`` step (:meth:`_CachedPass.held`); the next step
  recomputes them, at layer ``l + 1`` every position that was not a query row (the query rows' outputs there are
  already the cached pass's, from the same inputs and keys), above it every position, and they commit. The cached
  pass's layers above ``l + 1`` are computed and thrown away (counted).

A trigger at the last two layers changes no logit (the merge layer's query rows attend to the keys they attended
to), so it is not recomputed. Each row's forwards are the method's; the loop's steps include the ``rerun`` steps.
Shapes: query plan ``[B, C]``, ``fire0`` plan ``([B, C], [B, T] × (L - 1))``, ``rerun`` plan ``[L, B, T]``,
attention rows ``[B, H, ·, T + 1]``, cached queries ``[L, B, H, T + 1, hd]``, tracked tokens ``[L, B, track_num]``.
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.nn.functional as F
from attrs import validators as v

from polestar.kernels.proxy_attention import proxy_attention
from polestar.models.cost import CostMeter, StepCost
from polestar.models.hooks import LayerQKV
from polestar.models.layer_ops import LayerOps
from polestar.models.layers import Rotary
from polestar.models.plan import DecodeCache, Plan, full_plan
from polestar.region import WindowRegion
from polestar.registry import register
from polestar.stages import AfterStep, Capability, LayerHook, RefreshSelector
from polestar.state import DecodeState, StepPosition

from .elastic_trace import TRIGGER, TRIGGER_LAYER

FIRST, CACHED, FIRE0, RERUN = "first", "cached", "fire0", "rerun"
#: a ``cached`` step's plan holds a multiple of this many slots (one graph per size met)
GRANULE = 8


@register("refresh", "elastic")
class ElasticCacheRefresh(RefreshSelector):
    """Elastic-Cache (see the module docstring): ``window_length`` the sliding window's width, ``gamma`` the
    attention-cosine bound, ``track_num`` tracked tokens per layer. ``eos_id``: the token whose first commit bounds
    the window (positions right of it are not decoded): None (default) takes the generation's stop tokens (the
    model's EOS) when it stops at EOS (``stop_at_eos``), else none; the released code hard-codes 126081 (LLaDA-8B's
    ``<|endoftext|>``), which on any other vocabulary never stops it: ``eos_id=126081`` with ``stop_at_eos=False``
    reproduces that (an explicit id bounds the window whatever ``stop_at_eos`` says)."""

    trace_figures = (TRIGGER_LAYER,)

    @attrs.frozen
    class Config:
        window_length: int = attrs.field(default=16, validator=[v.instance_of(int), v.ge(1)])
        gamma: float = attrs.field(default=0.9, converter=float, validator=v.ge(0.0))
        track_num: int = attrs.field(default=1, validator=[v.instance_of(int), v.ge(1)])
        eos_id: int | None = attrs.field(default=None, validator=v.optional(v.instance_of(int)))

    needs_hidden = True
    not_served = {Capability.BLOCK_REGION: "it commits from a sliding window of each row's first masked positions"}

    def region(self) -> WindowRegion:
        return WindowRegion(self.config.window_length, self.config.eos_id)

    def init_state(self, state: DecodeState) -> ElasticState:
        B, L, T, device = state.batch_size, state.n_layers, state.length, state.x.device
        return ElasticState(
            q=None, track=torch.zeros(L, B, self.config.track_num, dtype=torch.long, device=device),
            fired=torch.full((B,), L, dtype=torch.long, device=device),
            deferred=torch.zeros(B, dtype=torch.bool, device=device),
            seen=torch.zeros(B, T, dtype=torch.bool, device=device),
            member=torch.zeros(B, T, dtype=torch.bool, device=device),
            fired0=torch.zeros(B, dtype=torch.bool, device=device),
            sim0=torch.zeros(B, device=device), layer_ids=torch.arange(L, device=device))

    def begin_generation(self, local: ElasticState, state: DecodeState, cache: DecodeCache, model) -> None:
        spec = model.spec
        if local.q is None:  # allocated once per shape (the model's head width is known here), a row per layer
            local.q_stack = torch.zeros(spec.n_layers, state.batch_size, spec.n_heads, state.length + 1,
                                        spec.head_dim, dtype=cache.k[0].dtype, device=state.x.device)
            local.q = local.q_stack.unbind(0)
        local.q_stack.zero_()
        local.track.zero_()
        local.fired.fill_(state.n_layers)
        local.deferred.zero_()
        local.seen.zero_()
        local.member.zero_()
        local.fired0.zero_()
        local.sim0.zero_()

    def phase(self, position: StepPosition, state: DecodeState, local: ElasticState) -> tuple:
        """``("first",)`` at the generation's first step; ``("rerun", s)`` when the previous step deferred rows whose
        lowest first trigger is at layer ``s - 1``; else ``("cached", C)``, or ``("fire0", C)`` when layer 0's
        trigger fired ahead in some row, with ``C`` plan slots for the query rows, the most of a row rounded up to
        :data:`GRANULE` (all from the previous step's flags)."""
        if position.global_step == 0:
            return (FIRST,)
        L = state.n_layers
        n_rerun, n_ahead = max(L - 2, 0), int(self.ahead(state))
        reruns, fire0, sizes = (position.flags[:n_rerun], position.flags[n_rerun : n_rerun + n_ahead],
                                position.flags[n_rerun + n_ahead :])
        fired = [j for j, flag in enumerate(reruns) if flag]
        if fired:
            return (RERUN, fired[0] + 1)
        size = min(state.length, GRANULE * (1 + sum(sizes)))
        return (FIRE0, size) if any(fire0) else (CACHED, size)

    @staticmethod
    def ahead(state: DecodeState) -> bool:
        """Whether layer 0's trigger is decided ahead, at the end of the previous step: with three layers or more
        (with fewer a trigger at layer 0 changes no logit, see the module docstring)."""
        return state.n_layers >= 3

    def buckets(self, state: DecodeState) -> int:
        """How many plan sizes a ``cached`` step may take (multiples of :data:`GRANULE` up to the most query rows a
        step can have: tracked tokens, the previous commits and the window's rows)."""
        R = state.block_arange.shape[0]
        most = min(state.length, state.n_layers * self.config.track_num + 2 * R)
        return -(-most // GRANULE)

    def members(self, state: DecodeState, local: ElasticState, key_valid: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, T]`` bool: the next ``cached`` forward's query rows (tracked tokens, commits since the row's last
        forward, the window's rows) in active rows, not left padding (``key_valid [B, T + 1]``, when given)."""
        B, T = state.batch_size, state.length
        rows = torch.where(state.region_valid, state.region - state.logit_shift, T)
        member = torch.zeros(B, T + 1, dtype=torch.bool, device=state.x.device)
        member.scatter_(1, local.track.permute(1, 0, 2).reshape(B, -1), True)
        member.scatter_(1, rows, True)
        member = (member[:, :T] | (local.seen & (state.x != state.mask_id))) & state.active[:, None]
        return member if key_valid is None else member & key_valid[:, :T]

    def plan(self, state: DecodeState, cache: DecodeCache, local: ElasticState) -> Plan:
        kind = state.phase.refresh[0]
        B, T, shift = state.batch_size, state.length, state.logit_shift
        if kind == RERUN:
            L = state.n_layers
            layer = torch.arange(L, device=state.x.device)[:, None, None]
            f = local.fired[None, :, None]
            merge = (layer == f + 1) & ~local.member[None]  # the query rows' outputs there are the cached pass's
            redo = (merge | (layer > f + 1)) & (local.deferred & state.active)[None, :, None]
            index = torch.arange(T, device=state.x.device).expand(L, B, T)
            return Plan(index, redo & cache.key_valid[None, :, :T], state.region - shift, state.phase.refresh[1])
        if kind == FIRST:
            local.seen.copy_(state.x == state.mask_id)
            plan = full_plan(B, T, state.x.device)
            return Plan(plan.index, plan.valid & state.active[:, None], state.region - shift)
        member = self.members(state, local, cache.key_valid)
        local.member.copy_(member)
        local.seen.copy_(state.x == state.mask_id)
        local.fired.copy_(torch.where(local.fired0, -1, state.n_layers))
        C = state.phase.refresh[1]
        index = torch.sort((~member).to(torch.int8), dim=1, stable=True).indices[:, :C]
        target = query_slots(member, state.region - shift, C)
        if kind == FIRE0:  # layer 0: the query rows (C slots); above: every position in rows that fired, the query
            # rows else (slot == position)
            rows = torch.where(local.fired0[:, None], cache.key_valid[:, :T], member)
            above = torch.arange(T, device=state.x.device).expand(B, T)
            L = state.n_layers
            return Plan((index, *(above,) * (L - 1)), (member.gather(1, index), *(rows,) * (L - 1)),
                        state.region - shift)
        return Plan(index, member.gather(1, index), target)

    def hook(self, state, plan, cache, model, local: ElasticState):
        return _PASSES[state.phase.refresh[0]](self, state, plan, cache, LayerOps(model), local)

    def after_step(self, state: DecodeState, cache: DecodeCache, model, local: ElasticState) -> AfterStep:
        """After the step's commits: layer 0's trigger for each row's next forward (:meth:`_layer0_ahead`, with
        three layers or more) and the flags for the next step (:meth:`_flags`)."""
        cost = self._layer0_ahead(state, cache, model, local)
        return AfterStep(self._flags(state, local), cost)

    def _flags(self, state: DecodeState, local: ElasticState) -> torch.Tensor:
        """``[L - 2 + 1 + buckets - 1]`` bool: per layer ``j < L - 2``, some row was deferred with its first trigger
        at ``j``; whether some row's next forward fires at layer 0 (:meth:`_layer0_ahead`; with three layers or more);
        then the next ``cached`` step's plan size in a thermometer code (the most query rows of a row exceeds
        ``GRANULE · i``, ``i = 1 ..``)."""
        L = state.n_layers
        layer = torch.arange(max(L - 2, 0), device=state.x.device)[:, None]
        reruns = (local.deferred[None, :] & (local.fired[None, :] == layer)).any(dim=1)
        fire0 = local.fired0.any(dim=0, keepdim=True)[: int(self.ahead(state))]
        most = self.members(state, local).sum(dim=1).amax()  # left padding is never a query row
        steps = GRANULE * torch.arange(1, self.buckets(state), device=state.x.device)
        return torch.cat([reruns, fire0, most > steps])

    def _layer0_ahead(self, state: DecodeState, cache: DecodeCache, model, local: ElasticState) -> StepCost | None:
        """After the step's commits: the layer-0 trigger of each row's next forward (its query rows' queries and keys
        at layer 0 are projected from their embeddings, the tracked tokens' attention compared as at any layer),
        into ``local.fired0`` and ``local.sim0``; the rows it fires in are recomputed from layer 1 in that forward
        (one step, no deferral). Rows deferred by this step are decided after their recomputation. Counted as probe
        rows: the query rows' q/k projections and the tracked tokens' previous attention."""
        if not self.ahead(state):
            return None
        meter = CostMeter()
        spec, B, T = model.spec, state.batch_size, state.length
        member = self.members(state, local, cache.key_valid) & ~local.deferred[:, None]
        C = min(T, GRANULE * self.buckets(state))
        index = torch.sort((~member).to(torch.int8), dim=1, stable=True).indices[:, :C]
        index = torch.where(member.gather(1, index), index, cache.trash)
        parts = model.layer_parts(0)
        tokens = torch.cat([state.x, state.x[:, :1]], dim=1).gather(1, index)
        meter.embedding(model.embedding_weight(), tokens.numel())
        x = parts.attn_norm(model.embed(tokens))
        q = parts.q(x).view(B, C, spec.n_heads, spec.head_dim).transpose(1, 2)
        k = parts.k(x).view(B, C, spec.n_kv_heads, spec.head_dim).transpose(1, 2)
        cos, sin = model.rotary.cos_sin(cache.positions.gather(1, index))
        q, k = Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)
        counted = model.layer_bytes(0)
        meter.read(counted.attn_norm + counted.q + counted.k)
        keys = cache.k[0].scatter(2, index[:, None, :, None].expand(-1, spec.n_kv_heads, -1, spec.head_dim), k)
        track_pos, track_valid = tracked_tokens(local, member, self.config.track_num)
        slot = query_slots(member, track_pos, C)
        H, hd = spec.n_heads, spec.head_dim
        old = model.attention_probs(local.q[0].gather(2, track_pos[:, None, :, None].expand(-1, H, -1, hd)),
                                    cache.k[0], cache.key_valid, meter)
        now = model.attention_probs(q.gather(2, slot[:, None, :, None].expand(-1, H, -1, hd)), keys,
                                    cache.key_valid, meter)
        sim = attention_cosine(old, now, track_valid, cache.key_valid)
        meter.rows(probe_rows=B * (C + track_pos.shape[1]))
        local.sim0.copy_(sim)
        local.fired0.copy_((sim < self.config.gamma) & track_valid.any(dim=1) & state.active & ~local.deferred)
        return meter.result()


def query_slots(member: torch.Tensor, positions: torch.Tensor, C: int) -> torch.Tensor:
    """The plan slots ``[B, N]`` of ``positions [B, N]`` in a plan of the query rows ``member [B, T]`` in position
    order (``C`` slots; a position that is no query row gets a slot in range, unused)."""
    slot = member.long().cumsum(dim=1) - 1  # [B, T] the plan slot of each member position
    return slot.gather(1, positions.clamp_min(0)).clamp(0, C - 1)


def tracked_tokens(local: ElasticState, member: torch.Tensor, track_num: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tracked tokens (the union of every layer's ``local.track``) among the query rows ``member [B, T]``:
    positions ``[B, K]`` (ascending, ``K = min(T, L·track_num)``) and their validity ``[B, K]``."""
    L, B = local.track.shape[0], member.shape[0]
    T = member.shape[1]
    tracked = torch.zeros(B, T + 1, dtype=torch.bool, device=member.device)
    tracked.scatter_(1, local.track.permute(1, 0, 2).reshape(B, -1), True)
    tracked = tracked[:, :T] & member
    pos = torch.sort((~tracked).to(torch.int8), dim=1, stable=True).indices[:, : min(T, L * track_num)]
    return pos, tracked.gather(1, pos)


def _probs(q: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, key_valid: torch.Tensor,
           scale: float) -> torch.Tensor:
    """Attention ``[B, H, S, T + 1]`` of the queries ``q [B, H, C, hd]`` at plan slots ``slots [B, S]`` over the
    layer's keys (:func:`~polestar.kernels.proxy_attention.proxy_attention`, the backbone's probe kernel)."""
    H, hd = q.shape[1], q.shape[3]
    return proxy_attention(q.gather(2, slots[:, None, :, None].expand(-1, H, -1, hd)), keys, key_valid, scale)


def retracked(q: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, key_valid: torch.Tensor,
              region_valid: torch.Tensor, masked: torch.Tensor, track: torch.Tensor, keep: torch.Tensor, scale: float,
              track_num: int, length: int) -> torch.Tensor:
    """One layer's tracked tokens re-picked: the ``track_num`` positions the
    window rows (queries ``q`` at plan slots ``slots [B, R]``, ``region_valid [B, R]``) attend to most, summed over
    heads and rows, never a position still ``masked [B, T]``; rows where ``keep [B]`` is False keep ``track
    [B, track_num]``. → ``[B, track_num]``."""
    focus = (_probs(q, slots, keys, key_valid, scale) * region_valid[:, None, :, None]).sum(dim=(1, 2))[:, :length]
    pick = focus.masked_fill(masked, 0.0).topk(track_num, dim=1).indices
    return torch.where(keep[:, None], pick, track)


def triggered(q: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, key_valid: torch.Tensor, old: torch.Tensor,
              track_valid: torch.Tensor, fired: torch.Tensor, active: torch.Tensor, layer: torch.Tensor, scale: float,
              gamma: float, n_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's trigger test: the tracked tokens' attention now (queries
    ``q`` at ``slots [B, K]``) against ``old [B, H, K, T + 1]`` (:func:`attention_cosine`); an active row not fired
    yet (``fired [B]`` is ``n_layers``) whose similarity fell below ``gamma`` fires at ``layer`` (0-d long).
    → the new ``fired [B]`` and the similarity ``[B]``."""
    sim = attention_cosine(old, _probs(q, slots, keys, key_valid, scale), track_valid, key_valid)
    hit = (fired == n_layers) & (sim < gamma) & active
    return torch.where(hit, layer, fired), sim


def attention_cosine(old: torch.Tensor, now: torch.Tensor, valid: torch.Tensor,
                     key_valid: torch.Tensor) -> torch.Tensor:
    """Elastic-Cache's similarity: the cosine over heads of two attention distributions ``[B, H, K, T + 1]`` of the
    same tokens, averaged over the valid tokens (``valid [B, K]``) and keys (``key_valid [B, T + 1]``) → ``[B]``."""
    cos = F.cosine_similarity(old, now, dim=1, eps=1e-8)  # [B, K, T + 1]
    weight = (valid[:, :, None] & key_valid[:, None, :]).to(cos.dtype)
    return (cos * weight).sum(dim=(1, 2)) / weight.sum(dim=(1, 2)).clamp_min(1.0)


@attrs.define
class ElasticState:
    """Per-generation state of :class:`ElasticCacheRefresh` (preallocated, written in place): ``q``: per layer (a
    tuple of ``L`` buffers, the rows of ``q_stack``, as the cache's K/V) ``[B, H, T + 1, hd]`` every position's last
    query (after RoPE); ``track [L, B, track_num]`` each layer's tracked tokens; ``fired [B]`` the layer of the
    row's first trigger in the current forward (``L``: none); ``deferred [B]`` rows whose forward continues at the
    next step; ``seen [B, T]`` the masked positions at the row's last forward (its commits since are the next query
    rows); ``member [B, T]`` the last ``cached`` step's query rows; ``fired0 [B]`` and ``sim0 [B]``: the next
    forward's layer-0 trigger and similarity, decided at the end of the previous step
    (:meth:`ElasticCacheRefresh.after_step`); ``fired`` is ``-1`` in a row recomputed from layer 1; ``layer_ids
    [L]`` long ``0 .. L-1`` (a layer's index as a device scalar, so one compiled trigger test serves every layer)."""

    q: tuple[torch.Tensor, ...] | None
    track: torch.Tensor
    fired: torch.Tensor
    deferred: torch.Tensor
    seen: torch.Tensor
    member: torch.Tensor
    fired0: torch.Tensor
    sim0: torch.Tensor
    layer_ids: torch.Tensor
    #: ``q`` as one ``[L, B, H, T + 1, hd]`` tensor (its rows are ``q``)
    q_stack: torch.Tensor | None = None


class _TrackPass(LayerHook):
    """One forward's per-layer work shared by every step variant: store the computed rows' queries, and re-pick
    each layer's tracked tokens from the window rows' attention (in the rows where the layer computed the window).
    ``plan.target_offset [B, R]``: the window rows' plan slots."""

    def __init__(self, sel: ElasticCacheRefresh, state: DecodeState, plan: Plan, cache: DecodeCache, ops: LayerOps,
                 local: ElasticState):
        self.sel, self.state, self.plan, self.cache, self.ops, self.local = sel, state, plan, cache, ops, local
        self.evals = torch.zeros(state.batch_size, dtype=torch.long, device=state.x.device)
        self.scale = 1.0 / math.sqrt(ops.spec.head_dim)  # the probe attention's, as the backbone's
        T, P = state.length, state.prompt_len
        still = state.schedule.candidates(state)  # [B, G] positions still to decode, as of the forward's start
        self.masked = torch.cat([still.new_zeros(still.shape[0], P), still], dim=1)[:, :T]  # [B, T]

    def retrack_rows(self, layer: int) -> torch.Tensor:
        """``[B]`` bool: rows whose window rows this layer computed."""
        return self.state.active

    def checks(self, layer: int) -> bool:
        """Whether ``layer`` runs the trigger test (:meth:`check`)."""
        return False

    def check(self, layer: int, qkv: LayerQKV) -> None:
        """The trigger test (``cached`` steps only)."""

    def window_slots(self, layer: int) -> torch.Tensor:
        """``[B, R]``: the plan slots of the window's rows at ``layer``."""
        return self.plan.target_offset

    def members(self, layer: int, qkv: LayerQKV) -> None:
        local, cache, state = self.local, self.cache, self.state
        B, H, _, hd = qkv.q.shape
        C = qkv.n_plan
        q_layer = local.q[layer]
        q_layer.scatter_(2, qkv.index[:, None, :, None].expand(-1, H, -1, hd), qkv.q[:, :, :C].to(q_layer.dtype))
        self.check(layer, qkv)
        keys = cache.k[layer]
        qkv.meter.attention(keys, None)
        track = local.track[layer]
        track.copy_(retracked(qkv.q, self.window_slots(layer), keys, cache.key_valid, state.region_valid, self.masked,
                              track, self.retrack_rows(layer), self.scale, self.sel.config.track_num, state.length))
        return None


class _FirstPass(_TrackPass):
    """The first forward: every position at every layer."""


class _CachedPass(_TrackPass):
    """A ``cached`` step: the query rows at every layer, and the trigger test at each layer (module docstring)."""

    def __init__(self, *args):
        super().__init__(*args)
        local = self.local
        self.track_pos, self.track_valid = tracked_tokens(local, local.member, self.sel.config.track_num)
        C = self.plan.index[0].shape[1] if self.plan.per_layer else self.plan.index.shape[1]
        self.track_slots = query_slots(local.member, self.track_pos, C)  # layer 0's slots in a ``fire0`` step
        # a ``fire0`` step's layer 0 computes the query rows in C slots, the layers above every position
        self.window0 = query_slots(local.member, self.state.region - self.state.logit_shift, C)
        self.skip0 = self.sel.ahead(self.state)  # layer 0's trigger was decided ahead

    def window_slots(self, layer: int) -> torch.Tensor:
        return self.window0 if layer == 0 else self.plan.target_offset

    def held(self) -> torch.Tensor:
        """After the forward: rows whose first trigger left a layer above the merge layer (``fired < L - 2``) are
        deferred: they commit nothing now and recompute from above that layer at the next step (a ``rerun``)."""
        local, state = self.local, self.state
        fired = local.fired
        local.deferred.copy_((fired >= 0) & (fired < state.n_layers - 2) & state.active)
        return local.deferred.clone()

    def checks(self, layer: int) -> bool:
        return not (layer == 0 and self.skip0)

    def tracked_slots(self, layer: int) -> torch.Tensor:
        """``[B, K]``: the tracked tokens' plan slots at ``layer`` (above layer 0 a ``fire0`` step's slot is the
        position)."""
        return self.track_pos if self.plan.per_layer and layer > 0 else self.track_slots

    def extra_rows(self, layer: int, h: torch.Tensor, meter) -> None:
        """Before the layer writes its keys: the tracked tokens' attention as it was (their cached queries over the
        cached keys), ``[B, H, K, T + 1]``."""
        if layer == 0 and self.skip0:
            return None
        q, B = self.local.q[layer], self.state.batch_size
        H, hd = q.shape[1], q.shape[3]
        past_q = q.gather(2, self.track_pos[:, None, :, None].expand(-1, H, -1, hd))
        self.old = self.ops.attention_probs(past_q, self.cache.k[layer], self.cache.key_valid, meter)
        meter.rows(probe_rows=B * self.track_pos.shape[1])
        return None

    def check(self, layer: int, qkv: LayerQKV) -> None:
        local, cache, state = self.local, self.cache, self.state
        if layer == 0 and self.skip0:
            if self.detail is not None:
                self.detail.entry(TRIGGER)[0] = (local.sim0.clone(), local.fired <= 0)
            return
        keys = cache.k[layer]
        qkv.meter.attention(keys, None)
        fired, sim = triggered(qkv.q, self.tracked_slots(layer), keys, cache.key_valid, self.old, self.track_valid,
                               local.fired, state.active, local.layer_ids[layer], self.scale, self.sel.config.gamma,
                               state.n_layers)
        local.fired.copy_(fired)
        if self.detail is not None:  # an observer records: the similarity and the rows triggered so far
            self.detail.entry(TRIGGER)[layer] = (sim, local.fired <= layer)


class _RerunPass(_TrackPass):
    """A ``rerun`` step: deferred rows recompute from the layer above their first trigger; the window rows are
    computed (and the tracked tokens re-picked) at the layers above that one."""

    def retrack_rows(self, layer: int) -> torch.Tensor:
        return self.local.deferred & self.state.active & (layer >= self.local.fired + 2)

    def held(self) -> torch.Tensor:
        """After the forward: the rows that were not deferred completed their forward at the previous step, so they
        are held here; the deferred ones complete now."""
        done = ~self.local.deferred
        self.local.deferred.zero_()
        return done


_PASSES = {FIRST: _FirstPass, CACHED: _CachedPass, FIRE0: _CachedPass, RERUN: _RerunPass}
