"""A run of consecutive layers as one scan over the layer-stacked tensors: traced once, whatever the depth.

A whole-step compile that calls a layer region once per layer (:mod:`polestar.models.layer_regions`) traces the
layer once, yet still pays per layer: every call is a node of the step graph with its ~20 inputs and outputs, and
AOT autograd functionalizes each call again (about 65 ms per layer call on this project's CPU with ``aot_eager``,
whatever the layer holds). A scan (``torch._higher_order_ops.scan``) is one node for the whole run: its body, one
layer as a pure function of explicit tensors, is traced once and iterated over the leading axis of the stacks it is
given, the layer's weights (:meth:`~polestar.models.backbone.DiffusionLM.stacked_weights`) and its K/V rows
(:class:`~polestar.models.plan.DecodeCache` ``k_stack, v_stack``). Inductor lowers it to a loop on the host over one
compiled body (the loop counter lives on the host, so the loop needs no device read and can be captured in a CUDA
graph).

The scan's body may not write its inputs: each layer returns its rewritten K/V as the scan's per-layer outputs,
which the caller copies back into the stacks in one copy per stack, as a region's caller copies its buffers back.

Shapes: plan rows ``h [B, X, d]``; cache slots ``index [B, X]``; rotary factors ``cos, sin [B, X, 1, hd]``;
``key_valid [B, T + 1]``; K/V stacks ``[n, B, Hkv, T + 1, hd]`` for the ``n`` layers of the run.
"""

from __future__ import annotations

import torch

from . import layer_regions
from .layer_regions import LayerWeights

try:  # a prototype of torch; where it is missing, every layer is a region of its own
    from torch._higher_order_ops.scan import scan as _scan
except ImportError:  # pragma: no cover - torch without the scan operator
    _scan = None


def _live_side_effects() -> bool:
    """Make dynamo's view of an object's ``__dict__`` read the trace's current side-effect table; → whether it does.

    dynamo (torch 2.13) traces a higher-order operator's body on a copy of its side-effect table and then swaps the
    copy back in, but the view it keeps of each object's ``__dict__`` (``SideEffectsProxyDict``) holds the table it
    was made with: an attribute write to an object touched before a scan, made after the scan, goes to the old table
    and is lost from the compiled step (a counter on the step's cost meter, the packet a hook hands to the next layer
    would silently keep their values from before the scan). The view reads the table through the trace's output
    graph instead. Where this torch has no such view the writes need no fix; where it has one of another shape, no
    scan is used."""
    try:
        from torch._dynamo.side_effects import SideEffects
        from torch._dynamo.variables.dicts import SideEffectsProxyDict
    except ImportError:  # pragma: no cover - another dynamo layout: no view that could hold a table
        return True
    if isinstance(SideEffectsProxyDict.__dict__.get("side_effects"), property):
        return True
    if "output_graph_weakref" not in SideEffects.__init__.__code__.co_names + SideEffects.clone.__code__.co_names:
        return False  # pragma: no cover - a dynamo whose tables name their trace differently

    def table(view) -> SideEffects:
        return view._trace().side_effects

    def made_with(view, side_effects: SideEffects) -> None:
        view._trace = side_effects.output_graph_weakref

    SideEffectsProxyDict.side_effects = property(table, made_with)
    return True


_WRITES_KEPT = _scan is not None and _live_side_effects()


def available() -> bool:
    """Whether this torch has the scan operator and dynamo keeps the step's Python writes made after one."""
    return _WRITES_KEPT


def scan(layer_fn, carry, xs):
    """``layer_fn(carry, row) → (carry, outputs)`` applied along the leading axis of every tensor of ``xs`` (a
    tuple), one layer per row → ``(final carry, outputs stacked over the rows)``: one graph node in a compile."""
    return _scan(layer_fn, carry, xs)


def split_weights(weights) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """The tensors of ``weights`` (a :class:`LayerWeights` or any tuple with None fields) that are given (a scan's
    inputs are tensors) and their positions."""
    present = tuple(i for i, t in enumerate(weights) if t is not None)
    return tuple(weights[i] for i in present), present


def join_weights(given, present: tuple[int, ...], n_fields: int = len(LayerWeights._fields)) -> list:
    """:func:`split_weights` undone for one layer's row: ``given`` at their positions among ``n_fields`` (those of
    :class:`LayerWeights` by default), None elsewhere."""
    full: list[torch.Tensor | None] = [None] * n_fields
    for i, t in zip(present, given):
        full[i] = t
    return full


def plain_layers(h, index, cos, sin, key_valid, keys, values, weights: LayerWeights, eps: float, n_heads: int,
                 n_kv_heads: int):
    """Layers without a hook, one after another (each what :func:`~polestar.models.layer_regions.decoder_layer`
    computes), as one scan over ``weights`` (a :class:`LayerWeights` of ``[n, ...]`` stacks, None fields skipped)
    and the K/V stacks ``keys, values [n, B, Hkv, T + 1, hd]`` → ``(out [B, X, d], new keys, new values)``, the
    plan rows' K/V of every layer ``[n, B, Hkv, X, hd]`` (the caller writes them at ``index``, :func:`write_rows`:
    a scan's outputs are the rows a layer wrote, not whole copies of its cache)."""
    given, present = split_weights(weights)
    hd = cos.shape[-1]
    slot = index[:, None, :, None].expand(-1, n_kv_heads, -1, hd)

    def layer(rows, xs):
        layer_keys, layer_values, *row = xs
        w = LayerWeights(*join_weights(row, present))
        qk, proj = layer_regions.qkv_rows(rows, w.attn_norm, w.attn_norm_bias, w.qkv, w.qkv_bias, cos, sin, eps,
                                          n_heads, n_kv_heads)
        new_keys = qk[:, :, n_heads:].transpose(1, 2).contiguous()
        new_values = proj[:, :, n_heads + n_kv_heads:].transpose(1, 2).contiguous()
        out = layer_regions.attend_mlp(
            qk[:, :, :n_heads].transpose(1, 2), rows, layer_keys.scatter(2, slot, new_keys),
            layer_values.scatter(2, slot, new_values), key_valid, w.o, w.o_bias, w.mlp_norm, w.mlp_norm_bias,
            w.gate_up, w.gate_up_bias, w.down, w.down_bias, eps)
        return out, (new_keys, new_values)

    out, (new_keys, new_values) = scan(layer, h, (keys, values, *given))
    return out, new_keys, new_values


def write_rows(stack: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """Write every layer's rows ``rows [n, B, H, X, hd]`` into ``stack [n, B, H, T + 1, hd]`` at the slots
    ``index [B, X]`` (the same at every layer), in place: one scatter for the run."""
    n, _, H, _, hd = rows.shape
    stack.scatter_(3, index[None, :, None, :, None].expand(n, -1, H, -1, hd), rows)


def feature_layers(h, rows, index, cos, sin, key_valid, keys, values, attn, mlp, weights: LayerWeights, eps: float,
                   n_heads: int, n_kv_heads: int):
    """Feature-cached layers recomputing the same plan rows ``rows [B, R]`` (each
    :func:`~polestar.models.layer_regions.feature_layer`) as one scan over ``weights`` and the stacks ``keys,
    values [n, B, Hkv, T + 1, hd]``, ``attn, mlp [n, B, C, d]`` → ``(out [B, C, d], keys, values, attn, mlp)``, the
    stacks as new tensors."""
    given, present = split_weights(weights)

    def layer(h_in, xs):
        layer_keys, layer_values, layer_attn, layer_mlp, *row = xs
        out, *buffers = layer_regions.feature_layer(
            h_in, rows, index, cos, sin, key_valid, layer_keys, layer_values, layer_attn, layer_mlp,
            *join_weights(row, present), eps, n_heads, n_kv_heads)
        return out, tuple(buffers)

    out, buffers = scan(layer, h, (keys, values, attn, mlp, *given))
    return (out, *buffers)


def plain_layers_eager(h, index, cos, sin, key_valid, keys, values, weights: LayerWeights, eps: float,
                       n_heads: int, n_kv_heads: int):
    """:func:`plain_layers` as a Python loop over the layers (its reference; ``keys, values`` left as they are)."""
    new_keys, new_values = [], []
    hd = cos.shape[-1]
    for layer in range(keys.shape[0]):
        layer_weights = [None if t is None else t[layer] for t in weights]
        h, k, v = layer_regions.decoder_layer(h, index, cos, sin, key_valid, keys[layer], values[layer],
                                              *layer_weights, eps, n_heads, n_kv_heads)
        slot = index[:, None, :, None].expand(-1, n_kv_heads, -1, hd)
        new_keys.append(k.gather(2, slot))
        new_values.append(v.gather(2, slot))
    return h, torch.stack(new_keys), torch.stack(new_values)
