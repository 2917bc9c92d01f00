"""Polestar-Cache's layer hooks: the block start's clustering and stores, and the sparse update's member choice.

:class:`~polestar.policies.refresh_polestar.PolestarRefresh` (config, phase, plan, buffers) makes one hook per
step: a :class:`PolestarBuildHook` at a block start, and at an update step a
:class:`~polestar.policies.sparse_update.SparseUpdate` driven by :class:`PolestarMembers`. Neither holds the model:
both run model operations through the :class:`~polestar.models.layer_ops.LayerOps` view the selector gives them.

One layer of an update step, as the backbone's pass (``DiffusionLM.layer_step``) calls down (nothing below calls
back into the layer step):

1. ``SparseUpdate.extra_rows`` → :meth:`PolestarMembers.extra_rows`: the previous layer's packet (its rows' K/V
   re-projected) and the layer's centroids (query-only rows) join the block's rows in the q/k/v matmuls;
2. ``SparseUpdate.members`` → :meth:`PolestarMembers.select`: the centroids' attention over the layer's keys
   (:func:`proxy_probs` → ``LayerOps.attention_probs``), its drift, the most drifting clusters and their members
   gathered to capacity (one operation, :func:`~polestar.kernels.member_choice.cluster_members`), with their stored
   queries;
3. the block's rows and the members go through attention, o and the MLP; ``SparseUpdate.after_layer`` keeps the
   members' outputs as the next layer's packet.

Shapes: window ``Nw`` columns; centroids ``[B, K, d]``; proxy distributions ``[B, H, K, T + 1]``; drift ``[B, K]``;
member buffer ``[B, M_l]`` per layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from polestar.kernels.member_choice import centroid_shift, cluster_members, cluster_ranks, top_ranked
from polestar.kernels.member_rows import member_rows, packet_write
from polestar.models.hooks import ExtraRows, LayerQKV
from polestar.models.layer_ops import LayerOps
from polestar.models.layers import RopeTable
from polestar.models.plan import DecodeCache
from polestar.profiling import declare_scopes, scope
from polestar.stages import LayerHook

from .polestar_trace import CLUSTERS
from .sparse_update import MemberStrategy, Packet, Selection

if TYPE_CHECKING:
    from .polestar_state import PolestarRefreshState, PolestarSelection, WindowBuffers

# what ``polestar bench --profile`` reports of these hooks, as parts of the forward pass
declare_scopes("proxy_attention", "drift", "cluster", "store")


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


def top_clusters(drift: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` most drifting non-empty clusters of each row: ``drift, counts [B, K]`` → bool ``[B, K]``
    (:func:`~polestar.kernels.member_choice.cluster_ranks`). Ties go to the lower cluster index, so a larger ``k``
    always selects a superset."""
    return top_ranked(cluster_ranks(drift, counts), counts, k)


def proxy_probs(ops: LayerOps, cache: DecodeCache, layer: int, key_rope: tuple | None, q: torch.Tensor,
                meter) -> torch.Tensor:
    """Centroid queries ``q [B, H, R, hd]`` scored against ``layer``'s keys → fp32 ``[B, H, R, T+1]``
    (:meth:`~polestar.models.layer_ops.LayerOps.attention_probs`). The keys are the cached (rotated) ones when
    ``key_rope`` is None (``proxy_rope``), else the keys with their rotary embedding undone (``key_rope``: cos and
    -sin ``[B, 1, T + 1, hd]`` of the cache positions, the inverse rotation), as the authors' released code scores
    un-rotated centroid queries against un-rotated keys. The rotation is part of the one proxy-attention operation;
    ``meter`` counts it as one more pass over the keys, as the torch reference (and the authors' code) runs it (the
    CUDA kernel rotates the keys as it loads them)."""
    keys = cache.k[layer]
    if key_rope is not None and meter is not None:
        meter.attention(keys, None)  # the rotation undone: counted as a pass of its own, as the authors' code runs it
    return ops.attention_probs(q, keys, cache.key_valid, meter, key_rope)


class ClusterDrift(NamedTuple):
    """Polestar-Cache's clusters at one layer of one sparse-update step: ``drift [B, K]`` each cluster's proxy
    drift against the previous update, ``counts [B, K]`` members per cluster, ``chosen [B, K]`` bool the clusters
    whose members the update recomputed (the top drifting ones, in rows due for the update), ``positions [Nw]``
    long the window's cache positions and ``labels [B, Nw]`` long each window position's cluster (-1 invalid)."""

    drift: torch.Tensor
    counts: torch.Tensor
    chosen: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor


class PolestarBuildHook(LayerHook):
    """Block start: cluster the window's inputs at every layer, store them (residuals to their centroid) and their
    queries, and record the centroids' proxy distributions.

    The window rows' queries go to the query store at each layer (:meth:`members`). Clustering and the proxy
    distributions then take one of two routes (:meth:`PolestarRefresh.clusters_together`):

    * each layer inside its pass: the layer's window is clustered in :meth:`extra_rows`, its centroids ride along
      the layer's q pass as query-only rows, and after the layer's K/V writes their attention over the keys
      becomes ``prev``;
    * all layers together: each layer's window inputs are kept, and once the last layer has written its K/V, one
      clusterer call clusters every layer's window (the layers' parts stacked as groups ``[L * P * B, n]``; in
      groups of layers where keeping every layer's inputs would take too much memory,
      :meth:`PolestarRefresh.layers_per_cluster_call`), then each layer's centroid queries take a q pass of their
      own (:meth:`~polestar.models.layer_ops.LayerOps.project_queries`) and their attention becomes ``prev``.

    The clusterer's random initial keys are drawn at the block start, before the step
    (:meth:`PolestarRefresh.allocate`), so the whole block start runs inside the compiled step.
    """

    def __init__(self, sel: PolestarSelection, state, plan_start, cache, ops: LayerOps, local: PolestarRefreshState):
        self.sel, self.state, self.cache, self.ops, self.local = sel, state, cache, ops, local
        self.buffers: WindowBuffers = local.current
        self.window = window = sel.window(state, cache)
        sel.keep_window(window, self.buffers, cache)
        B = state.batch_size
        self.slots = (window.positions - plan_start)[None, :].expand(B, -1)
        spec = ops.spec
        self.q_slots = self.slots[:, None, :, None].expand(-1, spec.n_heads, -1, spec.head_dim)
        self.evals = torch.zeros(B, dtype=torch.long, device=state.x.device)
        self.parts = self.buffers.parts
        self.rope_pos = cache.positions.index_select(1, window.positions)
        self.together = sel.clusters_together(state.x.device)
        #: layers clustered per clusterer call when together (all of them unless that would hold too many inputs)
        self.group = sel.layers_per_cluster_call(B, window.size, ops.spec.d_model, ops.spec.n_layers)
        #: the window inputs kept when clustering together, one ``[1, B, Nw, d]`` per layer
        self.inputs: list[torch.Tensor] = []

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

    def _record(self, first: int, hw: torch.Tensor, keys: torch.Tensor | None):
        """Cluster layers ``first, first + 1, ...`` (window inputs ``hw [n, B, Nw, d]``), store their windows and
        write their clusters into the window's buffers; → the centroids ``[n, B, K, d]``, their RoPE positions
        ``[n, B, K]`` and each window row's anchor ``[n, B, Nw, d]`` (its centroid, for a lossy store; else None)."""
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
        span = slice(first, first + hw.shape[0])  # the layers' rows of each stack (see WindowBuffers): one copy each
        stacks = buf.stacks
        for kept, new in ((stacks.centroids, centroids), (stacks.labels, labels), (stacks.counts, counts),
                          (stacks.centroid_pos, centroid_pos)):
            kept[span].copy_(new)
        return centroids, centroid_pos, anchor

    def extra_rows(self, layer: int, h: torch.Tensor, meter) -> ExtraRows | None:
        hw = h.gather(1, self.slots[..., None].expand(-1, -1, h.shape[-1]))
        if self.together:
            self.inputs.append(hw[None])
            return None
        keys = None if self.buffers.keys is None else self.buffers.keys[layer : layer + 1]
        centroids, centroid_pos, _anchor = self._record(layer, hw[None], keys)
        if not self.sel.refreshes_layer(layer, self.ops.spec.n_layers):
            return None
        return ExtraRows(centroids[0], centroid_pos[0], torch.full_like(centroid_pos[0], self.cache.trash))

    def members(self, layer: int, qkv: LayerQKV) -> None:
        local, C = self.local, qkv.n_plan
        B, H, _, hd = qkv.q.shape
        q_window = qkv.q.gather(2, self.q_slots)  # the window's slots lie among the plan's C rows
        with local.side.run(q_window), scope("store"):
            self.buffers.qstore.write_all(layer, q_window.transpose(1, 2).reshape(B, -1, H * hd))
        if not self.together:
            if not self.sel.refreshes_layer(layer, self.ops.spec.n_layers):
                return None
            with scope("proxy_attention"):
                self.buffers.prev[layer].copy_(proxy_probs(self.ops, self.cache, layer, local.key_rope,
                                                           qkv.q[:, :, C:], qkv.meter))
        elif self._kept() == self.group or layer == self.ops.spec.n_layers - 1:  # their K/V are written
            self._cluster_kept(layer, qkv.meter)
        return None

    def _kept(self) -> int:
        """Layers whose window inputs are kept for the next clusterer call."""
        return sum(t.shape[0] for t in self.inputs)

    def _cluster_kept(self, last: int, meter) -> None:
        """Cluster the kept window inputs of layers ``.. last`` in one clusterer call (their windows stored), then
        score each layer's centroid queries (a pass over the layer's q weight of their own) against its keys."""
        local, ops = self.local, self.ops
        first = last + 1 - self._kept()
        keys = None if self.buffers.keys is None else self.buffers.keys[first : last + 1]
        hw = self.inputs[0] if len(self.inputs) == 1 else torch.cat(self.inputs)
        centroids, centroid_pos, _anchor = self._record(first, hw, keys)
        self.inputs.clear()
        n_layers = ops.spec.n_layers
        for layer in range(first, last + 1):
            if not self.sel.refreshes_layer(layer, n_layers):
                continue
            i = layer - first
            positions = centroid_pos[i] if self.sel.config.proxy_rope else None
            q = ops.project_queries(layer, centroids[i], positions, meter)
            with scope("proxy_attention"):
                self.buffers.prev[layer].copy_(proxy_probs(ops, self.cache, layer, local.key_rope, q, meter))


class PolestarMembers(MemberStrategy):
    """Polestar's member choice at a sparse-update step (see the module docstring): query-only rows are the layer's
    centroids; members are the window rows of the top drifting clusters, queries from the query store.
    ``local.due [B]``: rows that update at this step (the others choose no member)."""

    wants_old = True

    def __init__(self, sel: PolestarSelection, state, cache, ops: LayerOps, local: PolestarRefreshState):
        self.sel, self.cache, self.ops, self.local, self.due = sel, cache, ops, local, local.due
        self.buffers = buf = local.current
        self.window = window = sel.kept_window(state, buf)
        self.store = buf.store
        #: both stores hold their rows as plain tensors: the packet write and the member rows are one operation each
        self.plain = buf.store.plain and buf.qstore.plain
        self.trash = window.size
        self.row_slot = buf.row_slot
        self.capacity = buf.capacity
        self.proxy_slots = torch.full_like(buf.centroid_pos[0], cache.trash)  # centroids only query: the trash slot
        L, B, K = buf.stacks.centroid_pos.shape
        self.n_centroids = K
        # with proxy_rope, every layer's centroid rotary factors in one lookup per step ([B, L * K, 2, hd], layer l's
        # K rows a view); without, centroids are un-rotated queries: they rotate by the trash slot's position, 0
        self.centroid_rope = (ops.rope_of(cache, buf.stacks.centroid_pos.transpose(0, 1).reshape(B, L * K))
                              if sel.config.proxy_rope else None)
        self.wants_head = sel.packet_logits
        self.x = state.x
        self.n_kv = 0
        self.detail = state.detail

    def slots(self, rows: torch.Tensor) -> torch.Tensor:
        return self.row_slot[rows]

    def on_write(self, layer: int, packet: Packet, old: torch.Tensor) -> None:
        """Shift each centroid by the mean change of its members: ``delta [B, K, d]``."""
        buf = self.buffers
        centroids = buf.centroids[layer]
        centroids.add_(centroid_shift(buf.labels[layer], buf.counts[layer], packet.rows, packet.valid, packet.out,
                                      old, centroids.dtype))

    def write_packet(self, layer: int, packet: Packet) -> None:
        """With plain stores, the packet's store write, its rows' previous values and the centroid shift are one
        operation (:func:`~polestar.kernels.member_rows.packet_write`); else as every strategy does it."""
        if not self.plain:
            return super().write_packet(layer, packet)
        buf = self.buffers
        with scope("store"):
            packet_write(self.store.rows(layer), buf.centroids[layer], buf.labels[layer], buf.counts[layer],
                         packet.rows, packet.valid, packet.out)

    def extra_rows(self, layer: int, h: torch.Tensor, packet: Packet | None, kv: ExtraRows | None,
                   meter) -> ExtraRows | tuple[ExtraRows, ...] | None:
        """The packet's K/V rows (``kv``) and, where the layer refreshes, its centroids as query-only rows (their
        rotary factors from the step's one lookup with ``proxy_rope``, else those of the trash slot's position 0, the
        identity); the layer pass joins them with its own rows."""
        buf = self.buffers
        self.n_kv = 0 if kv is None else kv.inputs.shape[1]
        if not self.sel.refreshes_layer(layer, self.ops.spec.n_layers):
            return kv
        K, table = self.n_centroids, self.centroid_rope
        rope = None if table is None else RopeTable(table.factors[:, layer * K : (layer + 1) * K])
        proxies = ExtraRows(buf.centroids[layer], None, self.proxy_slots, rope)
        return proxies if kv is None else (kv, proxies)

    def select(self, layer: int, qkv: LayerQKV, packet: Packet | None) -> Selection | None:
        local, buf, sel, ops = self.local, self.buffers, self.sel, self.ops
        if not sel.refreshes_layer(layer, ops.spec.n_layers):
            return None
        B, H, _, hd = qkv.q.shape
        C = qkv.n_plan
        q_extra = qkv.q[:, :, C:]
        # the packet rows' new queries, from this layer's pass, replace the stored ones (before the members' are read)
        q_packet = None if packet is None else q_extra[:, :, : self.n_kv]
        joined = self.plain and layer > 0  # layer 0's member inputs are token embeddings, not stored rows
        if q_packet is not None and not joined:
            with scope("store"):
                buf.qstore.write(layer, packet.rows, None, q_packet.transpose(1, 2).reshape(B, -1, H * hd))
        with scope("proxy_attention"):
            cur = proxy_probs(ops, self.cache, layer, local.key_rope, q_extra[:, :, self.n_kv:], qkv.meter)
        with scope("drift"):  # the rows due keep this step's distributions for the next update (in place)
            drift = sel.drift.score_keep(cur, buf.prev[layer], self.due)
        k = sel.config.topk_last if layer == ops.spec.n_layers - 1 else sel.config.topk
        counts, labels = buf.counts[layer], buf.labels[layer]
        rows, valid, chosen = cluster_members(drift, counts, labels, self.window.valid, self.due, k,
                                              self.capacity[layer], self.trash)
        if self.detail is not None:  # an observer records: every cluster's drift and the chosen ones
            self.detail.entry(CLUSTERS)[layer] = ClusterDrift(drift, counts, chosen, self.window.positions, labels)
        if joined:  # the packet's queries stored, the members' queries and inputs joined to the plan's: one operation
            with scope("store"):
                q_att, resid, slots = member_rows(buf.qstore.rows(layer), self.store.rows(layer), qkv.q[:, :, :C],
                                                  qkv.h, rows, self.row_slot, None if packet is None else packet.rows,
                                                  q_packet)
            return Selection(rows, valid, q_att, resid, slots, joined=True)
        with scope("store"):
            q = buf.qstore.read(layer, rows).view(B, -1, H, hd).transpose(1, 2)
        inputs = None
        if layer == 0:  # layer 0's input is the token embedding: read it, not the store
            tokens = self.x.gather(1, self.slots(rows).clamp(max=self.x.shape[1] - 1))  # trash slots: any token
            inputs = ops.embed(tokens, qkv.meter)
        return Selection(rows, valid, q, inputs)
