"""One decoder layer's model work as pure functions of explicit tensors, each compiled once and reused by every layer.

A step calls these for every layer's model work (:meth:`~polestar.models.backbone.DiffusionLM.layer_step`). With
``compile`` on, each is compiled on its own (:func:`compiled`, ``torch.compile(fullgraph=True)``) and
the compiled function is called at every layer: every per-layer difference is an argument tensor of the same shape
(the layer's weights, its K/V cache) and every Python constant (head counts, the norm's epsilon) is the same at every
layer, so one compile serves the whole depth, at 2 layers or 32. None of them writes to its inputs: the K/V writes
and a sparse update's hooks run between them, in the step (on CUDA the whole step, compiled regions included, is
then captured as one CUDA graph per phase).

Inputs are named records (pytrees a compiled region flattens): :class:`LayerWeights`, :class:`LayerShape` (Python
constants), :class:`LayerCache`, :class:`CachedOutputs` and the rows' rotary factors
(:class:`~polestar.models.layers.RopeTable`). Shapes: rows ``[B, X, d]``; rotary factors ``[B, X, 2, hd]``; queries
``[B, H, Q, hd]``; cached keys and values ``[B, Hkv, T + 1, hd]``; ``key_valid [B, T + 1]`` bool.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .layers import RopeTable, Rotary, rms_norm


class LayerWeights(NamedTuple):
    """One layer's tensors (biases None where the checkpoint has none): attention norm, fused q/k/v
    (:class:`~polestar.models.backbone.FusedProjections`), o, MLP norm, fused gate/up, down. A pytree: a region takes
    it whole and reads the fields it needs."""

    attn_norm: torch.Tensor
    attn_norm_bias: torch.Tensor | None
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    mlp_norm: torch.Tensor
    mlp_norm_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


class LayerShape(NamedTuple):
    """The Python constants of a layer's regions, the same at every layer: ``n_heads``, ``n_kv_heads`` and the norms'
    ``eps``."""

    n_heads: int
    n_kv_heads: int
    eps: float


class LayerCache(NamedTuple):
    """One layer's cached ``keys, values [B, Hkv, K, hd]`` (``K = T + 1``; written in place by the passes) and
    ``key_valid``: bool ``[B, K]`` (the same keys for every query row) or ``[B, Q, K]`` (per query row: WINO's
    leave-one-out shadow block)."""

    keys: torch.Tensor
    values: torch.Tensor
    key_valid: torch.Tensor


class CachedOutputs(NamedTuple):
    """Feature caching's per-layer outputs of the plan rows: attention after o ``attn [B, C, d]`` and the MLP branch
    ``mlp [B, C, d]`` (:class:`~polestar.models.hooks.CachedFeatures`)."""

    attn: torch.Tensor
    mlp: torch.Tensor


def qkv_rows(rows, rope: RopeTable, w: LayerWeights, shape: LayerShape):
    """The attention norm of ``rows [B, X, d]``, one matmul over the fused q/k/v weight and one rotation of the q and
    k heads together (``rope``: the rows' factors ``[B, X, 2, hd]``) → ``qk [B, X, H + Hkv, hd]`` (rotated q heads
    then k heads) and the projection ``qkv [B, X, H + 2 Hkv, hd]``, whose last ``Hkv`` heads are the values. (Both
    are whole tensors: a region that returned a view of the projection was miscompiled by inductor, its values
    overwritten.)"""
    B, X, _ = rows.shape
    n_heads, n_kv_heads = shape.n_heads, shape.n_kv_heads
    hd = rope.factors.shape[-1]
    normed = rms_norm(rows, w.attn_norm, w.attn_norm_bias, shape.eps)
    out = F.linear(normed, w.qkv, w.qkv_bias).view(B, X, n_heads + 2 * n_kv_heads, hd)
    return Rotary.rotate(out[:, :, : n_heads + n_kv_heads], rope.cos, rope.sin), out


def _attend(q, cache: LayerCache):
    """Scaled dot-product attention of ``q [B, H, Q, hd]`` over the valid cached keys → ``[B, Q, H · hd]``."""
    keys = cache.keys
    # a branch, not an argument: where the head counts became symbolic, a compiled region guards on it (sdpa takes no
    # symbolic bool)
    gqa = True if keys.shape[1] != q.shape[1] else False  # noqa: SIM210
    valid = cache.key_valid
    mask = valid[:, None, None, :] if valid.dim() == 2 else valid[:, None]  # a shape, not a value: no guard churn
    att = F.scaled_dot_product_attention(q, keys, cache.values, attn_mask=mask, enable_gqa=gqa)
    return att.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def _mlp(hid, w: LayerWeights, eps: float):
    gate, up = F.linear(rms_norm(hid, w.mlp_norm, w.mlp_norm_bias, eps), w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w.down, w.down_bias)


def attend_mlp(q, resid, cache: LayerCache, w: LayerWeights, shape: LayerShape):
    """The rest of a layer for the rows whose queries are ``q [B, H, Q, hd]`` and whose layer inputs are
    ``resid [B, Q, d]``: attention over the layer's cache, o and the residual, then the MLP (norm, fused gate/up,
    SwiGLU, down) and its residual → ``[B, Q, d]``."""
    hid = resid + F.linear(_attend(q, cache), w.o, w.o_bias)
    return hid + _mlp(hid, w, shape.eps)


def cached_rows(h, rows, q, cache: LayerCache, features: CachedOutputs, w: LayerWeights, shape: LayerShape):
    """A layer pass with feature caching (:class:`~polestar.models.hooks.CachedFeatures`): the rows ``rows [B, R]``
    of the plan rows ``h [B, C, d]``, whose queries are ``q [B, H, R, hd]``, attend over the layer's cache; their o
    output replaces theirs in the cached attention outputs ``features.attn [B, C, d]``, the MLP branch of their
    ``h + attn`` replaces theirs in the cached MLP outputs ``features.mlp [B, C, d]``. → the new
    :class:`CachedOutputs` (the caller writes them back) and every plan row's output ``(h + attn) + mlp``
    ``[B, C, d]``."""
    index = rows[..., None].expand(-1, -1, h.shape[-1])
    attn = features.attn.scatter(1, index, F.linear(_attend(q, cache), w.o, w.o_bias))
    hid = h + attn
    mlp = features.mlp.scatter(1, index, _mlp(hid.gather(1, index), w, shape.eps))
    return CachedOutputs(attn, mlp), hid + mlp


def _write_kv(cache: LayerCache, kv_index, qk, proj, shape: LayerShape) -> None:
    """The K/V of rows at cache slots ``kv_index [B, X]`` written into the layer's cache in place (eager glue)."""
    n_heads, n_kv_heads = shape.n_heads, shape.n_kv_heads
    slot = kv_index[:, None, :, None].expand(-1, n_kv_heads, -1, qk.shape[-1])
    cache.keys.scatter_(2, slot, qk[:, :, n_heads:].transpose(1, 2))
    cache.values.scatter_(2, slot, proj[:, :, n_heads + n_kv_heads :].transpose(1, 2))


class LayerPasses(NamedTuple):
    """The whole-layer passes, made of region pieces with the K/V (and cached features) written in place between
    them (eager glue):

    ``decoder_layer(h, kv_index, rope, cache, w, shape)``: the plan rows ``h [B, X, d]`` through q/k/v, their K/V
    written into ``cache`` at ``kv_index [B, X]``, then attention, o and the MLP → ``out [B, X, d]``.

    ``feature_layer(h, rows, kv_index, rope, cache, features, w, shape)``: feature caching's pass: the rows
    ``rows [B, R]`` of the plan rows ``h [B, C, d]`` (slots ``kv_index [B, C]``, factors ``rope`` of the ``C`` rows)
    through q/k/v, their K/V written, then :func:`cached_rows`, whose new outputs are copied into ``features``
    → ``out [B, C, d]``."""

    qkv_fn: Callable
    attend_fn: Callable
    cached_fn: Callable

    def decoder_layer(self, h, kv_index, rope: RopeTable, cache: LayerCache, w: LayerWeights, shape: LayerShape):
        qk, proj = self.qkv_fn(h, rope, w, shape)
        _write_kv(cache, kv_index, qk, proj, shape)
        return self.attend_fn(qk[:, :, : shape.n_heads].transpose(1, 2), h, cache, w, shape)

    def feature_layer(self, h, rows, kv_index, rope: RopeTable, cache: LayerCache, features: CachedOutputs,
                      w: LayerWeights, shape: LayerShape):
        picked = h.gather(1, rows[..., None].expand(-1, -1, h.shape[-1]))
        qk, proj = self.qkv_fn(picked, rope.rows(rows), w, shape)
        _write_kv(cache, kv_index.gather(1, rows), qk, proj, shape)
        new, out = self.cached_fn(h, rows, qk[:, :, : shape.n_heads].transpose(1, 2), cache, features, w, shape)
        for kept, fresh in zip(features, new):
            kept.copy_(fresh)
        return out


def project_rows(rows, norm, norm_bias, weight, bias, eps: float):
    """The attention norm of ``rows [B, X, d]`` and one projection (a hook's own q or v pass) → ``[B, X, out]``."""
    return F.linear(rms_norm(rows, norm, norm_bias, eps), weight, bias)


class Regions(NamedTuple):
    """The functions a layer's pass calls for its model work (:meth:`~polestar.models.backbone.DiffusionLM.
    layer_step` reads them from :func:`active`): the plain functions of this module (:data:`PLAIN`) or each compiled
    on its own (:func:`compiled`). ``passes`` (:class:`LayerPasses`): the whole-layer passes made of those pieces,
    for a layer without a hook and a layer with feature caching."""

    qkv_rows: Callable
    attend_mlp: Callable
    project_rows: Callable
    passes: LayerPasses
    #: how these regions were compiled (``compile(fn) -> compiled fn``); None where they are the plain functions
    compile: Callable | None = None


#: the region pieces, compiled on their own by :func:`compiled`
PIECES = (qkv_rows, attend_mlp, project_rows, cached_rows)
#: the plain functions (eager steps)
PLAIN = Regions(qkv_rows, attend_mlp, project_rows, LayerPasses(qkv_rows, attend_mlp, cached_rows))
_ACTIVE: list[Regions] = [PLAIN]
_COMPILED: dict[tuple, Regions] = {}


def active() -> Regions:
    """The regions layer passes call now: those of the innermost :func:`using`, else :data:`PLAIN`."""
    return _ACTIVE[-1]


@contextlib.contextmanager
def using(regions: Regions) -> Iterator[Regions]:
    """Layer passes inside the block call ``regions``."""
    _ACTIVE.append(regions)
    try:
        yield regions
    finally:
        _ACTIVE.pop()


def compiled(backend: str | Callable = "inductor", options: dict | None = None) -> Regions:
    """Every region compiled on its own (``torch.compile(fullgraph=True)``), made once per process, backend and
    options: a step that calls these compiles one layer's code for the first shape it meets and once more with the
    sizes that changed symbolic (dynamo's automatic dynamic shapes: a new prompt length or batch size then compiles
    nothing), whatever the depth. On
    CUDA the step is then captured whole as a CUDA graph (:class:`~polestar.step_graphs.StepGraphs`)."""
    key = (backend, repr(sorted((options or {}).items())))
    regions = _COMPILED.get(key)
    if regions is None:
        compile = functools.partial(torch.compile, fullgraph=True, backend=backend, options=options)
        regions = _COMPILED[key] = compiled_with(compile)
    return regions


def compiled_with(compile: Callable) -> Regions:
    """The regions with each piece (:data:`PIECES`) compiled by ``compile(fn) -> compiled fn`` and the whole-layer
    passes made of those pieces, their K/V written in place between them (:func:`compiled`'s regions for one
    backend)."""
    qkv_fn, attend_fn, project_fn, cached_fn = (compile(fn) for fn in PIECES)
    return Regions(qkv_fn, attend_fn, project_fn, LayerPasses(qkv_fn, attend_fn, cached_fn), compile)
