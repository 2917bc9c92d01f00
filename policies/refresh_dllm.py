"""dLLM-Cache: per-layer feature caching with interval refreshes and value-driven partial updates.

Source: Liu et al. 2025, "dLLM-Cache: Accelerating Diffusion Large Language Models with Adaptive Caching", as its
released code runs it. Every layer keeps, per position, its attention output (after the output projection) and its
MLP output; a forward rebuilds every position's residual stream from the embeddings, adding the cached outputs of
the rows a layer does not recompute. Forward ``n`` (counted from 1 over the generation, whatever the block) has, at
every layer but the first:

* a **prompt refresh** when ``(n - 1) % prompt_interval == 0`` (the prompt rows go through the layer) and a
  **response refresh** when ``(n - 1) % response_interval == 0`` (every response row does);
* otherwise, with ``0 < ratio <= 1``, the **value pick**: the values of every response row are projected from the
  rows' current inputs, compared (cosine over all K/V heads) with the values the layer cached, and the
  ``int(G * ratio)`` least similar rows go through the layer; all response values are then replaced by the fresh
  ones (picked or not), the picked rows' keys, attention and MLP outputs by theirs;
* layer 0 recomputes every row at every forward.

Refreshes are not aligned with blocks: the block structure is only the commit schedule (LLaDA's fixed steps per
block with low-confidence remasking, the ``topk`` commit rule, in the ``dllm-cache`` policy).

Shapes: ``T = P + G`` (``P`` the batch's padded prompt width, ``G`` the generation length); the cached features
``attn, mlp [L, B, T, d_model]``; a layer's recomputed rows ``[B, R]`` with ``R`` fixed by the step's phase (``T``,
``G``, ``P + int(G * ratio)``, ``int(G * ratio)``, or ``P`` and ``0`` at ratio 0); value cosines ``[B, G]``.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from attrs import validators as v

from polestar.models.hooks import CachedFeatures
from polestar.models.layer_ops import LayerOps
from polestar.models.plan import DecodeCache, Plan
from polestar.registry import register
from polestar.stages import Capability, LayerHook, RefreshSelector
from polestar.state import DecodeState, StepPosition

from .refresh_basic import block_start_plan


@attrs.define
class FeatureState:
    """Per-generation state of :class:`DLLMCacheRefresh`: each layer's cached attention output (after o) and MLP
    output per position, ``attn, mlp``: tuples of ``L`` tensors ``[B, T, d_model]``, the rows of ``attn_stack,
    mlp_stack [L, B, T, d_model]`` (as the cache's K/V; allocated at the first generation of a shape, rewritten in
    place)."""

    attn: tuple[torch.Tensor, ...] | None = None
    mlp: tuple[torch.Tensor, ...] | None = None
    attn_stack: torch.Tensor | None = None
    mlp_stack: torch.Tensor | None = None


@register("refresh", "dllm-cache")
class DLLMCacheRefresh(RefreshSelector):
    """dLLM-Cache (Liu et al. 2025, see the module docstring): feature caching per layer, prompt refresh every
    ``prompt_interval`` forwards, response refresh every ``response_interval``, and in between the ``ratio`` of the
    response rows whose freshly projected values moved most. The plan is every position (the residual stream);
    each layer's recomputed rows are given to the backbone as :class:`~polestar.models.hooks.CachedFeatures`.
    Phase: ``(response refresh, prompt refresh)`` of layers ``≥ 1`` at this forward (at most four graphs).

    ``similarity_grid``: 0 ranks the value cosines exactly as the released code does (``topk``); ``g > 0`` compares
    them rounded to multiples of ``g``, ties to the earlier position, so that cosines within rounding noise of each
    other (which a padded batch moves by a few ulps) pick the same rows alone and in a batch."""

    not_served = {Capability.ATTENTION_PROBE: "its layers above the first reuse cached attention outputs for the "
                                              "rows they do not recompute"}

    @attrs.frozen
    class Config:
        prompt_interval: int = attrs.field(default=50, validator=[v.instance_of(int), v.ge(1)])
        response_interval: int = attrs.field(default=7, validator=[v.instance_of(int), v.ge(1)])
        ratio: float = attrs.field(default=0.25, converter=float, validator=[v.ge(0.0), v.le(1.0)])
        similarity_grid: float = attrs.field(default=0.0, converter=float, validator=[v.ge(0.0), v.le(1.0)])

    def init_state(self, state: DecodeState) -> FeatureState:
        return FeatureState()

    def begin_generation(self, local: FeatureState, state: DecodeState, cache: DecodeCache, model) -> None:
        shape = (state.n_layers, state.batch_size, state.length, model.spec.d_model)
        if local.attn_stack is None or tuple(local.attn_stack.shape) != shape:
            local.attn_stack, local.mlp_stack = (torch.zeros(shape, dtype=model.dtype, device=state.x.device)
                                                 for _ in range(2))
            local.attn, local.mlp = local.attn_stack.unbind(0), local.mlp_stack.unbind(0)
        else:
            local.attn_stack.zero_()
            local.mlp_stack.zero_()

    def phase(self, position: StepPosition, state: DecodeState, local=None) -> tuple[bool, bool]:
        m = position.global_step  # forward n = global_step + 1 of the generation
        return (m % self.config.response_interval == 0, m % self.config.prompt_interval == 0)

    def plan(self, state: DecodeState, cache: DecodeCache, local=None) -> Plan:
        return block_start_plan(state)

    def hook(self, state: DecodeState, plan: Plan, cache: DecodeCache, model, local: FeatureState) -> LayerHook:
        return _FeatureHook(self.config, state, plan, cache, LayerOps(model), local)


class _FeatureHook(LayerHook):
    """One forward of :class:`DLLMCacheRefresh`: at each layer, the rows it recomputes (the value pick included)
    and its cached features. Plan rows are positions (the plan is every position). ``evals [B]``: the rows the
    layers recomputed minus the plan's rows (which the engine counts at every layer), a row's own positions only."""

    def __init__(self, config, state: DecodeState, plan: Plan, cache: DecodeCache, ops: LayerOps, local: FeatureState):
        self.config, self.state, self.cache, self.ops, self.local = config, state, cache, ops, local
        self.response, self.prompt = state.phase.refresh
        device = state.x.device
        P, T = state.prompt_len, state.length
        self.transfer = 0.0 < config.ratio <= 1.0
        self.n_pick = int((T - P) * config.ratio)
        self.own = cache.key_valid[:, :T] & plan.valid  # [B, T] a row's own, active positions
        self.arange = torch.arange(T, device=device)
        #: the recomputed rows ``[B, R]`` of one layer, or of a run of layers side by side, and how many layers each
        #: holds (counted once after the pass)
        self.computed: list[tuple[torch.Tensor, int]] = []

    @property
    def evals(self) -> torch.Tensor:
        """``[B]`` long: the rows the layers recomputed that are a row's own positions, minus the plan's rows at
        every layer (one gather and sum over the pass, read after it)."""
        if not self.computed:
            return torch.zeros(self.own.shape[0], dtype=torch.long, device=self.own.device)
        own = self.own.gather(1, torch.cat([rows for rows, _ in self.computed], dim=1)).sum(dim=1)
        return own - sum(layers for _, layers in self.computed) * self.own.sum(dim=1)

    def features(self, layer: int, h: torch.Tensor, meter) -> CachedFeatures:
        P, B = self.state.prompt_len, self.state.batch_size
        rows = self.arange.expand(B, -1) if layer == 0 else self._base_rows()
        if self.state.detail is not None:  # an observer records: the rows the layer recomputes besides the pick
            self.state.detail.computed[layer] = (rows, self.own.gather(1, rows))
        if not (layer == 0 or self.response) and self.transfer:
            rows = torch.cat([rows, P + self._value_pick(layer, h, meter)], dim=1)
        self.computed.append((rows, 1))
        return CachedFeatures(rows, self.local.attn[layer], self.local.mlp[layer])

    def _base_rows(self) -> torch.Tensor:
        """``[B, R0]`` the rows every layer above the first recomputes at this forward besides a value pick."""
        P, B = self.state.prompt_len, self.state.batch_size
        if self.response and self.prompt:
            rows = self.arange
        elif self.response:
            rows = self.arange[P:]
        else:
            rows = self.arange[:P] if self.prompt else self.arange[:0]
        return rows.expand(B, -1)

    def _value_pick(self, layer: int, h: torch.Tensor, meter) -> torch.Tensor:
        """The ``n_pick`` response rows ``[B, n_pick]`` (offsets from ``P``, least similar first) whose values,
        projected from their current inputs ``h[:, P:]``, are least cosine-similar to the layer's cached values;
        then every response row's cached value is replaced by its fresh one."""
        P, T = self.state.prompt_len, self.state.length
        fresh = self.ops.project_values(layer, h[:, P:], meter)  # [B, Hkv, G, hd]
        cached = self.cache.v[layer][:, :, P:T]
        pick = least_similar(fresh, cached, self.config.similarity_grid, self.n_pick)
        cached.copy_(fresh)
        if self.state.detail is not None:  # an observer records: the picked positions
            self.state.detail.refreshed[layer] = (P + pick, torch.ones_like(pick, dtype=torch.bool))
        return pick


def least_similar(fresh: torch.Tensor, cached: torch.Tensor, grid: float, n_pick: int) -> torch.Tensor:
    """The ``n_pick`` rows ``[B, n_pick]`` (least similar first) whose values ``fresh [B, Hkv, G, hd]`` are least
    cosine-similar to ``cached`` (same shape), all heads of a row together.
    ``grid > 0``: similarities compared on that grid, ties to the earlier row; 0: the released code's ``topk``
    ranking, tie order included."""
    sim = F.cosine_similarity(_heads_last(fresh), _heads_last(cached), dim=-1)  # [B, G]
    if grid > 0:
        return torch.round(sim.double() / grid).argsort(dim=1, stable=True)[:, :n_pick]
    return sim.topk(n_pick, dim=1, largest=False).indices


def _heads_last(v: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv, X, hd]`` → ``[B, X, Hkv * hd]`` (every head of a row side by side, as the value projection
    writes them)."""
    B, H, X, hd = v.shape
    return v.transpose(1, 2).reshape(B, X, H * hd)
