"""Polestar-Cache's sparse-update layer as one region: a whole-step compile traces it once for every layer.

The update step's hook path (:class:`~polestar.policies.sparse_update.SparseUpdate` driving
:class:`~polestar.policies.polestar_hooks.PolestarMembers`) runs a layer as calls down from the backbone's layer
pass, writing the stores, centroids, proxy distributions and K/V in place between them. Traced inside a compiled
step, that code unrolls into the step's graph once per layer. :class:`UpdateLayer` is the same layer written as one
pure function of explicit tensors: the previous layer's packet, the layer's buffers and weights in; its plan rows'
and members' outputs, the members it chose and every buffer it rewrote out (the caller copies those back). Every
per-layer difference is an argument tensor and every constant (head counts, the top-k, the member capacity) is the
same at every middle layer, so a whole-step compile compiles it once (a nested compile region) and calls it at
layers ``1 .. L - 2``. Layer 0 (members' inputs from the embedding, no packet) and the last layer (``topk_last``,
the packet's logits) keep the hook path: a fixed number of layers, whatever the depth.

The order of the work is the hook path's, operation for operation, so both give the same tokens and counters:

1. the packet's rows are written into the window store (residuals to their anchors for a lossy quantizer) and each
   centroid shifts by its members' mean change;
2. [plan rows | packet rows | centroids] go through the layer's q/k/v (one matmul); plan and packet K/V are
   written at their slots, the centroids' at the trash slot;
3. the packet rows' new queries go to the query store; the centroids' attention over the layer's keys (proxy
   attention) is compared with the previous update's (``drift`` stage), kept as the new one in due rows, and the
   most drifting clusters' members are gathered to capacity;
4. [plan rows | members] attend over the layer's cache, then o and the MLP; the members' outputs are the next
   layer's packet.

Shapes: plan rows ``h [B, C, d]``; packet ``[B, M', …]``; window ``Nw``; centroids ``[B, K, d]``; proxy
distributions ``[B, H, K, T + 1]``; members ``[B, M]``.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch

from polestar.kernels.member_choice import centroid_shift, cluster_members
from polestar.kernels.proxy_attention import proxy_attention
from polestar.models import layer_regions, layer_scan
from polestar.models.layer_regions import attend_mlp, qkv_rows, region
from polestar.models.layers import RopeTable
from polestar.models.spec import ModelSpec

from .row_store import RowStore

if TYPE_CHECKING:
    from polestar.models.cost import CostMeter


def _region_of(fn, name: str):
    """A nested compile region running ``fn`` (a bound method, a partial: a region wraps plain functions only) under
    a code object of its own named ``name``: dynamo keeps one reuse entry per code object, so two regions sharing
    one wrapper's code would each be traced again at every call."""
    namespace: dict = {"fn": fn}
    exec(f"def {name}(*args):\n    return fn(*args)\n", namespace)  # noqa: S102 - a fixed template, no input
    return region(namespace[name])


class UpdateLayer:
    """One middle layer of a Polestar sparse-update step as a nested compile region (see the module docstring).

    Made once per window size with its buffers (outside any trace: a region cannot be made while dynamo traces),
    for the selector's stages and the window's stores. :meth:`__call__` takes the layer's tensors, runs the region
    and copies what it rewrote back into the layer's buffers; it returns the plan rows' outputs ``[B, C, d]``, the
    members' outputs ``[B, M, d]`` and the members ``rows, valid [B, M]``.

    Made for the selector's ``drift`` stage and ``topk`` option, a middle layer's member ``capacity`` and the window's
    stores (``window`` columns). ``usable(drift, store, qstore)``: whether the region route applies (the package's
    own drift stage, stores whose rows stay on the device); otherwise the hook path runs every layer.
    """

    def __init__(self, drift, topk: int, capacity: int, store: RowStore, qstore: RowStore, spec: ModelSpec,
                 window: int):
        self.drift, self.store, self.qstore, self.spec = drift, store, qstore, spec
        self.topk, self.capacity = topk, capacity
        self.trash = window
        self.scale = 1.0 / math.sqrt(spec.head_dim)
        self.n_store_leaves = len(store.stored[0])
        #: the region of an anchored (lossy) window store, and of a store of the values themselves
        self._regions = {anchored: _region_of(functools.partial(self._layer, anchored),
                                              f"polestar_update_layer_{'anchored' if anchored else 'plain'}")
                         for anchored in (False, True)}

    @staticmethod
    def usable(drift, store: RowStore, qstore: RowStore) -> bool:
        return type(drift).__module__.startswith("polestar.") and store.regional and qstore.regional

    def _layer(self, anchored: bool, h, index, cos, sin, pos_cos, pos_sin, positions, key_valid, keys, values,
               attn_norm, attn_norm_bias, qkv, qkv_bias, o, o_bias, mlp_norm, mlp_norm_bias, gate_up, gate_up_bias,
               down, down_bias, p_rows, p_valid, p_out, centroids, labels, counts, centroid_pos, prev, window_valid,
               row_slot, proxy_slots, due, key_cos, key_sin, *leaves):
        """The layer (module docstring, steps 1–4) → ``(out [B, C, d], members' out [B, M, d], rows, valid [B, M],
        keys, values, centroids, prev, *store leaves, *query-store leaves)``, every buffer a new tensor."""
        spec, store, qstore = self.spec, self.store, self.qstore
        H, Hkv, hd, eps = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.norm_eps
        anchor = leaves[0] if anchored else None
        leaves = leaves[1:] if anchored else leaves
        stored, qstored = leaves[: self.n_store_leaves], leaves[self.n_store_leaves:]
        B, C, _ = h.shape
        n_packet = p_out.shape[1]
        # 1. the packet into the store; centroids shift by their members' change
        old = store.read_leaves(stored, anchor, p_rows)
        stored = store.written(stored, anchor, p_rows, p_valid, p_out)
        centroids = centroids + centroid_shift(labels, counts, p_rows, p_valid, p_out, old, centroids.dtype)
        # 2. [plan | packet | centroids] through q/k/v, K/V written
        slots = row_slot[p_rows]
        extra = torch.cat([p_out, centroids.to(p_out.dtype)], dim=1)
        extra_pos = torch.cat([positions.gather(1, slots), centroid_pos], dim=1)
        rope = RopeTable(cos, sin).cat(RopeTable(pos_cos, pos_sin).rows(extra_pos))
        kv_index = torch.cat([index, torch.cat([slots, proxy_slots], dim=1)], dim=1)
        qk, proj = qkv_rows(torch.cat([h, extra.to(h.dtype)], dim=1), attn_norm, attn_norm_bias, qkv, qkv_bias,
                            rope.cos, rope.sin, eps, H, Hkv)
        q = qk[:, :, :H].transpose(1, 2)
        slot = kv_index[:, None, :, None].expand(-1, Hkv, -1, hd)
        keys = keys.scatter(2, slot, qk[:, :, H:].transpose(1, 2))
        values = values.scatter(2, slot, proj[:, :, H + Hkv:].transpose(1, 2))
        # 3. the packet's queries stored; proxy drift; members chosen
        q_extra = q[:, :, C:]
        qstored = qstore.written(qstored, None, p_rows, p_valid,
                                 q_extra[:, :, :n_packet].transpose(1, 2).reshape(B, -1, H * hd))
        cur = proxy_attention(q_extra[:, :, n_packet:], keys, key_valid, self.scale, key_cos=key_cos, key_sin=key_sin)
        drift = self.drift.score(cur, prev)
        prev = torch.where(due[:, None, None, None], cur, prev)
        rows, valid, _chosen = cluster_members(drift, counts, labels, window_valid, due, self.topk, self.capacity,
                                               self.trash)
        q_members = qstore.read_leaves(qstored, None, rows).view(B, -1, H, hd).transpose(1, 2)
        inputs = store.read_leaves(stored, anchor, rows)
        # 4. [plan | members] through attention, o and the MLP
        out = attend_mlp(torch.cat([q[:, :, :C], q_members.to(q.dtype)], dim=2),
                         torch.cat([h, inputs.to(h.dtype)], dim=1), keys, values, key_valid, o, o_bias, mlp_norm,
                         mlp_norm_bias, gate_up, gate_up_bias, down, down_bias, eps)
        # the plan rows' and members' outputs as tensors of their own: the next layer takes both as arguments, and a
        # region refuses arguments that alias each other
        return (out[:, :C].clone(), out[:, C:].clone(), rows, valid, keys, values, centroids, prev, *stored,
                *qstored)

    def __call__(self, layer: int, h, index, rope: RopeTable, cache, weights, packet, buffers, window_valid,
                 row_slot, proxy_slots, due, key_rope, meter: CostMeter, layer_bytes):
        """Run layer ``layer`` as the region and write its buffers back (see the class docstring); ``meter``
        counts what the hook path counts: the layer's two weight passes, its rows (plan and members through the
        MLP; packet rows and centroids through q/k/v only), one attention read of its K/V and the proxy
        attention's key reads (two with the keys' rotation undone)."""
        store, qstore = self.store, self.qstore
        anchored = store.anchored[layer]
        stored, qstored = store.stored[layer], qstore.stored[layer]
        keys, values = cache.k[layer], cache.v[layer]
        centroids, prev = buffers.centroids[layer], buffers.prev[layer]
        key_cos, key_sin = key_rope if key_rope is not None else (None, None)
        table = cache.position_rope
        anchor = (store.anchor[layer],) if anchored else ()
        # layer 0's hook path gives ``h`` and the packet as views of one output: the packet copied (a region refuses
        # aliased arguments) and ``h`` made contiguous (as the region's own outputs are, so one trace serves all)
        out, members_out, rows, valid, *new = self._regions[anchored](
            h.contiguous(), index, rope.cos, rope.sin, table.cos, table.sin, cache.positions, cache.key_valid, keys,
            values, *weights, packet.rows, packet.valid, packet.out.clone(), centroids, buffers.labels[layer],
            buffers.counts[layer], buffers.centroid_pos[layer], prev, window_valid, row_slot, proxy_slots, due, key_cos,
            key_sin, *anchor, *stored, *qstored)
        for kept, fresh in zip((keys, values, centroids, prev, *stored, *qstored), new):
            kept.copy_(fresh)
        B, C = index.shape
        key_bytes = cache.layer_kv_bytes
        meter.add(layer_bytes.qkv_pass + layer_bytes.out_mlp_pass,
                  key_bytes * (3 if key_rope is None else 4), B * (C + rows.shape[1]),
                  B * (packet.rows.shape[1] + centroids.shape[1]))
        return out, members_out, rows, valid


    def run(self, first: int, end: int, h, index, rope: RopeTable, cache, weights, packet, buffers, window_valid,
            row_slot, proxy_slots, due, key_rope, meter: CostMeter, pass_bytes: int):
        """Layers ``first .. end - 1`` (middle layers) as one scan of :meth:`_layer` over the layer-stacked tensors
        (:mod:`~polestar.models.layer_scan`): the packet and the plan rows carried from layer to layer, each layer's
        buffers rewritten as rows of new stacks and copied back. ``weights``: the layers' stacked tensors
        (:meth:`~polestar.models.layer_ops.LayerOps.stacked_weights`); ``pass_bytes``: their weight bytes, one pass
        each (:meth:`~polestar.models.layer_ops.LayerOps.pass_bytes`), counted as :meth:`__call__` counts a layer. →
        the plan rows' outputs ``[B, C, d]``, the last layer's members' outputs ``[B, M, d]``, its members ``rows,
        valid [B, M]`` and every layer's ``valid`` side by side ``[B, n · M]``; or None where the layers' stores are
        not stacked or not all anchored alike, or this torch has no usable scan (then each layer runs as
        :meth:`__call__`)."""
        store, qstore, stacks = self.store, self.qstore, buffers.stacks
        anchored = store.anchored[first]
        if (not layer_scan.available() or store.stacked is None or qstore.stacked is None or stacks is None
                or any(store.anchored[layer] != anchored for layer in range(first, end))):
            return None
        span = slice(first, end)
        given, present = layer_scan.split_weights(weights)
        anchor = (store.anchor_stack[span],) if anchored else ()
        key_cos, key_sin = key_rope if key_rope is not None else (None, None)
        table = cache.position_rope
        n_given, n_anchor = len(given), len(anchor)
        written = (cache.k_stack[span], cache.v_stack[span], stacks.centroids[span], stacks.prev[span],
                   *(t[span] for t in store.stacked), *(t[span] for t in qstore.stacked))

        def layer(carry, xs):
            rows_in, p_rows, p_valid, p_out = carry
            keys, values, centroids, prev, *rest = xs[: len(written)]
            labels, counts, centroid_pos, *more = xs[len(written):]
            stored, qstored = rest[: len(store.stacked)], rest[len(store.stacked):]
            layer_weights = layer_scan.join_weights(more[:n_given], present)
            out, members_out, rows, valid, *new = self._layer(
                anchored, rows_in, index, rope.cos, rope.sin, table.cos, table.sin, cache.positions, cache.key_valid,
                keys, values, *layer_weights, p_rows, p_valid, p_out, centroids, labels, counts, centroid_pos, prev,
                window_valid, row_slot, proxy_slots, due, key_cos, key_sin, *more[n_given: n_given + n_anchor],
                *stored, *qstored)
            return (out, rows, valid, members_out), (valid.clone(), *new)

        xs = (*written, stacks.labels[span], stacks.counts[span], stacks.centroid_pos[span], *given, *anchor)
        carry = (h.contiguous(), packet.rows, packet.valid, packet.out.clone())
        (out, rows, valid, members_out), (valids, *new) = layer_scan.scan(layer, carry, xs)
        for kept, fresh in zip(written, new):
            kept.copy_(fresh)
        B, C = index.shape
        n = end - first
        meter.add(pass_bytes, n * cache.layer_kv_bytes * (3 if key_rope is None else 4), n * B * (C + rows.shape[1]),
                  n * B * (packet.rows.shape[1] + stacks.centroids.shape[2]))
        return out, members_out, rows, valid, valids.transpose(0, 1).reshape(B, -1)


class BuildLayer:
    """A Polestar block start's layers as two nested compile regions, for the route that clusters every layer
    together (:meth:`~polestar.policies.refresh_polestar.PolestarRefresh.clusters_together`), in a whole-step
    compile: the work of :class:`~polestar.policies.polestar_hooks.PolestarBuildHook` written as pure functions of
    explicit tensors, each traced once for every layer.

    * :meth:`layer`: the layer's pass over the plan rows (q/k/v, K/V written, attention, o, MLP) with the window
      rows' queries stored (the query store's leaves rewritten) and the window rows' inputs ``[B, Nw, d]`` returned
      for the clusterer;
    * :meth:`finish`, once the clusterer has run: the window's inputs stored (residuals to their centroids for a
      lossy quantizer) and the centroids' queries (a pass over the layer's q weight of their own, un-rotated) scored
      against the layer's keys → the proxy distributions the first update compares with.

    Both copy what they rewrote back into the layer's buffers and count on the pass's meter what the hook path
    counts. Made once per window size with its buffers (``usable`` as :class:`UpdateLayer`).
    """

    def __init__(self, store: RowStore, qstore: RowStore, spec: ModelSpec):
        self.store, self.qstore, self.spec = store, qstore, spec
        self.scale = 1.0 / math.sqrt(spec.head_dim)
        self.n_store_leaves = len(store.stored[0])
        self._layer = _region_of(self._layer_function, "polestar_build_layer")
        #: the block start's second region, for an anchored (lossy) window store and for a store of the values
        self._finish = {anchored: _region_of(functools.partial(self._finish_function, anchored),
                                             f"polestar_build_finish_{'anchored' if anchored else 'plain'}")
                        for anchored in (False, True)}

    def _layer_function(self, h, index, cos, sin, key_valid, keys, values, attn_norm, attn_norm_bias, qkv, qkv_bias,
                        o, o_bias, mlp_norm, mlp_norm_bias, gate_up, gate_up_bias, down, down_bias, slots, *qstored):
        """→ ``(out [B, C, d], window inputs [B, Nw, d], keys, values, *query-store leaves)``."""
        spec = self.spec
        H, Hkv, hd, eps = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.norm_eps
        B = h.shape[0]
        qk, proj = qkv_rows(h, attn_norm, attn_norm_bias, qkv, qkv_bias, cos, sin, eps, H, Hkv)
        q = qk[:, :, :H].transpose(1, 2)
        slot = index[:, None, :, None].expand(-1, Hkv, -1, hd)
        keys = keys.scatter(2, slot, qk[:, :, H:].transpose(1, 2))
        values = values.scatter(2, slot, proj[:, :, H + Hkv:].transpose(1, 2))
        q_window = q.gather(2, slots[:, None, :, None].expand(-1, H, -1, hd)).transpose(1, 2).reshape(B, -1, H * hd)
        qstored, _ = self.qstore.written_all(qstored, None, q_window, None)
        out = attend_mlp(q, h, keys, values, key_valid, o, o_bias, mlp_norm, mlp_norm_bias, gate_up, gate_up_bias,
                         down, down_bias, eps)
        window = h.gather(1, slots[..., None].expand(-1, -1, h.shape[-1]))
        return (out, window, keys, values, *qstored)

    def layer(self, layer: int, h, index, rope: RopeTable, cache, weights, slots, meter: CostMeter,
              layer_bytes) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer`` of the block start's pass → the plan rows' outputs ``[B, C, d]`` and the window rows'
        inputs ``[B, Nw, d]`` (``slots [B, Nw]``: the window rows among the plan rows)."""
        qstore = self.qstore
        keys, values, qstored = cache.k[layer], cache.v[layer], qstore.stored[layer]
        out, window, *new = self._layer(h, index, rope.cos, rope.sin, cache.key_valid, keys, values, *weights, slots,
                                        *qstored)
        for kept, fresh in zip((keys, values, *qstored), new):
            kept.copy_(fresh)
        qstore.anchored[layer] = False
        meter.add(layer_bytes.qkv_pass + layer_bytes.out_mlp_pass, 2 * cache.layer_kv_bytes,
                  h.shape[0] * h.shape[1])
        return out, window

    def layers(self, first: int, end: int, h, index, rope: RopeTable, cache, weights, slots, meter: CostMeter,
               pass_bytes: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layers ``first .. end - 1`` of the block start's pass as one scan of :meth:`_layer_function` over the
        layer-stacked tensors (:mod:`~polestar.models.layer_scan`; ``weights``: their stacks, ``pass_bytes``: their
        weight bytes, one pass each) → the plan rows' outputs ``[B, C, d]`` and every layer's window
        inputs ``[n, B, Nw, d]``; None where the query store is not stacked or this torch has no usable scan (each
        layer runs as :meth:`layer`)."""
        qstore = self.qstore
        if qstore.stacked is None or not layer_scan.available():
            return None
        span = slice(first, end)
        given, present = layer_scan.split_weights(weights)
        written = (cache.k_stack[span], cache.v_stack[span], *(t[span] for t in qstore.stacked))

        def layer(rows, xs):
            keys, values, *rest = xs
            qstored, row = rest[: len(qstore.stacked)], rest[len(qstore.stacked):]
            out, window, *new = self._layer_function(rows, index, rope.cos, rope.sin, cache.key_valid, keys, values,
                                                     *layer_scan.join_weights(row, present), slots, *qstored)
            return out, (window, *new)

        out, (windows, *new) = layer_scan.scan(layer, h.contiguous(), (*written, *given))
        for kept, fresh in zip(written, new):
            kept.copy_(fresh)
        for i in range(first, end):
            qstore.anchored[i] = False
        n = end - first
        meter.add(pass_bytes, 2 * n * cache.layer_kv_bytes,
                  n * h.shape[0] * h.shape[1])
        return out, windows

    def finish_run(self, first: int, end: int, windows, anchors, centroids, cache, query_weights, key_rope, prev,
                   meter: CostMeter, query_bytes: int) -> bool:
        """:meth:`finish` for layers ``first .. end - 1`` as one scan: ``windows [n, B, Nw, d]``, ``anchors`` (same
        shape, or None), ``centroids [n, B, K, d]``, ``query_weights`` the layers' attention norm (weight, bias)
        and q projection (weight, bias) stacked ``[n, ...]`` (None where absent), ``prev [n, B, H, K, T + 1]`` (the
        layers' rows of the stack, written); ``query_bytes``: the bytes of all of them. → False (nothing done)
        where the window store is not stacked or this torch has no usable scan."""
        store = self.store
        if store.stacked is None or not layer_scan.available():
            return False
        span = slice(first, end)
        anchored = anchors is not None and not store.quant.lossless
        key_cos, key_sin = key_rope if key_rope is not None else (None, None)
        given, present = layer_scan.split_weights(query_weights)
        kept = (store.anchor_stack[span],) if anchored else ()
        written = (*(t[span] for t in store.stacked), *kept)
        n_written = len(written)

        def layer(carry, xs):
            keys, window, layer_centroids, *rest = xs
            stored_and_kept, rest = rest[:n_written], rest[n_written:]
            anchor, row = (rest[:1], rest[1:]) if anchored else ((), rest)
            weights = layer_scan.join_weights(row, present, len(query_weights))
            stored = stored_and_kept[: len(store.stacked)]
            probs, *new = self._finish_function(anchored, window, layer_centroids, keys, cache.key_valid, key_cos,
                                                key_sin, *weights, *anchor, *stored_and_kept[len(stored):], *stored)
            return carry.clone(), (probs, *new)

        xs = (cache.k_stack[span], windows, centroids, *written, *((anchors,) if anchored else ()), *given)
        _, (probs, *new) = layer_scan.scan(layer, centroids.new_zeros(()), xs)
        for i in range(first, end):
            store.anchored[i] = anchored
        for old, fresh in zip(written, new):
            old.copy_(fresh)
        prev.copy_(probs)
        B, K = centroids.shape[1], centroids.shape[2]
        n = end - first
        meter.add(query_bytes, n * cache.layer_kv_bytes * (1 if key_rope is None else 2), probe_rows=n * B * K)
        return True

    def _finish_function(self, anchored: bool, window, centroids, keys, key_valid, key_cos, key_sin, attn_norm,
                         attn_norm_bias, q_weight, q_bias, *leaves):
        """``leaves``: the anchors ``[B, Nw, d]`` and the anchor buffer first where ``anchored``, then the store's
        leaves → ``(proxy distributions [B, H, K, T + 1], *store leaves)``, then the new anchor buffer where
        ``anchored`` (a region returns tensors only)."""
        spec = self.spec
        anchor, kept, stored = (leaves[0], leaves[1], leaves[2:]) if anchored else (None, None, leaves)
        stored, kept = self.store.written_all(stored, kept, window, anchor)
        B, K, _ = centroids.shape
        q = layer_regions.project_rows(centroids, attn_norm, attn_norm_bias, q_weight, q_bias, spec.norm_eps)
        q = q.view(B, K, spec.n_heads, spec.head_dim).transpose(1, 2)
        probs = proxy_attention(q, keys, key_valid, self.scale, key_cos=key_cos, key_sin=key_sin)
        return (probs, *stored, kept) if anchored else (probs, *stored)

    def finish(self, layer: int, window, anchor, centroids, cache, query_weights, key_rope, prev,
               meter: CostMeter, query_bytes: int) -> None:
        """Store layer ``layer``'s window inputs ``window [B, Nw, d]`` (``anchor [B, Nw, d]``: each row's centroid,
        or None) and write its centroids' (``[B, K, d]``) proxy distributions into ``prev``. ``query_weights``: the
        layer's attention norm (weight, bias) and q projection (weight, bias); ``query_bytes``: their bytes."""
        store = self.store
        anchored = anchor is not None and not store.quant.lossless
        kept = store.anchor[layer]
        key_cos, key_sin = key_rope if key_rope is not None else (None, None)
        keys = cache.k[layer]
        buffers = (anchor, kept) if anchored else ()
        probs, *new = self._finish[anchored](window, centroids, keys, cache.key_valid, key_cos, key_sin,
                                             *query_weights, *buffers, *store.stored[layer])
        store.anchored[layer] = anchored
        for old, fresh in zip((*store.stored[layer], kept), new):  # the anchor buffer last, where anchored
            old.copy_(fresh)
        prev.copy_(probs)
        B, K, _ = centroids.shape
        meter.add(query_bytes, cache.layer_kv_bytes * (1 if key_rope is None else 2), probe_rows=B * K)
