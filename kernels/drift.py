"""Row-wise drift between attention distributions, and the entropy "uncertainty" metric.

Polestar (Lee et al., 2026, "Polestar: Drift-Aware Cache Calibration and Token Commitment")
measures the *representation drift* of a
token (or of a cluster's proxy query) at step ``t`` as ``KL(A^t || A^{t-1})`` of its attention
row, computed per head and averaged over heads (:func:`head_mean_kl_drift`).  The paper's
ablation compares KL against cosine dissimilarity (:func:`cosine_drift`) and an
uncertainty-based selection (:func:`entropy` of the logits); Jensen-Shannon (:func:`js_drift`)
is a bounded, symmetric variant.

All functions reduce over the last dim: inputs ``[..., N]`` give outputs ``[...]`` in fp32.
Inputs may be fp32 / fp16 / bf16; math is done in fp32.  They are numerically safe: zeros in
``p`` or ``q``, all-equal rows and ``-inf`` logits give finite values ``>= 0``, and equal inputs
give exactly 0 (KL / JS) or < 1e-6 (cosine).  Rows are *not* renormalised: attention rows are
expected to sum to 1, small deviations (fp16 rounding) are absorbed by clamping the result at 0.

Each metric has a torch reference (``reference_*``), a Triton kernel wrapper (``*_triton``,
one program per row, loop over ``N`` in ``BLOCK`` chunks) and a dispatcher with
``backend="auto" | "triton" | "reference"`` (see :mod:`polestar.kernels._backend`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._backend import HAS_TRITON, next_pow2, pick, require_triton
from ._library import fused_op, register_op

if HAS_TRITON:
    from . import _drift_kernels

__all__ = [
    "DEFAULT_EPS",
    "HAS_TRITON",
    "cosine_drift",
    "cosine_drift_triton",
    "entropy",
    "entropy_triton",
    "head_mean_kl_drift",
    "js_drift",
    "js_drift_triton",
    "kl_drift",
    "kl_drift_triton",
    "reference_cosine_drift",
    "reference_entropy",
    "reference_js_drift",
    "reference_kl_drift",
]

DEFAULT_EPS = 1e-12
"""Probabilities are clamped to at least this value inside ``log`` (fp32-safe); the drift stages' ``eps`` default."""

_MAX_BLOCK = 2048

# ----------------------------------------------------------------------------- references


def _check_pair(p: Tensor, q: Tensor) -> None:
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}")


def _kl_terms(p: Tensor, q: Tensor, eps: float) -> Tensor:
    """Element-wise ``p (log max(p,eps) - log max(q,eps))`` in fp32; 0 where ``p == 0``."""
    p = p.clamp_min(0)
    return p * (p.clamp_min(eps).log() - q.clamp_min(eps).log())


def reference_kl_drift(p: Tensor, q: Tensor, eps: float = DEFAULT_EPS) -> Tensor:
    """KL divergence ``KL(p || q) = sum_n p_n (log p_n - log q_n)`` over the last dim (torch).

    Method: Polestar drift ``D_i = KL(A_i^t || A_i^{t-1})`` (paper, "Polestar-Cache").
    Probabilities are clamped to ``>= eps`` inside the logs (so zeros in ``q`` stay finite),
    terms with ``p_n == 0`` contribute 0, and the result is clamped at 0.

    Args:
        p: ``[..., N]`` current distribution (fp32 / fp16 / bf16).
        q: ``[..., N]`` previous distribution, same shape as ``p``.
        eps: floor for probabilities inside ``log``.

    Returns:
        ``[...]`` fp32, ``>= 0``; exactly 0 where ``p == q``.
    """
    _check_pair(p, q)
    return _kl_terms(p.float(), q.float(), eps).sum(-1).clamp_min(0)


def reference_js_drift(p: Tensor, q: Tensor, eps: float = DEFAULT_EPS) -> Tensor:
    """Jensen-Shannon divergence ``KL(p||m)/2 + KL(q||m)/2``, ``m = (p+q)/2``, over the last dim.

    Method: symmetric, bounded (``<= ln 2``) alternative to the paper's KL drift; same eps
    handling as :func:`reference_kl_drift`.

    Args:
        p: ``[..., N]`` distribution (fp32 / fp16 / bf16).
        q: ``[..., N]`` distribution, same shape.
        eps: floor for probabilities inside ``log``.

    Returns:
        ``[...]`` fp32 in ``[0, ln 2]`` (up to rounding); exactly 0 where ``p == q``.
    """
    _check_pair(p, q)
    p32 = p.float().clamp_min(0)
    q32 = q.float().clamp_min(0)
    m = (p32 + q32) * 0.5
    terms = 0.5 * _kl_terms(p32, m, eps) + 0.5 * _kl_terms(q32, m, eps)
    return terms.sum(-1).clamp_min(0)


def reference_cosine_drift(p: Tensor, q: Tensor) -> Tensor:
    """Cosine dissimilarity ``1 - <p,q> / (|p| |q|)`` of rows over the last dim (torch).

    Method: the cosine-dissimilarity drift of the paper's ablation.  Two all-zero rows give 0,
    exactly one all-zero row gives 1; the result is clamped to ``[0, 2]``.  Rows whose squared
    norm underflows fp32 count as zero rows.

    Args:
        p: ``[..., N]`` (fp32 / fp16 / bf16).
        q: ``[..., N]``, same shape.

    Returns:
        ``[...]`` fp32 in ``[0, 2]``; < 1e-6 where ``p == q``.
    """
    _check_pair(p, q)
    p32, q32 = p.float(), q.float()
    dot = (p32 * q32).sum(-1)
    pp = (p32 * p32).sum(-1)
    qq = (q32 * q32).sum(-1)
    denom = pp.sqrt() * qq.sqrt()
    both_zero = (pp == 0) & (qq == 0)
    cos = torch.where(denom > 0, dot / torch.where(denom > 0, denom, 1.0), both_zero.float())
    return (1.0 - cos).clamp(0.0, 2.0)


def reference_entropy(logits: Tensor) -> Tensor:
    """Entropy ``H = -sum_n s_n log s_n`` of ``s = softmax(logits)`` over the last dim (torch).

    Method: the "uncertainty" selection metric of the paper's ablation (the ``entropy`` drift metric,
    over attention rows; the EB-sampler commit rule's token entropies are computed apart, from the
    model's log-probabilities).  Computed stably as ``log S - sum(e z) / S`` with ``z = x - max x``,
    ``e = exp z``, ``S = sum e``; ``-inf`` logits contribute 0 and an all ``-inf`` row gives 0.
    ``+inf`` / NaN logits are not supported.

    Args:
        logits: ``[..., N]`` (fp32 / fp16 / bf16).

    Returns:
        ``[...]`` fp32 in ``[0, log N]``.
    """
    x = logits.float()
    m = x.amax(-1, keepdim=True)
    z = x - torch.where(torch.isfinite(m), m, 0.0)
    e = z.exp()
    s = e.sum(-1)
    t = (e * torch.where(e > 0, z, 0.0)).sum(-1)  # avoids 0 * -inf
    safe = torch.where(s > 0, s, 1.0)
    return torch.where(s > 0, safe.log() - t / safe, 0.0).clamp_min(0)


# ----------------------------------------------------------------------------- triton wrappers


def _rows(x: Tensor) -> Tensor:
    """View ``[..., N]`` as ``[R, N]`` with unit stride on the last dim (copies only if needed)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _block(n: int) -> int:
    return min(next_pow2(n), _MAX_BLOCK)


def _pair_rows_launch(kernel: Callable, p: Tensor, q: Tensor, *scalars: float) -> Tensor:
    """Launch a ``(p, q) -> [R]`` row kernel on ``[..., N]`` inputs; returns ``[...]`` fp32."""
    _check_pair(p, q)
    n = p.shape[-1]
    p2, q2 = _rows(p), _rows(q)
    out = torch.empty(p2.shape[0], dtype=torch.float32, device=p.device)
    if out.numel() > 0:
        kernel[(p2.shape[0],)](p2, q2, out, n, p2.stride(0), q2.stride(0), *scalars, BLOCK=_block(n))
    return out.reshape(p.shape[:-1])


# Opaque torch.library ops (see polestar.kernels._library); the fakes only allocate the output.


def _pair_fake(p: Tensor, q: Tensor, eps: float = DEFAULT_EPS) -> Tensor:
    _check_pair(p, q)
    return p.new_empty(p.shape[:-1], dtype=torch.float32)


def _cosine_fake(p: Tensor, q: Tensor) -> Tensor:
    return _pair_fake(p, q)


def _entropy_fake(logits: Tensor) -> Tensor:
    return logits.new_empty(logits.shape[:-1], dtype=torch.float32)


@register_op("kl_drift", fake=_pair_fake)
def _kl_drift_op(p: Tensor, q: Tensor, eps: float) -> Tensor:
    return _pair_rows_launch(_drift_kernels.kl_rows_kernel, p, q, eps)


@register_op("js_drift", fake=_pair_fake)
def _js_drift_op(p: Tensor, q: Tensor, eps: float) -> Tensor:
    return _pair_rows_launch(_drift_kernels.js_rows_kernel, p, q, eps)


@register_op("cosine_drift", fake=_cosine_fake)
def _cosine_drift_op(p: Tensor, q: Tensor) -> Tensor:
    return _pair_rows_launch(_drift_kernels.cosine_rows_kernel, p, q)


@register_op("entropy", fake=_entropy_fake)
def _entropy_op(logits: Tensor) -> Tensor:
    n = logits.shape[-1]
    x2 = _rows(logits)
    out = torch.empty(x2.shape[0], dtype=torch.float32, device=logits.device)
    if out.numel() > 0:
        _drift_kernels.entropy_rows_kernel[(x2.shape[0],)](x2, out, n, x2.stride(0), BLOCK=_block(n))
    return out.reshape(logits.shape[:-1])


def kl_drift_triton(p: Tensor, q: Tensor, eps: float = DEFAULT_EPS) -> Tensor:
    """Triton version of :func:`reference_kl_drift` (same signature, shapes and semantics).

    ``[..., N]`` inputs are flattened to ``[R, N]``; one program per row loops over ``N`` in
    ``BLOCK`` chunks.  Runs as the opaque op ``torch.ops.polestar.kl_drift``.  Returns ``[...]``
    fp32.
    """
    require_triton()
    _check_pair(p, q)
    return torch.ops.polestar.kl_drift(p, q, float(eps))


def js_drift_triton(p: Tensor, q: Tensor, eps: float = DEFAULT_EPS) -> Tensor:
    """Triton version of :func:`reference_js_drift`: ``[..., N], [..., N] -> [...]`` fp32.

    Runs as the opaque op ``torch.ops.polestar.js_drift``.
    """
    require_triton()
    _check_pair(p, q)
    return torch.ops.polestar.js_drift(p, q, float(eps))


def cosine_drift_triton(p: Tensor, q: Tensor) -> Tensor:
    """Triton version of :func:`reference_cosine_drift`: ``[..., N], [..., N] -> [...]`` fp32.

    Runs as the opaque op ``torch.ops.polestar.cosine_drift``.
    """
    require_triton()
    _check_pair(p, q)
    return torch.ops.polestar.cosine_drift(p, q)


def entropy_triton(logits: Tensor) -> Tensor:
    """Triton version of :func:`reference_entropy`: ``[..., N] -> [...]`` fp32 (two passes per row).

    Runs as the opaque op ``torch.ops.polestar.entropy``.
    """
    require_triton()
    return torch.ops.polestar.entropy(logits)


# ----------------------------------------------------------------------------- dispatchers

# "fused": what ``backend="auto"`` calls, one opaque op (the kernel on CUDA, the reference elsewhere)
_KL = {"reference": reference_kl_drift, "triton": kl_drift_triton,
       "fused": fused_op("kl_drift", _pair_fake, cuda=_kl_drift_op)(reference_kl_drift)}
_JS = {"reference": reference_js_drift, "triton": js_drift_triton,
       "fused": fused_op("js_drift", _pair_fake, cuda=_js_drift_op)(reference_js_drift)}
_COS = {"reference": reference_cosine_drift, "triton": cosine_drift_triton,
        "fused": fused_op("cosine_drift", _cosine_fake, cuda=_cosine_drift_op)(reference_cosine_drift)}
_ENT = {"reference": reference_entropy, "triton": entropy_triton,
        "fused": fused_op("entropy", _entropy_fake, cuda=_entropy_op)(reference_entropy)}


def kl_drift(p: Tensor, q: Tensor, eps: float = DEFAULT_EPS, backend: str = "auto") -> Tensor:
    """``KL(p || q)`` over the last dim: ``[..., N], [..., N] -> [...]`` fp32 (Polestar drift).

    ``backend``: ``"auto"`` (Triton on CUDA when available, else torch), ``"triton"`` or
    ``"reference"``.  See :func:`reference_kl_drift`.
    """
    return pick(_KL, backend, p, q)(p, q, eps)


def js_drift(p: Tensor, q: Tensor, eps: float = DEFAULT_EPS, backend: str = "auto") -> Tensor:
    """Jensen-Shannon drift over the last dim: ``[..., N], [..., N] -> [...]`` fp32.

    See :func:`reference_js_drift`; ``backend`` as in :func:`kl_drift`.
    """
    return pick(_JS, backend, p, q)(p, q, eps)


def cosine_drift(p: Tensor, q: Tensor, eps: float = DEFAULT_EPS, backend: str = "auto") -> Tensor:
    """Cosine dissimilarity over the last dim: ``[..., N], [..., N] -> [...]`` fp32.

    See :func:`reference_cosine_drift`.  ``eps`` is accepted (and ignored) so that the three
    drifts share one signature; ``backend`` as in :func:`kl_drift`.
    """
    del eps
    return pick(_COS, backend, p, q)(p, q)


def entropy(logits: Tensor, backend: str = "auto") -> Tensor:
    """Softmax entropy over the last dim: ``[..., N] -> [...]`` fp32 (uncertainty metric).

    See :func:`reference_entropy`; ``backend`` as in :func:`kl_drift`.
    """
    return pick(_ENT, backend, logits)(logits)


def head_mean_kl_drift(
    cur: Tensor, prev: Tensor, eps: float = DEFAULT_EPS, backend: str = "auto", head_dim: int = 1
) -> Tensor:
    """Per-head ``KL(A^t || A^{t-1})`` averaged over heads (Polestar drift, paper eq. for ``D_i``).

    Args:
        cur: ``[B, H, Q, K]`` attention probabilities at step ``t`` (rows sum to 1 over ``K``).
        prev: ``[B, H, Q, K]`` attention probabilities at step ``t-1``.
        eps: floor for probabilities inside ``log``.
        backend: ``"auto" | "triton" | "reference"``.
        head_dim: the heads axis of ``cur`` (1 for ``[B, H, Q, K]``).

    Returns:
        ``[B, Q]`` fp32 (in general: the input shape without ``head_dim`` and the last dim).
    """
    return kl_drift(cur, prev, eps, backend).mean(dim=head_dim)
