"""Polestar-Cache refresh selector: drift-aware sparse updates of the local window (Lee et al. 2026).

Per block: a full forward (every ``window_refresh_every``-th block only the window) rebuilds K/V. During it, at each
layer, the window's input hidden states are clustered (``cluster`` stage, ``n_clusters`` split between the prefix
and suffix parts in proportion to their lengths, 5/3 for 2+1 blocks) and stored with their queries (``quant`` +
``offload`` stages, :class:`~polestar.policies.row_store.RowStore`); each centroid becomes a proxy query
(``q_proj(attn_norm(c))``, RoPE at its members' mean position) that rides along the layer's q pass, and its
attention over the layer's keys is recorded. (``cluster_layers_together``, the default: every layer's
window is clustered in one clusterer call after the forward, and the centroid queries take a q pass of their
own; see :class:`PolestarRefresh`.) At a sparse-update step the same happens at every layer inside the
step's one pass (:mod:`polestar.policies.sparse_update`): the ``drift`` stage compares the proxy distributions with
the previous update's, the members of the ``topk`` most drifting clusters (``topk_last`` at the last layer) are
gathered into a fixed-capacity buffer (``capacity`` times the expected member count ``Nw * k / n_clusters``,
at most the window; the highest-drifting clusters first when the chosen clusters hold more) and recomputed
through the layer with the block; their outputs (the update packet) overwrite their stored inputs and K/V at the
next layer, and centroids shift by their members' change. A member's query is its stored one: a query changes
only when its input does, and an input changes only by a packet, which re-projects it in the next layer's pass;
so no layer's q weight is read twice in an update step. Updates run when the previous step committed more than
``tau_upd`` tokens or more than ``tau_upd + 1`` were committed since the last update. The last layer's packet yields
logits for the refreshed positions in the block's LM-head pass (:class:`~polestar.state.UpdatePacket`), which the
engine hands to the commit rule as ``DecodeState.packet``; only a commit rule that reads it (Polestar-Commit) has
the last layer recompute members at all (:meth:`PolestarRefresh.refreshes_layer`): with any other rule those rows
would feed nothing. Per-generation state lives in a :class:`PolestarRefreshState`.

This module is the selector (config, phase, plan, buffers); the per-layer work of a block start and of an update
step is its hooks', in :mod:`polestar.policies.polestar_hooks` (which also gives the call path of one layer).

Shapes: window ``Nw = (prefix_blocks + suffix_blocks) * block_length`` columns; centroids ``[B, K, d]``; proxy
distributions ``[B, H, K, T + 1]``; drift ``[B, K]``; member buffer ``[B, M_l]`` per layer.
"""

from __future__ import annotations

import math

import attrs
import torch
from attrs import validators as v

from polestar.kernels.kmeans import init_keys
from polestar.models.layer_ops import LayerOps
from polestar.models.plan import DecodeCache, Plan, span_plan
from polestar.registry import register
from polestar.stages import NOTHING_AHEAD, AfterStep, RefreshSelector
from polestar.state import DecodeState, StepPosition
from polestar.streams import SideStream

from .polestar_hooks import PolestarBuildHook, PolestarMembers
from .polestar_state import PolestarPhase, PolestarRefreshState, WindowBuffers, WindowStacks
from .polestar_trace import CLUSTER_DRIFT
from .refresh_basic import block_plan, block_start_plan
from .row_store import RowStore
from .sparse_update import SparseUpdate, Window, make_window


def window_parts_of(n_prefix: int, size: int, n_clusters: int) -> list[tuple[int, int, int]]:
    """``(lo, hi, k)``: column range and cluster count of a window's prefix and suffix parts (``n_prefix`` of its
    ``size`` columns before the block; empty parts dropped)."""
    k_pre, k_post = split_clusters(n_clusters, n_prefix, size - n_prefix)
    return [(lo, hi, k) for lo, hi, k in ((0, n_prefix, k_pre), (n_prefix, size, k_post)) if k > 0]


def window_parts(window: Window, n_clusters: int) -> list[tuple[int, int, int]]:
    """:func:`window_parts_of` of ``window``."""
    return window_parts_of(window.n_prefix, window.size, n_clusters)


def split_clusters(total: int, n_pre: int, n_post: int) -> tuple[int, int]:
    """Clusters for the prefix and suffix parts, proportional to their lengths (authors' rule), each ≤ its size."""
    if n_pre == 0:
        return 0, min(total, n_post)
    if n_post == 0:  # the authors cap the prefix at total - 1 clusters even when the suffix is empty
        return min(max(1, total - 1), n_pre), 0
    k_pre = min(total - 1, max(1, total * n_pre // (n_pre + n_post)))
    return min(k_pre, n_pre), min(total - k_pre, n_post)


def member_capacity(window: int, k: int, n_clusters: int, capacity: float) -> int:
    """Rows of a layer's member buffer: ``capacity`` times the expected member count ``window * k / n_clusters``
    (rounded up), at most ``window``."""
    return min(window, math.ceil(capacity * window * min(k, n_clusters) / n_clusters))


@register("refresh", "polestar")
class PolestarRefresh(RefreshSelector):
    """Polestar-Cache (see module docstring). Defaults are the paper's / authors' code values.

    ``cluster_layers_together``: at a block start, cluster every layer's window in one clusterer call after the
    forward (True) or each layer's window inside its pass (False); None (default): True on every device.
    Together, the clusterer runs once per block start instead of once per layer (``n_layers`` times fewer small
    operations: at 32 layers some 5,000 fewer per block start, what an eager step pays for on any device and a
    CUDA graph still pays per node), and the centroid queries take one more pass over each layer's q weight after
    the forward (counted in ``weight_bytes``; for LLaDA-8B ~8% of one step's weights, at block starts only). Each
    layer inside its pass, the centroids ride along the layer's q pass and every weight is read once per step. Both
    give the same clusters, stores and proxy distributions up to the rounding of the q projection. Together, the
    layers go to the clusterer in groups that bound the inputs kept meanwhile (:meth:`layers_per_cluster_call`)."""

    @attrs.frozen
    class Config:
        n_clusters: int = attrs.field(default=8, validator=v.ge(2))
        topk: int = attrs.field(default=4, validator=v.ge(1))
        topk_last: int = attrs.field(default=1, validator=v.ge(1))
        prefix_blocks: int = attrs.field(default=2, validator=v.ge(0))
        suffix_blocks: int = attrs.field(default=1, validator=v.ge(0))
        tau_upd: int = attrs.field(default=1, validator=v.ge(0))
        window_refresh_every: int = attrs.field(default=4, validator=v.ge(0))
        capacity: float = attrs.field(default=1.5, validator=v.gt(0.0))
        proxy_rope: bool = attrs.field(default=False, validator=v.instance_of(bool))
        cluster_layers_together: bool | None = attrs.field(default=None, validator=v.optional(v.instance_of(bool)))

        def __attrs_post_init__(self):  # only n_clusters clusters exist to pick from
            for name in ("topk", "topk_last"):
                if getattr(self, name) > self.n_clusters:
                    raise ValueError(f"{name} ({getattr(self, name)}) cannot exceed n_clusters ({self.n_clusters}): "
                                     f"only n_clusters clusters exist to pick from; lower {name} or raise n_clusters")

    needs_hidden = False
    requires = ("drift", "cluster", "quant", "offload")
    trace_figures = (CLUSTER_DRIFT,)

    def bind(self, stages: dict) -> None:
        self.drift, self.clusterer = stages["drift"], stages["cluster"]
        self.quant, self.offload = stages["quant"], stages["offload"]
        self.packet_logits = bool(getattr(stages.get("commit"), "wants_packet", False))

    def init_state(self, state: DecodeState) -> PolestarRefreshState:
        B, device = state.batch_size, state.x.device
        return PolestarRefreshState(SideStream(device), since=torch.zeros(B, dtype=torch.long, device=device),
                                    due=torch.zeros(B, dtype=torch.bool, device=device))

    def begin_generation(self, local: PolestarRefreshState, state: DecodeState, cache: DecodeCache, model) -> None:
        """The keys' inverse rotation for :func:`~polestar.policies.polestar_hooks.proxy_probs` (cos, -sin of this
        generation's cache positions), into its buffers (allocated with the first generation)."""
        if self.config.proxy_rope:
            return
        cos, sin = model.rotary.cos_sin(cache.positions)
        if local.key_rope is None:
            local.key_rope = (torch.empty_like(cos), torch.empty_like(sin))
        local.key_rope[0].copy_(cos)
        local.key_rope[1].copy_(-sin)

    def begin_block(self, local: PolestarRefreshState, state: DecodeState) -> None:
        local.since.zero_()
        local.due.zero_()

    def suffix_columns(self, state: DecodeState, position: StepPosition) -> int:
        """Columns of the window after the block at ``position`` (``suffix_blocks`` blocks, clipped at the end)."""
        return min(state.length, position.block_end + self.config.suffix_blocks * state.block_length) - \
            position.block_end

    def phase(self, position: StepPosition, state: DecodeState, local: PolestarRefreshState) -> PolestarPhase:
        """A block start (``build``, with the window-refresh span's length or 0 for a full forward), a sparse-update
        step (``update``: the previous step found a row due), or a plain block step; ``n_post``: the window's
        suffix columns where the step reads the window (narrower in the last blocks)."""
        c, bl = self.config, state.block_length
        n_post = self.suffix_columns(state, position)
        has_window = c.prefix_blocks * bl + n_post > 0
        if position.at_block_start:
            span = 0
            every = c.window_refresh_every
            if every and position.block_index % every == every - 1:
                lo = max(0, position.block_start - state.logit_shift - c.prefix_blocks * bl)
                span = min(state.length, position.block_end + c.suffix_blocks * bl) - lo
            return PolestarPhase("build" if has_window else "start", n_post if has_window else 0, span)
        if has_window and position.flags and position.flags[0]:
            return PolestarPhase("update", n_post, 0)
        return PolestarPhase("plain", 0, 0)

    def allocate(self, local: PolestarRefreshState, state: DecodeState, cache: DecodeCache, model,
                 position: StepPosition) -> None:
        """The block's window buffers (stores and clusters, allocated once per window size and reused by later
        blocks and generations) and the k-means seeds, drawn from the generation's generator in one draw
        ``[n_layers, parts, n]`` into their buffer, one key row shared by the batch."""
        n_post = self.suffix_columns(state, position)
        window = self.config.prefix_blocks * state.block_length + n_post
        local.current = None
        if window == 0:
            return
        if n_post not in local.windows:
            local.windows[n_post] = self.window_buffers(state, model, self.config.prefix_blocks * state.block_length,
                                                        n_post)
        cur = local.current = local.windows[n_post]
        if cur.keys is not None:
            L, P = model.spec.n_layers, len(cur.parts)
            n_max = cur.keys.shape[-1]
            cur.keys.copy_(init_keys(L * P, n_max, state.generator, state.x.device).view(L, P, n_max))

    def window_buffers(self, state: DecodeState, model, n_pre: int, n_post: int) -> WindowBuffers:
        """The :class:`WindowBuffers` of a window of ``n_pre`` prefix and ``n_post`` suffix columns, for this
        selector's stages (allocated once per window size)."""
        spec, B, device, dtype = model.spec, state.batch_size, state.x.device, model.dtype
        L, n = spec.n_layers, n_pre + n_post
        parts = tuple(window_parts_of(n_pre, n, self.config.n_clusters))
        K = sum(k for _lo, _hi, k in parts)
        n_max = max(hi - lo for lo, hi, _k in parts)
        args = (self.quant, self.offload, L, B, n)
        keys = torch.zeros(L, len(parts), n_max, device=device) if self.clusterer.needs_keys else None

        def zeros(*shape, dt=dtype):
            return torch.zeros(L, *shape, dtype=dt, device=device)

        store = RowStore(*args, spec.d_model, device, dtype)
        qstore = RowStore(*args, spec.n_heads * spec.head_dim, device, dtype)
        stacks = WindowStacks(zeros(B, K, spec.d_model), zeros(B, n, dt=torch.long), zeros(B, K, dt=torch.long),
                              zeros(B, K, dt=torch.long), zeros(B, spec.n_heads, K, state.length + 1, dt=torch.float32))
        return WindowBuffers(parts, store, qstore, keys, *(t.unbind(0) for t in stacks), tuple(self.capacities(n, L)),
                             stacks, torch.zeros(n + 1, dtype=torch.long, device=device),
                             torch.zeros(B, n, dtype=torch.bool, device=device))

    #: bytes of kept window inputs (with the clusterer's fp32 copies of them) one block start's clusterer call may
    #: hold when clustering layers together: the layers are clustered in groups that fit (every layer in one call
    #: for the shipped models and for LLaDA-8B at batch 1; one call per layer for LLaDA-8B at batch 32)
    CLUSTER_CALL_BYTES = 256 * 2**20

    def layers_per_cluster_call(self, batch: int, window: int, width: int, n_layers: int) -> int:
        """Layers clustered per clusterer call at a block start when clustering layers together: as many as fit in
        :data:`CLUSTER_CALL_BYTES` (each layer's ``[B, Nw, d]`` inputs, counted three times in fp32: kept, stacked,
        padded by part), at least one, at most ``n_layers``."""
        per_layer = max(1, batch * window * width * 4 * 3)
        return max(1, min(n_layers, self.CLUSTER_CALL_BYTES // per_layer))

    def clusters_together(self, device: torch.device) -> bool:
        """Whether a block start clusters every layer in one clusterer call (see the class docstring)."""
        together = self.config.cluster_layers_together
        return True if together is None else together

    # -- plan -----------------------------------------------------------------------------------------------
    def plan(self, state: DecodeState, cache: DecodeCache, local: PolestarRefreshState) -> Plan:
        phase: PolestarPhase = state.phase.refresh
        if phase.kind not in ("build", "start"):
            return block_plan(state)
        if phase.span:  # a window refresh: only the window and the block are recomputed
            shift, start = state.logit_shift, state.clock.block_start
            lo = (start - shift - self.config.prefix_blocks * state.block_length).clamp_min(0)
            return span_plan(state.batch_size, lo, phase.span, state.x.device, state.active, start - shift - lo)
        return block_start_plan(state)

    def hook(self, state: DecodeState, plan: Plan, cache: DecodeCache, model, local: PolestarRefreshState):
        phase: PolestarPhase = state.phase.refresh
        if phase.kind == "build":  # the block's first forward: cluster and store the window at every layer
            plan_start = state.clock.block_start - state.logit_shift - plan.target_offset
            return PolestarBuildHook(self, state, plan_start, cache, LayerOps(model), local)
        if phase.kind != "update":  # no row is due for an update (decided on the device, read with the loop's)
            return None
        # the block start's side-stream work (storing the window) must finish before this step reads the stores
        local.side.join()
        ops = LayerOps(model)
        strategy = PolestarMembers(self, state, cache, ops, local)
        return SparseUpdate(strategy, ops, cache, state.batch_size, state.x.device)

    def window(self, state: DecodeState, cache: DecodeCache) -> Window:
        """The current block's :class:`Window` (its suffix width from the step's phase)."""
        bl = state.block_length
        return make_window(state.clock.block_start, bl, state.logit_shift, self.config.prefix_blocks * bl,
                           state.phase.refresh.n_post, cache)

    def keep_window(self, window: Window, buf: WindowBuffers, cache: DecodeCache) -> None:
        """Keep the block's ``window`` in ``buf`` (written in place at the block's first step) for
        :meth:`kept_window`."""
        buf.row_slot.copy_(torch.cat([window.positions, window.positions.new_full((1,), cache.trash)]))
        buf.valid.copy_(window.valid)

    def kept_window(self, state: DecodeState, buf: WindowBuffers) -> Window:
        """The current block's :class:`Window` as its first step kept it (the same values as :meth:`window`; an update
        step reads it instead of computing it)."""
        return Window(buf.row_slot[:-1], buf.valid, self.config.prefix_blocks * state.block_length)

    def after_step(self, state: DecodeState, cache: DecodeCache, model, local: PolestarRefreshState) -> AfterStep:
        """Flags ``[1]`` bool: is any row due for a sparse update at the next step. A row is due when the step just
        taken committed more than ``tau_upd`` tokens or more than ``tau_upd + 1`` were committed since its last
        update; ``local.due [B]`` keeps which rows (the others take part with no member). Written in place."""
        if self.config.prefix_blocks == 0 and self.config.suffix_blocks == 0:
            return NOTHING_AHEAD
        last = state.last_commits
        tau = self.config.tau_upd
        due = state.active & ((last > tau) | (local.since + last > tau + 1))
        local.since.copy_(torch.where(due, 0, local.since + last))
        local.due.copy_(due)
        return AfterStep(due.any()[None])

    def refreshes_layer(self, layer: int, n_layers: int) -> bool:
        """Whether a sparse update recomputes members at ``layer``: at every layer but the last, and at the last only
        for a commit rule that reads the update packet's logits (Polestar-Commit's suffix commit). The last layer's
        member outputs feed nothing else (no later layer stores them or re-projects their K/V), so without such a
        rule that layer scores no proxies and picks no members."""
        return layer < n_layers - 1 or self.packet_logits

    def capacities(self, window: int, n_layers: int) -> list[int]:
        """Member-buffer rows per layer (:func:`member_capacity`; ``topk_last`` at the last layer)."""
        c = self.config
        return [member_capacity(window, c.topk_last if layer == n_layers - 1 else c.topk, c.n_clusters, c.capacity)
                for layer in range(n_layers)]
