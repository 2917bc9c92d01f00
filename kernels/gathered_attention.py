"""Attention for the active (gathered) query positions of a refresh plan.

Polestar (Lee et al., 2026, ``shared/PAPER.md``, "Polestar-Cache") recomputes, at each denoising
step, only the positions selected by the refresh plan (drifted clusters, the current block ...);
their queries are gathered into ``q [B, H, C, hd]`` and attend to all ``T`` cached keys / values
``[B, Hkv, T, hd]`` (grouped-query attention: query head ``h`` uses kv head ``h // (H // Hkv)``)
under a boolean key mask ``key_valid [B, T]``.

The math is that of ``torch.nn.functional.scaled_dot_product_attention(q, keys, values,
attn_mask=key_valid[:, None, None, :], scale=scale, enable_gqa=True)``, computed in fp32 and
cast to ``q.dtype``, except that a query row without any valid key gives zeros (SDPA gives NaN).
``q``, ``keys`` and ``values`` must share one floating dtype.

:func:`reference_gathered_attention` is the torch reference (probabilities from
:func:`polestar.kernels.proxy_attention.reference_proxy_attention`, then ``@ values``),
:func:`gathered_attention_triton` a flash-attention style Triton kernel and
:func:`gathered_attention` the dispatcher (``backend="auto" | "triton" | "reference"``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._backend import HAS_TRITON, is_interpreted, next_pow2, pick, require_triton
from ._library import register_op
from .proxy_attention import check_attention_args, reference_proxy_attention

if HAS_TRITON:
    from . import _attention_kernels

__all__ = [
    "HAS_TRITON",
    "gathered_attention",
    "gathered_attention_triton",
    "reference_gathered_attention",
]

_BLOCK_M_MAX = 64  # queries per program (halved when hd > 128)
_BLOCK_N_MAX = 64  # keys per block (halved for 512-byte key rows, 16 beyond)


def _check_gathered_args(q: Tensor, keys: Tensor, values: Tensor, key_valid: Tensor) -> None:
    check_attention_args(q, keys, key_valid, values)
    if not q.dtype == keys.dtype == values.dtype:
        raise TypeError(f"q, keys and values must share a dtype, got {q.dtype}, {keys.dtype}, {values.dtype}")


def reference_gathered_attention(
    q: Tensor, keys: Tensor, values: Tensor, key_valid: Tensor, scale: float
) -> Tensor:
    """Masked GQA attention of gathered queries over all keys (torch reference).

    Method: ``out = softmax_t((q . k) * scale, key_valid) @ v`` per head, kv head
    ``h // (H // Hkv)``; fp32 math (masked, max-subtracted softmax), cast to ``q.dtype``.  Equal
    to SDPA with ``attn_mask=key_valid[:, None, None, :]`` and ``enable_gqa=True`` on rows with at
    least one valid key; rows with none give 0.

    Args:
        q: ``[B, H, C, hd]`` queries of the ``C`` active positions.
        keys: ``[B, Hkv, T, hd]``, same dtype as ``q``, ``H % Hkv == 0``.
        values: ``[B, Hkv, T, hd]``, same dtype as ``q``.
        key_valid: ``[B, T]`` bool mask of the keys that may be attended.
        scale: score multiplier (usually ``hd ** -0.5``).

    Returns:
        ``[B, H, C, hd]`` in ``q.dtype``.
    """
    _check_gathered_args(q, keys, values, key_valid)
    b, h, c, d = q.shape
    hkv, t = keys.shape[1], keys.shape[2]
    probs = reference_proxy_attention(q, keys, key_valid, scale)  # [B, H, C, T] fp32
    out = torch.matmul(probs.reshape(b, hkv, (h // hkv) * c, t), values.float())
    return out.reshape(b, h, c, d).to(q.dtype)


# ----------------------------------------------------------------------------- triton


def _gathered_attention_fake(
    q: Tensor, keys: Tensor, values: Tensor, key_valid: Tensor, scale: float
) -> Tensor:
    return q.new_empty(q.shape)


@register_op("gathered_attention", fake=_gathered_attention_fake)
def _gathered_attention_op(
    q: Tensor, keys: Tensor, values: Tensor, key_valid: Tensor, scale: float
) -> Tensor:
    """``polestar::gathered_attention``: launches ``gathered_attention_kernel`` (arguments checked)."""
    b, h, c, d = q.shape
    hkv, t = keys.shape[1], keys.shape[2]
    out = torch.empty((b, h, c, d), dtype=q.dtype, device=q.device)
    if out.numel() > 0:
        valid = key_valid.view(torch.uint8)
        block_d = max(16, next_pow2(d))  # tl.dot needs every block dim >= 16
        row_bytes = block_d * q.element_size()  # smaller key blocks for wide rows (shared memory)
        block_n_max = _BLOCK_N_MAX if row_bytes <= 256 else _BLOCK_N_MAX // 2 if row_bytes <= 512 else 16
        block_m_max = _BLOCK_M_MAX if block_d <= 128 else _BLOCK_M_MAX // 2
        block_m = min(max(16, block_m_max), max(16, next_pow2(c)))
        block_n = min(max(16, block_n_max), max(16, next_pow2(t)))
        grid = (b * h, -(-c // block_m))
        kernel = _attention_kernels.gathered_attention_kernel
        dot_fp32 = q.dtype == torch.float32 or is_interpreted(kernel)
        kernel[grid](
            q, keys, values, valid, out, h, c, t, d, h // hkv, scale,
            *q.stride(), *keys.stride(), *values.stride(), *valid.stride(),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, DOT_FP32=dot_fp32,
            num_warps=4 if block_d <= 64 else 8,
        )  # fmt: skip
    return out


def gathered_attention_triton(
    q: Tensor, keys: Tensor, values: Tensor, key_valid: Tensor, scale: float
) -> Tensor:
    """Triton version of :func:`reference_gathered_attention` (same signature, shapes, semantics).

    Method: FlashAttention-2 style forward pass (Dao, 2023): one program per ``(b * H + h, block
    of up to 64 queries)``; key / value blocks of up to 64 positions stream with an online softmax
    (running max, rescaled denominator and fp32 accumulator), masked keys get ``-inf`` scores and
    query rows without a valid key are written as 0.  ``q @ k^T`` runs in the input dtype with
    fp32 accumulation (full fp32, no TF32, for fp32 inputs); probabilities are cast to the value
    dtype for ``p @ v``.  Runs as the opaque op ``torch.ops.polestar.gathered_attention``.

    Args:
        q: ``[B, H, C, hd]``; keys, values: ``[B, Hkv, T, hd]`` (dtype of ``q``);
        key_valid: ``[B, T]`` bool; scale: float.

    Returns:
        ``[B, H, C, hd]`` in ``q.dtype`` (contiguous).
    """
    require_triton()
    _check_gathered_args(q, keys, values, key_valid)
    return torch.ops.polestar.gathered_attention(q, keys, values, key_valid, float(scale))


_GATHERED = {"reference": reference_gathered_attention, "triton": gathered_attention_triton}


def gathered_attention(
    q: Tensor, keys: Tensor, values: Tensor, key_valid: Tensor, scale: float, backend: str = "auto"
) -> Tensor:
    """Masked GQA attention ``[B, H, C, hd], [B, Hkv, T, hd] x2, [B, T] -> [B, H, C, hd]`` (dtype of ``q``).

    ``backend``: ``"auto"`` (Triton on CUDA when available, else torch), ``"triton"`` or
    ``"reference"``.  See :func:`reference_gathered_attention`.
    """
    return pick(_GATHERED, backend, q, keys, values, key_valid)(q, keys, values, key_valid, scale)
