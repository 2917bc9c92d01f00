"""Attention probabilities of probe ("proxy") queries over the cached keys.

Polestar (Lee et al., 2026, "Polestar: Drift-Aware Cache Calibration and Token Commitment",
section "Polestar-Cache") measures the drift of a
cluster through the attention row of its *proxy query* (e.g. the centroid's query): the full
softmax distribution ``A = softmax((q . k) * scale)`` over all ``T`` key positions, compared
between steps with :func:`polestar.kernels.drift.kl_drift`.  This module computes those rows
for ``P`` probe queries per head:

* ``q [B, H, P, hd]`` probe queries, ``keys [B, Hkv, T, hd]`` (grouped-query attention: ``H`` is
  a multiple of ``Hkv`` and query head ``h`` uses kv head ``h // (H // Hkv)``),
* ``key_valid [B, T]`` bool: keys that may be attended (padding / not yet written are False),
* result ``[B, H, P, T]`` fp32 probabilities; invalid keys get exactly 0 and a row without any
  valid key is all zeros (not NaN).  Scores and softmax are computed in fp32 whatever the input
  dtypes (``q`` and ``keys`` may differ).

:func:`reference_proxy_attention` is the torch reference, :func:`proxy_attention_triton` the
Triton kernel (one program per ``(b, h, p)`` row, two passes over ``T``), and
:func:`proxy_attention` dispatches with ``backend="auto" | "triton" | "reference"``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._backend import HAS_TRITON, next_pow2, pick, require_triton
from ._library import fused_op, register_op

if HAS_TRITON:
    from . import _attention_kernels

__all__ = [
    "HAS_TRITON",
    "check_attention_args",
    "masked_softmax",
    "proxy_attention",
    "proxy_attention_triton",
    "reference_proxy_attention",
    "rotate_keys",
]

_TILE = 8192  # BLOCK_T * BLOCK_D elements per key tile of the proxy kernel


def check_attention_args(q: Tensor, keys: Tensor, key_valid: Tensor, values: Tensor | None = None) -> None:
    """Validate ``q [B, H, Q, hd]``, ``keys [B, Hkv, T, hd]``, ``key_valid [B, T]`` bool (and ``values``).

    Raises ``ValueError`` when ranks or sizes disagree, when ``H`` is not a positive multiple of
    ``Hkv``, when ``key_valid`` is not a bool ``[B, T]`` tensor or ``values`` has another shape
    than ``keys``; ``TypeError`` for non-floating ``q`` / ``keys`` / ``values``.
    """
    if q.dim() != 4 or keys.dim() != 4:
        raise ValueError(
            f"expected q [B, H, Q, hd] and keys [B, Hkv, T, hd], got {tuple(q.shape)}, {tuple(keys.shape)}"
        )
    b, h, _, d = q.shape
    bk, hkv, t, dk = keys.shape
    if b != bk or d != dk:
        raise ValueError(f"q {tuple(q.shape)} and keys {tuple(keys.shape)} disagree on B or hd")
    if hkv < 1 or h % hkv != 0:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({hkv})")
    if key_valid.dtype != torch.bool or tuple(key_valid.shape) != (b, t):
        raise ValueError(f"key_valid must be bool {(b, t)}, got {key_valid.dtype} {tuple(key_valid.shape)}")
    if values is not None and values.shape != keys.shape:
        raise ValueError(f"values {tuple(values.shape)} must have the shape of keys {tuple(keys.shape)}")
    for name, x in (("q", q), ("keys", keys), ("values", values)):
        if x is not None and not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")


def masked_softmax(scores: Tensor, mask: Tensor) -> Tensor:
    """Softmax over the last dim restricted to ``mask``: exactly 0 off the mask, all-zero rows if empty.

    Args:
        scores: ``[..., T]`` fp32 scores (finite where ``mask``).
        mask: bool, broadcastable to ``scores``.

    Returns:
        ``[..., T]`` fp32 probabilities (rows sum to 1, or to 0 when no entry is masked in).
    """
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)  # NaN rows where nothing is masked in
    return probs.masked_fill(~mask.any(-1, keepdim=True), 0.0)


def rotate_keys(keys: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``keys [B, Hkv, T, hd]`` rotated as rotary embedding rotates: ``k cos + rotate_half(k) sin`` in fp32
    (``cos, sin [B, 1, T, hd]``), returned in the keys' dtype. With the cache positions' ``cos`` and ``-sin`` it
    undoes the keys' rotary embedding."""
    kf = keys.float()
    k1, k2 = kf.chunk(2, dim=-1)
    return (kf * cos + torch.cat((-k2, k1), dim=-1) * sin).to(keys.dtype)


def check_key_rope(keys: Tensor, key_cos: Tensor | None, key_sin: Tensor | None) -> None:
    """Validate the optional key rotation of :func:`reference_proxy_attention` (both or neither; ``[B, 1, T, hd]``
    fp32)."""
    if (key_cos is None) != (key_sin is None):
        raise ValueError("key_cos and key_sin go together: pass both or neither")
    if key_cos is None:
        return
    b, _, t, d = keys.shape
    for name, x in (("key_cos", key_cos), ("key_sin", key_sin)):
        if tuple(x.shape) != (b, 1, t, d) or x.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32 {(b, 1, t, d)}, got {x.dtype} {tuple(x.shape)}")


def reference_proxy_attention(q: Tensor, keys: Tensor, key_valid: Tensor, scale: float,
                              key_cos: Tensor | None = None, key_sin: Tensor | None = None) -> Tensor:
    """Attention probabilities of probe queries over valid keys (torch reference).

    Method: ``softmax_t((q_{b,h,p} . k_{b,h//G,t}) * scale)`` restricted to ``key_valid[b, t]``
    (Polestar's proxy-query attention rows, the input of the KL drift), computed in fp32 with a
    max-subtracted softmax; GQA groups are handled by a reshape (no key copies). With ``key_cos`` and
    ``key_sin`` the keys are rotated first (:func:`rotate_keys`; Polestar scores un-rotated centroid queries
    against keys whose rotary embedding is undone).

    Args:
        q: ``[B, H, P, hd]`` probe queries (any float dtype).
        keys: ``[B, Hkv, T, hd]`` keys (any float dtype), ``H % Hkv == 0``.
        key_valid: ``[B, T]`` bool, False for keys that must get probability 0.
        scale: score multiplier (usually ``hd ** -0.5``).
        key_cos, key_sin: ``[B, 1, T, hd]`` fp32 or None.

    Returns:
        ``[B, H, P, T]`` fp32; rows sum to 1 over valid keys, all zeros if no key is valid.
    """
    check_attention_args(q, keys, key_valid)
    check_key_rope(keys, key_cos, key_sin)
    if key_cos is not None:
        keys = rotate_keys(keys, key_cos, key_sin)
    b, h, p, d = q.shape
    hkv, t = keys.shape[1], keys.shape[2]
    qg = q.float().reshape(b, hkv, (h // hkv) * p, d)
    scores = torch.matmul(qg, keys.float().transpose(-1, -2)) * scale  # [B, Hkv, G * P, T]
    return masked_softmax(scores, key_valid[:, None, None, :]).reshape(b, h, p, t)


# ----------------------------------------------------------------------------- triton


def _proxy_attention_fake(q: Tensor, keys: Tensor, key_valid: Tensor, scale: float,
                          key_cos: Tensor | None = None, key_sin: Tensor | None = None) -> Tensor:
    b, h, p, _ = q.shape
    return q.new_empty((b, h, p, keys.shape[2]), dtype=torch.float32)


@register_op("proxy_attention", fake=_proxy_attention_fake)
def _proxy_attention_op(q: Tensor, keys: Tensor, key_valid: Tensor, scale: float,
                        key_cos: Tensor | None = None, key_sin: Tensor | None = None) -> Tensor:
    """``polestar::proxy_attention``: launches ``proxy_attention_kernel`` (arguments already checked)."""
    b, h, p, d = q.shape
    hkv, t = keys.shape[1], keys.shape[2]
    out = torch.empty((b, h, p, t), dtype=torch.float32, device=q.device)
    if out.numel() > 0:
        valid = key_valid.view(torch.uint8)
        block_d = next_pow2(d)
        block_t = min(next_pow2(t), max(16, _TILE // block_d))
        rope = key_cos is not None
        if rope and key_cos.stride() != key_sin.stride():
            key_cos, key_sin = key_cos.contiguous(), key_sin.contiguous()
        cos, sin = (key_cos, key_sin) if rope else (out, out)  # unused pointers without the rotation
        _attention_kernels.proxy_attention_kernel[(b * h * p,)](
            q, keys, valid, out, h, p, t, d, h // hkv, scale,
            *q.stride(), *keys.stride(), *valid.stride(),
            cos, sin, *((cos.stride(0), cos.stride(2), cos.stride(3)) if rope else (0, 0, 0)),
            BLOCK_T=block_t, BLOCK_D=block_d, ROPE=rope,
        )  # fmt: skip
    return out


def proxy_attention_triton(q: Tensor, keys: Tensor, key_valid: Tensor, scale: float,
                           key_cos: Tensor | None = None, key_sin: Tensor | None = None) -> Tensor:
    """Triton version of :func:`reference_proxy_attention` (same signature, shapes and semantics).

    Method: one program per ``(b, h, p)`` row; pass 1 streams the keys in ``BLOCK_T`` chunks
    keeping a running max and rescaled sum (online softmax), pass 2 recomputes the scores and
    writes ``exp(s - max) / sum``.  Runs as the opaque op ``torch.ops.polestar.proxy_attention``.

    Args:
        q: ``[B, H, P, hd]``; keys: ``[B, Hkv, T, hd]``; key_valid: ``[B, T]`` bool; scale: float;
        key_cos, key_sin: ``[B, 1, T, hd]`` fp32 or None (the keys' rotation, loaded with the keys).

    Returns:
        ``[B, H, P, T]`` fp32 probabilities (0 for invalid keys, zero rows if none is valid).
    """
    require_triton()
    check_attention_args(q, keys, key_valid)
    check_key_rope(keys, key_cos, key_sin)
    return torch.ops.polestar.proxy_attention(q, keys, key_valid, float(scale), key_cos, key_sin)


_PROXY = {"reference": reference_proxy_attention, "triton": proxy_attention_triton,
          "fused": fused_op("proxy_attention", _proxy_attention_fake, cuda=_proxy_attention_op)(
              reference_proxy_attention)}


def proxy_attention(
    q: Tensor, keys: Tensor, key_valid: Tensor, scale: float, backend: str = "auto",
    key_cos: Tensor | None = None, key_sin: Tensor | None = None,
) -> Tensor:
    """Proxy-query attention probabilities ``[B, H, P, hd], [B, Hkv, T, hd], [B, T] -> [B, H, P, T]`` fp32,
    the keys optionally rotated first by ``key_cos``, ``key_sin [B, 1, T, hd]``.

    ``backend``: ``"auto"`` (one operation: the Triton kernel on CUDA, the reference elsewhere), ``"triton"`` or
    ``"reference"``.  See :func:`reference_proxy_attention`.
    """
    check_attention_args(q, keys, key_valid)
    check_key_rope(keys, key_cos, key_sin)
    return pick(_PROXY, backend, q, keys, key_valid)(q, keys, key_valid, float(scale), key_cos, key_sin)
