"""Polestar-Cache refresh selector: drift-aware sparse updates of the local window (Lee et al. 2026).

Per block: a full forward (every ``window_refresh_every``-th block only the window) rebuilds K/V, and per layer the
window's input hidden states are clustered (``cluster`` stage, ``n_clusters`` split between the prefix and suffix
parts in proportion to their lengths, 5/3 for 2+1 blocks) and stored (``quant`` + ``offload`` stages). Each centroid
becomes a proxy query (``q_proj(attn_norm(c))``, RoPE at its members' mean position) scored against the layer's
cached keys; the ``drift`` stage compares this step's proxy distribution with the previous update's. The ``topk``
most drifting clusters of a layer (``topk_last`` at the last layer) are recomputed through that layer and their
outputs (the update packet) overwrite their stored inputs and K/V at the next layer; centroids shift by their
members' change. Updates run when the previous step committed more than ``tau_upd`` tokens or more than
``tau_upd + 1`` were committed since the last update. The last layer's packet yields logits for the refreshed
positions (``LayerHook.packet``, an :class:`~polestar.state.UpdatePacket`: ``positions [Nw]``, ``valid [B, Nw]``,
``logits [B, Nw, V]``), which the engine hands to the commit rule as ``DecodeState.packet``. Per-generation state
(window, member store, clusters, proxy distributions) lives in a :class:`PolestarRefreshState` reset at each
block start.

Shapes: window ``Nw = (prefix_blocks + suffix_blocks) * block_length`` columns; centroids ``[B, K, d]``; proxy
distributions ``[B, H, K, T + 1]``; drift ``[B, K]``.
"""

from __future__ import annotations

import functools

import attrs
import torch
from attrs import validators as v

from polestar.kernels.kmeans import init_keys
from polestar.models.plan import DecodeCache, Plan, span_plan
from polestar.profiling import scope
from polestar.registry import register
from polestar.stages import LayerHook, RefreshSelector
from polestar.state import DecodeState, UpdatePacket
from polestar.streams import SideStream

from .refresh_basic import block_plan, block_start_plan
from .sparse_update import MemberStore, Window, make_window


def split_clusters(total: int, n_pre: int, n_post: int) -> tuple[int, int]:
    """Clusters for the prefix and suffix parts, proportional to their lengths (authors' rule), each ≤ its size."""
    if n_pre == 0:
        return 0, min(total, n_post)
    if n_post == 0:
        return min(total, n_pre), 0
    k_pre = min(total - 1, max(1, total * n_pre // (n_pre + n_post)))
    return min(k_pre, n_pre), min(total - k_pre, n_post)


def top_clusters(drift: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` most drifting non-empty clusters of each row: ``drift, counts [B, K]`` → bool ``[B, K]``.
    Ties go to the lower cluster index, so a larger ``k`` always selects a superset."""
    K = drift.shape[1]
    scores = drift.float().masked_fill(counts == 0, float("-inf"))
    rank = scores.argsort(dim=1, descending=True, stable=True).argsort(dim=1)
    return (rank < min(k, K)) & (counts > 0)


@register("refresh", "polestar")
class PolestarRefresh(RefreshSelector):
    """Polestar-Cache (see module docstring). Defaults are the paper's / authors' code values."""

    @attrs.frozen
    class Config:
        n_clusters: int = attrs.field(default=8, validator=v.ge(2))
        topk: int = attrs.field(default=4, validator=v.ge(1))
        topk_last: int = attrs.field(default=1, validator=v.ge(1))
        prefix_blocks: int = attrs.field(default=2, validator=v.ge(0))
        suffix_blocks: int = attrs.field(default=1, validator=v.ge(0))
        tau_upd: int = attrs.field(default=1, validator=v.ge(0))
        window_refresh_every: int = attrs.field(default=4, validator=v.ge(0))

    needs_hidden = False
    requires = {"drift": "kl", "cluster": "kmeans", "quant": "nvfp4", "offload": "none"}

    def bind(self, stages: dict) -> None:
        self.drift, self.clusterer = stages["drift"], stages["cluster"]
        self.quant, self.offload = stages["quant"], stages["offload"]
        self.packet_logits = bool(getattr(stages.get("commit"), "wants_packet", False))

    def init_state(self, state: DecodeState) -> PolestarRefreshState:
        return PolestarRefreshState(SideStream(state.x.device))

    def begin_block(self, local: PolestarRefreshState, state: DecodeState) -> None:
        local.window = local.store = local.build = None
        local.since = torch.zeros(state.batch_size, dtype=torch.long, device=state.x.device)
        for clusters in local.per_layer():
            clusters.clear()

    # -- plan -----------------------------------------------------------------------------------------------
    def plan(self, state: DecodeState, cache: DecodeCache, local: PolestarRefreshState) -> Plan:
        if not state.at_block_start:
            return block_plan(state)
        every = self.config.window_refresh_every
        if every and state.block_index % every == every - 1:
            bl = state.block_length
            lo = max(0, state.block_start - state.logit_shift - self.config.prefix_blocks * bl)
            hi = min(state.length, state.block_end + self.config.suffix_blocks * bl)
            return span_plan(state.batch_size, lo, hi, state.x.device, state.active,
                             state.block_start - state.logit_shift - lo)
        return block_start_plan(state)

    def hook(self, state: DecodeState, plan: Plan, cache: DecodeCache, model, local: PolestarRefreshState):
        if local.window is None:  # the block's first forward (``begin_block`` cleared the window): build
            bl = state.block_length
            local.window = make_window(state.block_start, state.block_end, state.logit_shift,
                                       self.config.prefix_blocks * bl, self.config.suffix_blocks * bl, cache)
            if local.window.size == 0:
                return None
            local.store = MemberStore(self.quant, self.offload, model.spec.n_layers, state.x.device, model.dtype)
            plan_start = state.block_start - state.logit_shift - plan.target_offset
            local.build = _BuildHook(self, state, plan_start, cache, model, local)
            return local.build
        if local.window.size == 0 or not local.centroids:
            return None
        # the block start's side-stream work must finish before this step writes K/V or reads the clusters
        local.side.join(*[t for clusters in local.per_layer() for t in clusters])
        last = state.last_commits
        tau = self.config.tau_upd
        due = state.active & ((last > tau) | (local.since + last > tau + 1))
        local.since = torch.where(due, 0, local.since + last)
        if not bool(due.any()):  # one host read per step, skipping the sparse update entirely when no row is due
            return None
        return _UpdateHook(self, state, cache, model, local, due)

    def observe(self, state: DecodeState, plan: Plan, probe, cache: DecodeCache, local: PolestarRefreshState) -> None:
        if local.build is not None:
            local.build.finish()
            local.build = None


@attrs.define
class PolestarRefreshState:
    """Per-generation state of :class:`PolestarRefresh`; everything but ``side`` is reset at each block start.

    ``side``: the side stream of the block-start work; ``window``: this block's :class:`Window` (None until the
    block's first forward); ``store``: its :class:`MemberStore`; ``build``: the block start's hook until
    ``observe`` finishes it; ``since``: ``[B]`` tokens committed since each row's last update; per layer ``l``:
    ``centroids[l] [B, K, d]``, ``labels[l] [B, Nw]`` (-1 invalid), ``counts[l] [B, K]``,
    ``centroid_pos[l] [B, K]`` and the last update's proxy distributions ``prev[l] [B, H, K, T+1]``.
    """

    side: SideStream
    window: Window | None = None
    store: MemberStore | None = None
    build: _BuildHook | None = None
    since: torch.Tensor | None = None
    centroids: list = attrs.field(factory=list)
    labels: list = attrs.field(factory=list)
    counts: list = attrs.field(factory=list)
    centroid_pos: list = attrs.field(factory=list)
    prev: list = attrs.field(factory=list)

    def per_layer(self) -> tuple[list, ...]:
        """The per-layer lists (centroids, labels, counts, centroid_pos, prev)."""
        return self.centroids, self.labels, self.counts, self.centroid_pos, self.prev


@functools.cache
def _compiled_store_layers():
    """``_store_layers`` through ``torch.compile`` (made once per process, for generations with ``compile=True``)."""
    return torch.compile(_store_layers, fullgraph=True)


class _BuildHook(LayerHook):
    """Block start: capture each layer's window inputs during the forward; cluster, store and score them after it.

    ``before_attention`` only gathers the window rows of the layer input (so the block-start forward compiles like
    any other step); :meth:`finish`, called from :meth:`PolestarRefresh.observe` after the forward, clusters them,
    stores the members and records the proxy distributions against the layer's keys -- the same keys the hook saw,
    since nothing writes layer ``l``'s K/V after its attention. That work is only consumed by the next step, so on
    CUDA it is issued on the side stream. k-means runs once per window part for all layers together; with
    ``compile=True`` the store and proxy scoring of all layers run as one compiled graph. The clusterer's random
    initial keys are drawn when the hook is made, in a fixed (layer, part) order. Clustering itself stays eager:
    compiling it (torch 2.13, CPU inductor) unrolled the k-means iterations into a ~10k-line kernel that took 20
    minutes to build on 2 busy cores and then failed at run time in the stable sort of the reseed step
    (``UnboundLocalError`` in the generated code)."""

    def __init__(self, sel: PolestarRefresh, state, plan_start: int, cache, model, local: PolestarRefreshState):
        self.sel, self.state, self.cache, self.model, self.local = sel, state, cache, model, local
        window: Window = local.window
        self.slots = (window.positions - plan_start)[None, :].expand(state.batch_size, -1)
        self.evals = torch.zeros(state.batch_size, dtype=torch.long, device=state.x.device)
        n_pre = window.n_prefix
        k_pre, k_post = split_clusters(sel.config.n_clusters, n_pre, window.size - n_pre)
        # (lo, hi, k) column range and cluster count of the prefix and suffix parts; empty parts dropped
        self.parts = [(lo, hi, k) for lo, hi, k in ((0, n_pre, k_pre), (n_pre, window.size, k_post)) if k > 0]
        # per part, keys [L * B, n] for all layers, drawn layer by layer (the order of the per-layer clustering)
        per_part: list[list] = [[] for _ in self.parts]
        if sel.clusterer.needs_keys:
            for _ in range(model.spec.n_layers):
                for drawn, (lo, hi, _k) in zip(per_part, self.parts):
                    # one key row shared by the batch: a row's keys do not depend on the batch size
                    keys = init_keys(1, hi - lo, state.generator, state.x.device)
                    drawn.append(keys.expand(state.batch_size, -1))
        self.keys = [torch.cat(drawn) if drawn else None for drawn in per_part]
        self.inputs: list = [None] * model.spec.n_layers

    def before_attention(self, layer: int, h: torch.Tensor, index: torch.Tensor) -> None:
        self.inputs[layer] = h.gather(1, self.slots[..., None].expand(-1, -1, h.shape[-1]))

    def finish(self) -> None:
        """Cluster every layer's window inputs in one batched call per window part (groups = layers x rows), then
        store and score each layer. Consumed only by the next step: issued on the side stream on CUDA."""
        with self.local.side.run(*self.inputs, *self.cache.k):
            clusters = self._cluster_layers(torch.stack(self.inputs))
            store = _compiled_store_layers() if self.state.compile else _store_layers
            store(self, self.inputs, *clusters)

    def _cluster_layers(self, hw: torch.Tensor):
        """``hw [L, B, Nw, d]`` → ``centroids [L, B, K, d]``, ``labels [L, B, Nw]`` (window-wide cluster ids, -1
        invalid), ``counts [L, B, K]``; the prefix and suffix parts are clustered separately."""
        L, B, _, d = hw.shape
        valid = self.local.window.valid
        out, offset = [], 0
        for (lo, hi, k), keys in zip(self.parts, self.keys):
            x = hw[:, :, lo:hi].reshape(L * B, hi - lo, d).float()
            with scope("cluster"):
                c, lab, cnt = self.sel.clusterer.cluster(x, k, valid[:, lo:hi].repeat(L, 1), None, keys)
            out.append((c.view(L, B, k, d), torch.where(lab >= 0, lab + offset, -1).view(L, B, -1), cnt.view(L, B, k)))
            offset += k
        return (torch.cat([p[0] for p in out], dim=2).to(hw.dtype), torch.cat([p[1] for p in out], dim=2),
                torch.cat([p[2] for p in out], dim=2))

    def _store_layer(self, layer: int, hw: torch.Tensor, centroids, labels, counts) -> None:
        local = self.local
        window = local.window
        k_total = centroids.shape[1]
        onehot = torch.nn.functional.one_hot(labels.clamp_min(0), k_total).float() * (labels >= 0)[..., None].float()
        pos = self.cache.positions.index_select(1, window.positions).float()
        centroid_pos = (torch.einsum("bnk,bn->bk", onehot, pos) / counts.clamp_min(1)).round().long()
        anchor = centroids.gather(1, labels.clamp_min(0)[..., None].expand(-1, -1, hw.shape[-1]))
        with scope("store"):
            local.store.put(layer, hw, anchor)
        local.centroids.append(centroids)
        local.labels.append(labels)
        local.counts.append(counts)
        local.centroid_pos.append(centroid_pos)
        with scope("proxy_attention"):
            local.prev.append(self.model.proxy_attention(layer, centroids, self.cache, centroid_pos))


def _store_layers(hook: _BuildHook, inputs: list, centroids, labels, counts) -> None:
    """Store and score every layer's window (``centroids [L, B, K, d]``, ``labels [L, B, Nw]``, ``counts [L, B, K]``);
    a free function so one ``torch.compile`` of it serves every block start."""
    for layer, hw in enumerate(inputs):
        hook._store_layer(layer, hw, centroids[layer], labels[layer], counts[layer])


class _UpdateHook(LayerHook):
    """Sparse update step: packet K/V at each layer, proxy drift, top-k clusters, member recompute."""

    def __init__(self, sel: PolestarRefresh, state, cache, model, local: PolestarRefreshState, due: torch.Tensor):
        self.sel, self.state, self.cache, self.model, self.local, self.due = sel, state, cache, model, local, due
        window: Window = local.window
        B = state.batch_size
        self.window = window
        self.index = window.positions[None, :].expand(B, -1)
        self.rope_pos = cache.positions.index_select(1, window.positions)
        self.packet_h = None
        self.packet_valid = None
        self.evals = torch.zeros(B, dtype=torch.long, device=state.x.device)

    def before_attention(self, layer: int, h: torch.Tensor, index: torch.Tensor) -> None:
        model, cache, local, sel = self.model, self.cache, self.local, self.sel
        trash = cache.trash
        if self.packet_h is not None:  # the previous layer's packet: new inputs here, re-project their K/V
            k, v = model.layer_kv(layer, self.packet_h, self.rope_pos)
            model.write_kv(cache, layer, torch.where(self.packet_valid, self.index, trash), k, v)
            self.evals += self.packet_valid.sum(-1)
            with scope("store"):
                old = local.store.update(layer, self.packet_valid, self.packet_h)
            labels = local.labels[layer]
            k_clusters = local.centroids[layer].shape[1]
            onehot = torch.nn.functional.one_hot(labels.clamp_min(0), k_clusters).to(old.dtype)
            onehot = onehot * (self.packet_valid & (labels >= 0))[..., None].to(old.dtype)
            delta = torch.einsum("bnk,bnd->bkd", onehot, self.packet_h.to(old.dtype) - old)
            counts = local.counts[layer].clamp_min(1)[..., None].to(old.dtype)
            local.centroids[layer] = local.centroids[layer] + delta / counts
        with scope("proxy_attention"):
            cur = model.proxy_attention(layer, local.centroids[layer], cache, local.centroid_pos[layer])
        with scope("drift"):
            drift = sel.drift.score(cur, local.prev[layer])
        local.prev[layer] = torch.where(self.due[:, None, None, None], cur, local.prev[layer])
        n_layers = model.spec.n_layers
        k = sel.config.topk_last if layer == n_layers - 1 else sel.config.topk
        top = top_clusters(drift, local.counts[layer], k)
        labels = local.labels[layer]
        members = self.window.valid & (labels >= 0) & top.gather(1, labels.clamp_min(0)) & self.due[:, None]
        if layer == 0:
            inputs = model.embed(self.state.x.index_select(1, self.window.positions))
        else:
            with scope("store"):
                inputs = local.store.get(layer)
        with scope("packet"):
            out, _ = model.layer_rows(layer, inputs, self.rope_pos, cache)
        self.evals += members.sum(-1)
        self.packet_h, self.packet_valid = out, members
        if layer == n_layers - 1 and sel.packet_logits:
            self.packet = UpdatePacket(self.window.positions, members, model.head(model.final_norm(out)))
