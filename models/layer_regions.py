"""One decoder layer's model work as pure functions of explicit tensors, each compiled once and reused by every layer.

A step calls these for every layer's model work (:meth:`~polestar.models.backbone.DiffusionLM.layer_step`). With
``compile`` on, each is compiled on its own (:func:`compiled`, ``torch.compile(fullgraph=True)``) and
the compiled function is called at every layer: every per-layer difference is an argument tensor of the same shape
(the layer's weights, its K/V cache) and every Python constant (head counts, the norm's epsilon) is the same at every
layer, so one compile serves the whole depth, at 2 layers or 32. None of them writes to its inputs: the K/V writes
and a sparse update's hooks run between them, in the step (on CUDA the whole step, compiled regions included, is
then captured as one CUDA graph per phase).

Shapes: rows ``[B, X, d]``; rotary factors ``cos, sin [B, X, 1, hd]`` (:class:`~polestar.models.layers.RopeTable`);
queries ``[B, H, Q, hd]``; cached keys and values ``[B, Hkv, T + 1, hd]``; ``key_valid [B, T + 1]`` bool.
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
    """One layer's tensors in the order the regions take them (biases None where the checkpoint has none):
    attention norm, fused q/k/v (:class:`~polestar.models.backbone.FusedProjections`), o, MLP norm, fused gate/up,
    down."""

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


def qkv_rows(rows, norm, norm_bias, qkv, qkv_bias, cos, sin, eps: float, n_heads: int, n_kv_heads: int):
    """The attention norm of ``rows [B, X, d]``, one matmul over the fused q/k/v weight and one rotation of the q and
    k heads together → ``qk [B, X, H + Hkv, hd]`` (rotated q heads then k heads) and the projection
    ``qkv [B, X, H + 2 Hkv, hd]``, whose last ``Hkv`` heads are the values. (Both are whole tensors: a region that
    returned a view of the projection was miscompiled by inductor, its values overwritten.)"""
    B, X, _ = rows.shape
    hd = cos.shape[-1]
    out = F.linear(rms_norm(rows, norm, norm_bias, eps), qkv, qkv_bias).view(B, X, n_heads + 2 * n_kv_heads, hd)
    return Rotary.rotate(out[:, :, : n_heads + n_kv_heads], RopeTable(cos, sin)), out


def _attend(q, keys, values, key_valid):
    """Scaled dot-product attention of ``q [B, H, Q, hd]`` over the valid cached keys → ``[B, Q, H · hd]``."""
    # a branch, not an argument: where the head counts became symbolic, a compiled region guards on it (sdpa takes no
    # symbolic bool)
    gqa = True if keys.shape[1] != q.shape[1] else False  # noqa: SIM210
    att = F.scaled_dot_product_attention(q, keys, values, attn_mask=key_valid[:, None, None, :], enable_gqa=gqa)
    return att.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def _mlp(hid, norm, norm_bias, gate_up, gate_up_bias, down, down_bias, eps: float):
    gate, up = F.linear(rms_norm(hid, norm, norm_bias, eps), gate_up, gate_up_bias).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down, down_bias)


def attend_mlp(q, resid, keys, values, key_valid, o, o_bias, norm, norm_bias, gate_up, gate_up_bias, down,
               down_bias, eps: float):
    """The rest of a layer for the rows whose queries are ``q [B, H, Q, hd]`` and whose layer inputs are
    ``resid [B, Q, d]``: attention over the layer's cache, o and the residual, then the MLP (norm, fused gate/up,
    SwiGLU, down) and its residual → ``[B, Q, d]``."""
    hid = resid + F.linear(_attend(q, keys, values, key_valid), o, o_bias)
    return hid + _mlp(hid, norm, norm_bias, gate_up, gate_up_bias, down, down_bias, eps)


def cached_rows(h, rows, q, keys, values, key_valid, attn, mlp, o, o_bias, norm, norm_bias, gate_up, gate_up_bias,
                down, down_bias, eps: float):
    """A layer pass with feature caching (:class:`~polestar.models.hooks.CachedFeatures`): the rows ``rows [B, R]``
    of the plan rows ``h [B, C, d]``, whose queries are ``q [B, H, R, hd]``, attend over the layer's cache; their o
    output replaces theirs in the cached attention outputs ``attn [B, C, d]``, the MLP branch of their
    ``h + attn`` replaces theirs in the cached MLP outputs ``mlp [B, C, d]``. → the new ``attn``, the new ``mlp``
    (the caller writes them back) and every plan row's output ``(h + attn) + mlp`` ``[B, C, d]``."""
    index = rows[..., None].expand(-1, -1, h.shape[-1])
    attn = attn.scatter(1, index, F.linear(_attend(q, keys, values, key_valid), o, o_bias))
    hid = h + attn
    mlp = mlp.scatter(1, index, _mlp(hid.gather(1, index), norm, norm_bias, gate_up, gate_up_bias, down, down_bias,
                                     eps))
    return attn, mlp, hid + mlp


def _scatter_(t, slot, rows):
    """``t`` with ``rows`` written at ``slot`` along dim 2, in place (eager glue)."""
    return t.scatter_(2, slot, rows)


def _layer_pass(qkv_fn, attend_fn, write, h, kv_index, cos, sin, key_valid, keys, values, attn_norm, attn_norm_bias,
                qkv, qkv_bias, o, o_bias, mlp_norm, mlp_norm_bias, gate_up, gate_up_bias, down, down_bias, eps: float,
                n_heads: int, n_kv_heads: int):
    """A whole layer for the plan rows ``h [B, X, d]`` without a hook: q/k/v (``qkv_fn``, :func:`qkv_rows`), their
    K/V written (``write``) into the layer's ``keys, values [B, Hkv, T + 1, hd]`` at ``kv_index [B, X]``, then
    attention, o and the MLP (``attend_fn``, :func:`attend_mlp`) → ``(out [B, X, d], keys, values)``."""
    qk, proj = qkv_fn(h, attn_norm, attn_norm_bias, qkv, qkv_bias, cos, sin, eps, n_heads, n_kv_heads)
    slot = kv_index[:, None, :, None].expand(-1, n_kv_heads, -1, cos.shape[-1])
    keys = write(keys, slot, qk[:, :, n_heads:].transpose(1, 2))
    values = write(values, slot, proj[:, :, n_heads + n_kv_heads :].transpose(1, 2))
    out = attend_fn(qk[:, :, :n_heads].transpose(1, 2), h, keys, values, key_valid, o, o_bias, mlp_norm,
                    mlp_norm_bias, gate_up, gate_up_bias, down, down_bias, eps)
    return out, keys, values


def _feature_pass(qkv_fn, cached_fn, write, h, rows, kv_index, cos, sin, key_valid, keys, values, attn, mlp,
                  attn_norm, attn_norm_bias, qkv, qkv_bias, o, o_bias, mlp_norm, mlp_norm_bias, gate_up,
                  gate_up_bias, down, down_bias, eps: float, n_heads: int, n_kv_heads: int):
    """A layer pass with feature caching, whole: the rows ``rows [B, R]`` of the plan rows ``h [B, C, d]`` (cache
    slots ``kv_index [B, C]``, rotary factors ``cos, sin [B, C, 1, hd]``) go through q/k/v, their K/V are written
    into the layer's ``keys, values``, then :func:`cached_rows` (``cached_fn``) → ``(out [B, C, d], keys, values,
    attn, mlp)``."""
    slot = rows[:, :, None, None].expand(-1, -1, 1, cos.shape[-1])
    picked = h.gather(1, rows[..., None].expand(-1, -1, h.shape[-1]))
    qk, proj = qkv_fn(picked, attn_norm, attn_norm_bias, qkv, qkv_bias, cos.gather(1, slot), sin.gather(1, slot),
                      eps, n_heads, n_kv_heads)
    kv_slot = kv_index.gather(1, rows)[:, None, :, None].expand(-1, n_kv_heads, -1, cos.shape[-1])
    keys = write(keys, kv_slot, qk[:, :, n_heads:].transpose(1, 2))
    values = write(values, kv_slot, proj[:, :, n_heads + n_kv_heads :].transpose(1, 2))
    attn, mlp, out = cached_fn(h, rows, qk[:, :, :n_heads].transpose(1, 2), keys, values, key_valid, attn, mlp, o,
                               o_bias, mlp_norm, mlp_norm_bias, gate_up, gate_up_bias, down, down_bias, eps)
    return out, keys, values, attn, mlp


class WritesBack:
    """A layer pass that writes the layer's buffers in place: ``fn(*args)`` returns ``(out, *buffers)``, and each
    buffer is copied into the argument at the matching position of ``written`` unless it is that argument already
    (an in-place write). Returns ``out``."""

    def __init__(self, fn: Callable, written: tuple[int, ...]) -> None:
        self.fn, self.written = fn, written

    def __call__(self, *args):
        out, *buffers = self.fn(*args)
        for i, new in zip(self.written, buffers):
            if new is not args[i]:
                args[i].copy_(new)
        return out


#: argument positions of the buffers each pass writes, in the order it returns them
_LAYER_WRITES, _FEATURE_WRITES = (5, 6), (6, 7, 8, 9)


def _passes(qkv_fn, attend_fn, cached_fn) -> tuple[WritesBack, WritesBack]:
    """The two whole-layer passes made of region pieces, the K/V written in place between them (eager glue)."""
    return (WritesBack(functools.partial(_layer_pass, qkv_fn, attend_fn, _scatter_), _LAYER_WRITES),
            WritesBack(functools.partial(_feature_pass, qkv_fn, cached_fn, _scatter_), _FEATURE_WRITES))


def project_rows(rows, norm, norm_bias, weight, bias, eps: float):
    """The attention norm of ``rows [B, X, d]`` and one projection (a hook's own q or v pass) → ``[B, X, out]``."""
    return F.linear(rms_norm(rows, norm, norm_bias, eps), weight, bias)


class Regions(NamedTuple):
    """The functions a layer's pass calls for its model work (:meth:`~polestar.models.backbone.DiffusionLM.
    layer_step` reads them from :func:`active`): the plain functions of this module (:data:`PLAIN`) or each compiled
    on its own (:func:`compiled`). ``decoder_layer`` (a layer without a hook) and ``feature_layer`` (a layer with
    feature caching) are whole passes made of the pieces, the K/V written in place between them
    (:class:`WritesBack`)."""

    qkv_rows: Callable
    attend_mlp: Callable
    project_rows: Callable
    decoder_layer: WritesBack
    feature_layer: WritesBack
    #: how these regions were compiled (``compile(fn) -> compiled fn``); None where they are the plain functions
    compile: Callable | None = None


#: the region pieces, compiled on their own by :func:`compiled`
PIECES = (qkv_rows, attend_mlp, project_rows, cached_rows)
#: the plain functions (eager steps)
PLAIN = Regions(qkv_rows, attend_mlp, project_rows, *_passes(qkv_rows, attend_mlp, cached_rows))
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
    return Regions(qkv_fn, attend_fn, project_fn, *_passes(qkv_fn, attend_fn, cached_fn), compile)
