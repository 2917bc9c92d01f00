"""Polestar-Cache refresh selector: drift-aware sparse updates of the local window (Lee et al. 2026).

Per block: a full forward (every ``window_refresh_every``-th block only the window) rebuilds K/V. During it, at each
layer, the window's input hidden states are clustered (``cluster`` stage, ``n_clusters`` split between the prefix
and suffix parts in proportion to their lengths, 5/3 for 2+1 blocks) and stored with their queries (``quant`` +
``offload`` stages, :class:`~polestar.policies.row_store.RowStore`); each centroid becomes a proxy query
(``q_proj(attn_norm(c))``, RoPE at its members' mean position) that rides along the layer's q pass, and its
attention over the layer's keys is recorded. (``cluster_layers_together``, the default on a CPU: every layer's
window is clustered in one clusterer call after the forward, and the centroid queries take a q pass of their
own; see :class:`PolestarRefresh`.) At a sparse-update step the same happens at every layer inside the
step's one pass (:mod:`polestar.policies.sparse_update`): the ``drift`` stage compares the proxy distributions with
the previous update's, the members of the ``topk`` most drifting clusters (``topk_last`` at the last layer) are
gathered into a fixed-capacity buffer (``capacity`` times the expected member count ``Nw * k / n_clusters``,
at most the window; the highest-drifting clusters first when the chosen clusters hold more) and recomputed
through the layer with the block; their outputs (the update packet) overwrite their stored inputs and K/V at the
next layer, and centroids shift by their members' change. A member's query is its stored one: a query changes
only when its input does, and an input changes only by a packet, which re-projects it in the next layer's pass;
so no layer's q weight is read twice in an update step. Updates run when the previous step committed more than ``tau_upd`` tokens or
more than ``tau_upd + 1`` were committed since the last update. The last layer's packet yields logits for the
refreshed positions in the block's LM-head pass (:class:`~polestar.state.UpdatePacket`), which the engine hands to
the commit rule as ``DecodeState.packet``; only a commit rule that reads it (Polestar-Commit) has the last layer
recompute members at all (:meth:`PolestarRefresh.refreshes_layer`): with any other rule those rows would feed
nothing. Per-generation state lives in a :class:`PolestarRefreshState`.

Shapes: window ``Nw = (prefix_blocks + suffix_blocks) * block_length`` columns; centroids ``[B, K, d]``; proxy
distributions ``[B, H, K, T + 1]``; drift ``[B, K]``; member buffer ``[B, M_l]`` per layer.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import attrs
import torch
from attrs import validators as v

from polestar.kernels.kmeans import init_keys
from polestar.models.backbone import ExtraRows, LayerQKV
from polestar.models.layers import Rotary
from polestar.models.plan import DecodeCache, Plan, span_plan
from polestar.profiling import scope
from polestar.registry import register
from polestar.stages import LayerHook, RefreshSelector
from polestar.state import ClusterDrift, DecodeState, StepPosition
from polestar.streams import SideStream

from .refresh_basic import block_plan, block_start_plan
from .row_store import RowStore
from .sparse_update import MemberStrategy, Packet, Selection, SparseUpdate, Window, make_window, to_capacity


def window_parts_of(n_prefix: int, size: int, n_clusters: int) -> list[tuple[int, int, int]]:
    """``(lo, hi, k)``: column range and cluster count of a window's prefix and suffix parts (``n_prefix`` of its
    ``size`` columns before the block; empty parts dropped)."""
    k_pre, k_post = split_clusters(n_clusters, n_prefix, size - n_prefix)
    return [(lo, hi, k) for lo, hi, k in ((0, n_prefix, k_pre), (n_prefix, size, k_post)) if k > 0]


def window_parts(window: Window, n_clusters: int) -> list[tuple[int, int, int]]:
    """:func:`window_parts_of` of ``window``."""
    return window_parts_of(window.n_prefix, window.size, n_clusters)


def enabled_clusters(ks: tuple[int, ...], k_max: int, batch: int, device: torch.device) -> torch.Tensor:
    """``[len(ks) * batch, k_max]`` bool: per window part (``ks`` its cluster counts) and row, which of the
    ``k_max`` cluster slots the part uses."""
    return torch.cat([(torch.arange(k_max, device=device) < k).expand(batch, -1) for k in ks])


def pad_columns(t: torch.Tensor, n: int, fill) -> torch.Tensor:
    """``t [B, m, ...]`` padded with ``fill`` to ``[B, n, ...]`` along dim 1 (``n ≥ m``)."""
    pad = n - t.shape[1]
    if pad == 0:
        return t
    return torch.cat([t, t.new_full((t.shape[0], pad, *t.shape[2:]), fill)], dim=1)


def split_clusters(total: int, n_pre: int, n_post: int) -> tuple[int, int]:
    """Clusters for the prefix and suffix parts, proportional to their lengths (authors' rule), each ≤ its size."""
    if n_pre == 0:
        return 0, min(total, n_post)
    if n_post == 0:  # the authors cap the prefix at total - 1 clusters even when the suffix is empty
        return min(max(1, total - 1), n_pre), 0
    k_pre = min(total - 1, max(1, total * n_pre // (n_pre + n_post)))
    return min(k_pre, n_pre), min(total - k_pre, n_post)


#: drifts are ranked on a grid of this step: differences below it are rounding noise (they change with the
#: batch's matmul shapes and with a compiler's fusion), and a tie goes to the lower cluster index
DRIFT_RESOLUTION = 2.0**-20


def cluster_ranks(drift: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rank of each cluster by drift, 0 = most drifting, empty clusters last: ``drift, counts [B, K]`` → long
    ``[B, K]``. Drifts are compared on a grid of :data:`DRIFT_RESOLUTION`; ties go to the lower cluster index."""
    scores = torch.round(drift.float() / DRIFT_RESOLUTION).masked_fill(counts == 0, float("-inf"))
    return scores.argsort(dim=1, descending=True, stable=True).argsort(dim=1)


def top_clusters(drift: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` most drifting non-empty clusters of each row: ``drift, counts [B, K]`` → bool ``[B, K]``.
    Ties go to the lower cluster index, so a larger ``k`` always selects a superset."""
    return (cluster_ranks(drift, counts) < min(k, drift.shape[1])) & (counts > 0)


def member_capacity(window: int, k: int, n_clusters: int, capacity: float) -> int:
    """Rows of a layer's member buffer: ``capacity`` times the expected member count ``window * k / n_clusters``
    (rounded up), at most ``window``."""
    return min(window, math.ceil(capacity * window * min(k, n_clusters) / n_clusters))


@register("refresh", "polestar")
class PolestarRefresh(RefreshSelector):
    """Polestar-Cache (see module docstring). Defaults are the paper's / authors' code values.

    ``cluster_layers_together``: at a block start, cluster every layer's window in one clusterer call after the
    forward (True) or each layer's window inside its pass (False); None (default) picks True on a CPU and False
    elsewhere. Together, the clusterer runs once per block start instead of once per layer (``n_layers`` times
    fewer small operations, what an eager step on a CPU pays for), and the centroid queries take one more pass over
    each layer's q weight after the forward (counted in ``weight_bytes``). Each layer inside its pass, the centroids
    ride along the layer's q pass and every weight is read once per step (what a bandwidth-bound GPU step pays
    for). Both give the same clusters, stores and proxy distributions up to the rounding of the q projection."""

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
    requires = {"drift": "kl", "cluster": "kmeans", "quant": "none", "offload": "none"}

    def bind(self, stages: dict) -> None:
        self.drift, self.clusterer = stages["drift"], stages["cluster"]
        self.quant, self.offload = stages["quant"], stages["offload"]
        self.packet_logits = bool(getattr(stages.get("commit"), "wants_packet", False))

    def init_state(self, state: DecodeState) -> PolestarRefreshState:
        B, device = state.batch_size, state.x.device
        return PolestarRefreshState(SideStream(device), since=torch.zeros(B, dtype=torch.long, device=device),
                                    due=torch.zeros(B, dtype=torch.bool, device=device))

    def begin_generation(self, local: PolestarRefreshState, state: DecodeState, cache: DecodeCache, model) -> None:
        """The keys' inverse rotation for :func:`proxy_probs` (cos, -sin of this generation's cache positions), into
        its buffers (allocated with the first generation)."""
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
            local.windows[n_post] = WindowBuffers.allocate(self, state, model, self.config.prefix_blocks *
                                                           state.block_length, n_post)
        cur = local.current = local.windows[n_post]
        if cur.keys is not None:
            L, P = model.spec.n_layers, len(cur.parts)
            n_max = cur.keys.shape[-1]
            cur.keys.copy_(init_keys(L * P, n_max, state.generator, state.x.device).view(L, P, n_max))

    def clusters_together(self, device: torch.device) -> bool:
        """Whether a block start clusters every layer in one clusterer call (see the class docstring)."""
        together = self.config.cluster_layers_together
        return torch.device(device).type == "cpu" if together is None else together

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
            return _BuildHook(self, state, plan_start, cache, model, local)
        if phase.kind != "update":  # no row is due for an update (decided on the device, read with the loop's)
            return None
        # the block start's side-stream work (storing the window) must finish before this step reads the stores
        local.side.join()
        strategy = _PolestarMembers(self, state, cache, model, local)
        return SparseUpdate(strategy, model, cache, state.batch_size, state.x.device)

    def window(self, state: DecodeState, cache: DecodeCache) -> Window:
        """The current block's :class:`Window` (its suffix width from the step's phase)."""
        bl = state.block_length
        return make_window(state.clock.block_start, bl, state.logit_shift, self.config.prefix_blocks * bl,
                           state.phase.refresh.n_post, cache)

    def next_step_flags(self, state: DecodeState, local: PolestarRefreshState) -> torch.Tensor | None:
        """``[1]`` bool: is any row due for a sparse update at the next step. A row is due when the step just taken
        committed more than ``tau_upd`` tokens or more than ``tau_upd + 1`` were committed since its last update;
        ``local.due [B]`` keeps which rows (the others take part with no member). Written in place."""
        if self.config.prefix_blocks == 0 and self.config.suffix_blocks == 0:
            return None
        last = state.last_commits
        tau = self.config.tau_upd
        due = state.active & ((last > tau) | (local.since + last > tau + 1))
        local.since.copy_(torch.where(due, 0, local.since + last))
        local.due.copy_(due)
        return due.any()[None]

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


class PolestarPhase(NamedTuple):
    """:class:`PolestarRefresh`'s entry of the step phase: ``kind`` ``"build"`` (a block start that clusters and
    stores the window), ``"start"`` (a block start with an empty window), ``"update"`` (a sparse-update step) or
    ``"plain"``; ``n_post`` the window's suffix columns
    (where the step reads the window); ``span`` at a window-refresh block start, the length of the recomputed span
    (0: a full forward)."""

    kind: str
    n_post: int
    span: int


@attrs.define
class WindowBuffers:
    """The buffers of one window size (``Nw = n_pre + n_post`` columns), allocated once and reused by every block and
    generation with that window: the stores of the window's layer inputs and queries (:class:`RowStore`
    ``[B, Nw, d]`` and ``[B, Nw, H * hd]`` per layer), the k-means seeds ``keys [L, P, n]`` (one key row per layer
    and window part, shared by the batch; None for a clusterer without keys), and per layer (stacked on dim 0) the
    block start's clusters: ``centroids [L, B, K, d]``, ``labels [L, B, Nw]`` (-1 invalid), ``counts [L, B, K]``,
    ``centroid_pos [L, B, K]`` and the last update's proxy distributions ``prev [L, B, H, K, T+1]``. ``parts``: the
    window parts' ``(lo, hi, k)`` (:func:`window_parts`)."""

    parts: tuple
    store: RowStore
    qstore: RowStore
    keys: torch.Tensor | None
    centroids: torch.Tensor
    labels: torch.Tensor
    counts: torch.Tensor
    centroid_pos: torch.Tensor
    prev: torch.Tensor

    @classmethod
    def allocate(cls, sel: PolestarRefresh, state: DecodeState, model, n_pre: int, n_post: int) -> WindowBuffers:
        spec, B, device, dtype = model.spec, state.batch_size, state.x.device, model.dtype
        L, n = spec.n_layers, n_pre + n_post
        parts = tuple(window_parts_of(n_pre, n, sel.config.n_clusters))
        K = sum(k for _lo, _hi, k in parts)
        n_max = max(hi - lo for lo, hi, _k in parts)
        args = (sel.quant, sel.offload, L, B, n)
        keys = torch.zeros(L, len(parts), n_max, device=device) if sel.clusterer.needs_keys else None

        def zeros(*shape, dt=dtype):
            return torch.zeros(*shape, dtype=dt, device=device)

        return cls(parts, RowStore(*args, spec.d_model, device, dtype),
                   RowStore(*args, spec.n_heads * spec.head_dim, device, dtype), keys,
                   zeros(L, B, K, spec.d_model), zeros(L, B, n, dt=torch.long), zeros(L, B, K, dt=torch.long),
                   zeros(L, B, K, dt=torch.long), zeros(L, B, spec.n_heads, K, state.length + 1, dt=torch.float32))


@attrs.define
class PolestarRefreshState:
    """Per-generation state of :class:`PolestarRefresh`, preallocated and written in place.

    ``side``: the side stream of the block-start work; ``since``: ``[B]`` tokens committed since each row's last
    update; ``due``: ``[B]`` rows due for an update at the next step (both reset at each block start);
    ``key_rope``: cos, -sin ``[B, 1, T + 1, hd]`` of the cache positions for :func:`proxy_probs`, written once per
    generation (None with ``proxy_rope``); ``windows``: the :class:`WindowBuffers` of each window suffix width met so
    far, and ``current`` the current block's (set on the host when the block starts; None for an empty window).
    """

    side: SideStream
    since: torch.Tensor
    due: torch.Tensor
    key_rope: tuple | None = None
    windows: dict = attrs.field(factory=dict)
    current: WindowBuffers | None = None


def proxy_probs(model, cache: DecodeCache, layer: int, key_rope: tuple | None, q: torch.Tensor, meter) -> torch.Tensor:
    """Centroid queries ``q [B, H, R, hd]`` scored against ``layer``'s keys → fp32 ``[B, H, R, T+1]``
    (:meth:`~polestar.models.backbone.DiffusionLM.attention_probs`). The keys are the cached (rotated) ones when
    ``key_rope`` is None (``proxy_rope``), else the keys with their rotary embedding undone (``key_rope``: cos and
    -sin ``[B, 1, T + 1, hd]`` of the cache positions, the inverse rotation), as the authors' released code scores
    un-rotated centroid queries against un-rotated keys; that pass reads the keys once more, and ``meter`` counts
    it."""
    keys = cache.k[layer]
    if key_rope is not None:
        if meter is not None:
            meter.attention(keys, None)  # the pass that undoes the rotary embedding
        cos, neg_sin = key_rope
        keys = Rotary.apply(keys, cos, neg_sin)
    return model.attention_probs(q, keys, cache.key_valid, meter)


class _BuildHook(LayerHook):
    """Block start: cluster the window's inputs at every layer, store them (residuals to their centroid) and their
    queries, and record the centroids' proxy distributions.

    The window rows' queries go to the query store at each layer (:meth:`members`). Clustering and the proxy
    distributions then take one of two routes (:meth:`PolestarRefresh.clusters_together`):

    * each layer inside its pass: the layer's window is clustered in :meth:`extra_rows`, its centroids ride along
      the layer's q pass as query-only rows, and after the layer's K/V writes their attention over the keys
      becomes ``prev``;
    * all layers together: each layer's window inputs are kept, and once the last layer has written its K/V, one
      clusterer call clusters every layer's window (the layers' parts stacked as groups ``[L * P * B, n]``), then
      each layer's centroid queries take a q pass of their own (:meth:`~polestar.models.backbone.DiffusionLM.
      project_queries`) and their attention becomes ``prev``.

    The clusterer's random initial keys are drawn at the block start, before the step
    (:meth:`PolestarRefresh.allocate`), so the whole block start runs inside the compiled step.
    """

    def __init__(self, sel: PolestarRefresh, state, plan_start, cache, model, local: PolestarRefreshState):
        self.sel, self.state, self.cache, self.model, self.local = sel, state, cache, model, local
        self.buffers: WindowBuffers = local.current
        self.window = window = sel.window(state, cache)
        B = state.batch_size
        self.slots = (window.positions - plan_start)[None, :].expand(B, -1)
        spec = model.spec
        self.q_slots = self.slots[:, None, :, None].expand(-1, spec.n_heads, -1, spec.head_dim)
        self.evals = torch.zeros(B, dtype=torch.long, device=state.x.device)
        self.parts = self.buffers.parts
        self.rope_pos = cache.positions.index_select(1, window.positions)
        self.together = sel.clusters_together(state.x.device)
        self.inputs: list[torch.Tensor] = []  # each layer's window inputs [B, Nw, d], kept when clustering together

    def _cluster(self, hw: torch.Tensor, keys: torch.Tensor | None):
        """``hw [n, B, Nw, d]`` (``n`` layers), ``keys [n, P, m]`` (one key row per layer and part, shared by the
        batch) or None → ``centroids [n, B, K, d]``,
        ``labels [n, B, Nw]`` (window-wide cluster ids, -1 invalid), ``counts [n, B, K]``. The prefix and suffix
        parts of every layer are clustered separately, in one clusterer call: each (layer, part) is a group of its
        own, padded to the longer part (padding invalid) with the clusters it lacks disabled."""
        parts = self.parts
        n, B, Nw, d = hw.shape
        P = len(parts)
        n_max, k_max = max(hi - lo for lo, hi, _k in parts), max(k for _lo, _hi, k in parts)
        flat = hw.reshape(n * B, Nw, d).float()
        x = torch.stack([pad_columns(flat[:, lo:hi], n_max, 0.0).view(n, B, n_max, d) for lo, hi, _k in parts], 1)
        ok = torch.cat([pad_columns(self.window.valid[:, lo:hi], n_max, False) for lo, hi, _k in parts])
        groups = n * P * B
        seeds = None if keys is None else keys[:, :, None, :].expand(n, P, B, n_max).reshape(groups, n_max)
        k_valid = enabled_clusters(tuple(k for _lo, _hi, k in parts), k_max, B, hw.device).repeat(n, 1)
        with scope("cluster"):
            c, lab, cnt = self.sel.clusterer.cluster(x.reshape(groups, n_max, d), k_max, ok.repeat(n, 1), None,
                                                     seeds, k_valid=k_valid)
        c, lab, cnt = c.view(n, P, B, k_max, d), lab.view(n, P, B, n_max), cnt.view(n, P, B, k_max)
        centroids, labels, counts, offset = [], [], [], 0
        for i, (lo, hi, k) in enumerate(parts):
            centroids.append(c[:, i, :, :k])
            counts.append(cnt[:, i, :, :k])
            part_labels = lab[:, i, :, : hi - lo]
            labels.append(torch.where(part_labels >= 0, part_labels + offset, -1))
            offset += k
        return torch.cat(centroids, dim=2).to(hw.dtype), torch.cat(labels, dim=2), torch.cat(counts, dim=2)

    def _record(self, first: int, hw: torch.Tensor, keys: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Cluster layers ``first, first + 1, ...`` (window inputs ``hw [n, B, Nw, d]``), store their windows and
        write their clusters into the window's buffers; → the centroids ``[n, B, K, d]`` and their RoPE positions
        ``[n, B, K]``."""
        local, buf = self.local, self.buffers
        centroids, labels, counts = self._cluster(hw, keys)
        if self.sel.config.proxy_rope:  # the members' mean position
            onehot = torch.nn.functional.one_hot(labels.clamp_min(0), centroids.shape[2]).float()
            onehot = onehot * (labels >= 0)[..., None].float()
            centroid_pos = (torch.einsum("nbwk,bw->nbk", onehot, self.rope_pos.float())
                            / counts.clamp_min(1)).round().long()
        else:  # rotary at position 0 is the identity: un-rotated centroid queries
            centroid_pos = torch.zeros(counts.shape, dtype=torch.long, device=counts.device)
        anchor = None
        if not buf.store.quant.lossless:  # a lossy store keeps residuals to each member's centroid
            anchor = centroids.gather(2, labels.clamp_min(0)[..., None].expand(-1, -1, -1, hw.shape[-1]))
        for i in range(hw.shape[0]):
            with local.side.run(*(t[i] for t in (hw, anchor) if t is not None)), scope("store"):
                buf.store.write_all(first + i, hw[i], None if anchor is None else anchor[i])
        layers = slice(first, first + hw.shape[0])
        buf.centroids[layers].copy_(centroids)
        buf.labels[layers].copy_(labels)
        buf.counts[layers].copy_(counts)
        buf.centroid_pos[layers].copy_(centroid_pos)
        return centroids, centroid_pos

    def extra_rows(self, layer: int, h: torch.Tensor, meter) -> ExtraRows | None:
        hw = h.gather(1, self.slots[..., None].expand(-1, -1, h.shape[-1]))
        if self.together:
            self.inputs.append(hw)
            return None
        keys = None if self.buffers.keys is None else self.buffers.keys[layer : layer + 1]
        centroids, centroid_pos = self._record(layer, hw[None], keys)
        if not self.sel.refreshes_layer(layer, self.model.spec.n_layers):
            return None
        return ExtraRows(centroids[0], centroid_pos[0], torch.full_like(centroid_pos[0], self.cache.trash))

    def members(self, layer: int, qkv: LayerQKV) -> None:
        local, C = self.local, qkv.n_plan
        B, H, _, hd = qkv.q.shape
        q_window = qkv.q.gather(2, self.q_slots)  # the window's slots lie among the plan's C rows
        with local.side.run(q_window), scope("store"):
            self.buffers.qstore.write_all(layer, q_window.transpose(1, 2).reshape(B, -1, H * hd))
        if not self.together:
            if not self.sel.refreshes_layer(layer, self.model.spec.n_layers):
                return None
            with scope("proxy_attention"):
                self.buffers.prev[layer].copy_(proxy_probs(self.model, self.cache, layer, local.key_rope,
                                                           qkv.q[:, :, C:], qkv.meter))
        elif layer == self.model.spec.n_layers - 1:  # every layer's K/V is written: cluster them all at once
            self._cluster_all(qkv.meter)
        return None

    def _cluster_all(self, meter) -> None:
        """Cluster every layer's kept window inputs in one clusterer call, then score each layer's centroid queries
        (a pass over the layer's q weight of their own) against its keys."""
        local, model = self.local, self.model
        centroids, centroid_pos = self._record(0, torch.stack(self.inputs), self.buffers.keys)
        self.inputs.clear()
        for layer in range(model.spec.n_layers):
            if not self.sel.refreshes_layer(layer, model.spec.n_layers):
                continue
            positions = centroid_pos[layer] if self.sel.config.proxy_rope else None
            q = model.project_queries(layer, centroids[layer], positions, meter)
            with scope("proxy_attention"):
                self.buffers.prev[layer].copy_(proxy_probs(model, self.cache, layer, local.key_rope, q, meter))


class _PolestarMembers(MemberStrategy):
    """Polestar's member choice at a sparse-update step (see the module docstring): query-only rows are the layer's
    centroids; members are the window rows of the top drifting clusters, queries from the query store. ``local.due [B]``:
    rows that update at this step (the others choose no member)."""

    wants_old = True

    def __init__(self, sel: PolestarRefresh, state, cache, model, local: PolestarRefreshState):
        self.sel, self.cache, self.model, self.local, self.due = sel, cache, model, local, local.due
        self.buffers = buf = local.current
        self.window = window = sel.window(state, cache)
        self.store = buf.store
        self.trash = window.size
        self.row_slot = torch.cat([window.positions, window.positions.new_full((1,), cache.trash)])
        self.capacity = sel.capacities(window.size, model.spec.n_layers)
        self.wants_head = sel.packet_logits
        self.x = state.x
        self.n_kv = 0
        self.detail = state.detail

    def slots(self, rows: torch.Tensor) -> torch.Tensor:
        return self.row_slot[rows]

    def on_write(self, layer: int, packet: Packet, old: torch.Tensor) -> None:
        """Shift each centroid by the mean change of its members: ``delta [B, K, d]``."""
        buf = self.buffers
        labels = buf.labels[layer].gather(1, packet.rows.clamp(max=self.trash - 1))
        k_clusters = buf.centroids.shape[2]
        keep = (packet.valid & (labels >= 0))[..., None].to(old.dtype)
        onehot = torch.nn.functional.one_hot(labels.clamp_min(0), k_clusters).to(old.dtype) * keep
        delta = torch.einsum("bmk,bmd->bkd", onehot, packet.out.to(old.dtype) - old)
        counts = buf.counts[layer].clamp_min(1)[..., None].to(old.dtype)
        buf.centroids[layer].add_((delta / counts).to(buf.centroids.dtype))

    def extra_rows(self, layer: int, h: torch.Tensor, packet: Packet | None, kv: ExtraRows | None,
                   meter) -> ExtraRows | None:
        buf = self.buffers
        self.n_kv = 0 if kv is None else kv.inputs.shape[1]
        if not self.sel.refreshes_layer(layer, self.model.spec.n_layers):
            return kv
        pos = buf.centroid_pos[layer]
        proxies = ExtraRows(buf.centroids[layer], pos, torch.full_like(pos, self.cache.trash))
        if kv is None:
            return proxies
        return ExtraRows(*(torch.cat([a, b.to(a.dtype)], dim=1) for a, b in zip(kv, proxies)))

    def select(self, layer: int, qkv: LayerQKV, packet: Packet | None) -> Selection | None:
        local, buf, sel, model = self.local, self.buffers, self.sel, self.model
        if not sel.refreshes_layer(layer, model.spec.n_layers):
            return None
        B, H, _, hd = qkv.q.shape
        q_extra = qkv.q[:, :, qkv.n_plan:]
        if packet is not None:  # the packet rows' new queries, from this layer's pass, replace the stored ones
            q_packet = q_extra[:, :, : self.n_kv]
            with scope("store"):
                buf.qstore.write(layer, packet.rows, packet.valid, q_packet.transpose(1, 2).reshape(B, -1, H * hd))
        with scope("proxy_attention"):
            cur = proxy_probs(model, self.cache, layer, local.key_rope, q_extra[:, :, self.n_kv:], qkv.meter)
        with scope("drift"):
            drift = sel.drift.score(cur, buf.prev[layer])
        buf.prev[layer].copy_(torch.where(self.due[:, None, None, None], cur, buf.prev[layer]))
        k = sel.config.topk_last if layer == model.spec.n_layers - 1 else sel.config.topk
        counts = buf.counts[layer]
        rank = cluster_ranks(drift, counts)
        labels = buf.labels[layer]
        label_rank = rank.gather(1, labels.clamp_min(0))
        chosen = (label_rank < min(k, rank.shape[1])) & (counts.gather(1, labels.clamp_min(0)) > 0)
        member = self.window.valid & (labels >= 0) & chosen & self.due[:, None]
        rows, valid = to_capacity(member, label_rank, self.capacity[layer], self.trash)
        if self.detail is not None:  # an observer records: every cluster's drift and the chosen ones
            chosen_clusters = (rank < min(k, rank.shape[1])) & (counts > 0) & self.due[:, None]
            self.detail.clusters[layer] = ClusterDrift(drift, counts, chosen_clusters, self.window.positions, labels)
        with scope("store"):
            q = buf.qstore.read(layer, rows).view(B, -1, H, hd).transpose(1, 2)
        inputs = None
        if layer == 0:  # layer 0's input is the token embedding: read it, not the store
            tokens = self.x.gather(1, self.slots(rows).clamp(max=self.x.shape[1] - 1))  # trash slots: any token
            inputs = model.embed(tokens)
            qkv.meter.embedding(model.embedding_weight(), tokens.numel())
        return Selection(rows, valid, q, inputs)
