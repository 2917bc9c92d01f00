"""Head-mean drift of attention rows fused with the in-place keep of the rows due for an update.

Polestar (Lee et al., 2026, "Polestar: Drift-Aware Cache Calibration and Token Commitment") measures the drift of
a row at step ``t`` as the per-head ``KL(A^t || A^{t-1})`` of its attention distribution, averaged over heads
(:func:`polestar.kernels.drift.head_mean_kl_drift`; JS and cosine dissimilarity are the ablation's alternatives).
A sparse-update step then keeps the current attention as the next step's "previous" one in the batch entries due
for an update.  :func:`drift_keep` does both in one operation: one Triton kernel on CUDA
(:mod:`polestar.kernels._drift_keep_kernels`), the torch reference elsewhere, one opaque
``torch.ops.polestar_fused.drift_keep`` node either way (:func:`polestar.kernels._library.fused_op`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._backend import HAS_TRITON, next_pow2, pick, require_triton
from ._library import fused_op
from .drift import DEFAULT_EPS, reference_cosine_drift, reference_js_drift, reference_kl_drift

if HAS_TRITON:
    from . import _drift_keep_kernels

__all__ = ["DEFAULT_EPS", "HAS_TRITON", "METRICS", "drift_keep", "drift_keep_triton", "reference_drift_keep"]

METRICS = {"kl": 0, "js": 1, "cosine": 2}
"""Divergence of :func:`drift_keep`, by name: the ``metric`` integer it takes."""

_MAX_BLOCK = 2048

# indexed by metric: [..., N], [..., N], eps -> [...] fp32
_DIVERGENCES = (reference_kl_drift, reference_js_drift, lambda p, q, eps: reference_cosine_drift(p, q))


def _check(cur: Tensor, prev: Tensor, due: Tensor, metric: int) -> None:
    if cur.dim() != 4 or prev.shape != cur.shape:
        raise ValueError(f"cur and prev must both be [B, H, R, N], got {tuple(cur.shape)} and {tuple(prev.shape)}")
    if cur.dtype != torch.float32 or prev.dtype != torch.float32:
        raise ValueError(f"cur and prev must be float32, got {cur.dtype} and {prev.dtype}")
    if due.dtype != torch.bool or due.shape != cur.shape[:1]:
        raise ValueError(f"due must be bool [B] with B={cur.shape[0]}, got {due.dtype} {tuple(due.shape)}")
    if metric not in METRICS.values():
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")


def reference_drift_keep(cur: Tensor, prev: Tensor, due: Tensor, metric: int, eps: float) -> Tensor:
    """Head-mean drift of ``cur`` against ``prev``, then ``prev := cur`` in the batch entries due (torch reference).

    Args:
        cur: ``[B, H, R, N]`` fp32 attention rows at step ``t``.
        prev: ``[B, H, R, N]`` fp32 attention rows at step ``t-1``; written in place: ``prev[b] = cur[b]`` where
            ``due[b]``, untouched elsewhere.
        due: ``[B]`` bool, the batch entries due for an update.
        metric: ``0`` KL, ``1`` JS, ``2`` cosine (:data:`METRICS`; see :mod:`polestar.kernels.drift`).
        eps: floor for probabilities inside ``log`` (ignored by cosine).

    Returns:
        ``[B, R]`` fp32: the per-head divergence of ``cur`` from the *old* ``prev``, averaged over heads.
    """
    d = _DIVERGENCES[metric](cur, prev, eps).mean(dim=1)
    torch.where(due[:, None, None, None], cur, prev, out=prev)
    return d


def _fake(cur: Tensor, prev: Tensor, due: Tensor, metric: int, eps: float) -> Tensor:
    return cur.new_empty((cur.shape[0], cur.shape[2]), dtype=torch.float32)


def _launch(cur: Tensor, prev: Tensor, due: Tensor, metric: int, eps: float) -> Tensor:
    """Launch the drift-keep kernel, one program per ``(b, r)``; writes ``prev``, returns ``[B, R]`` fp32."""
    b, h, r, n = cur.shape
    out = torch.empty((b, r), dtype=torch.float32, device=cur.device)
    if out.numel() > 0:
        due8 = due.view(torch.uint8)
        _drift_keep_kernels.drift_keep_kernel[(b * r,)](
            cur, prev, due8, out, h, r, n, *cur.stride(), *prev.stride(), due8.stride(0), float(eps),
            METRIC=int(metric), BLOCK=min(next_pow2(n), _MAX_BLOCK),
        )  # fmt: skip
    return out


def drift_keep_triton(cur: Tensor, prev: Tensor, due: Tensor, metric: int, eps: float) -> Tensor:
    """Triton version of :func:`reference_drift_keep` (same signature; one kernel, fp32 sums in chunk order, so the
    drift matches to rounding and ``prev`` exactly)."""
    require_triton()
    _check(cur, prev, due, metric)
    return _launch(cur, prev, due, metric, eps)


_DRIFT_KEEP = {"reference": reference_drift_keep, "triton": drift_keep_triton,
               "fused": fused_op("drift_keep", _fake, cuda=_launch, mutates_args=("prev",))(reference_drift_keep)}


def drift_keep(cur: Tensor, prev: Tensor, due: Tensor, metric: int | str, eps: float = DEFAULT_EPS,
               backend: str = "auto") -> Tensor:
    """Polestar's head-mean drift ``[B, H, R, N] x2 -> [B, R]`` fp32, keeping ``prev := cur`` where ``due`` [B].

    See :func:`reference_drift_keep`.  ``metric``: an int or a name of :data:`METRICS`.  ``backend``: ``"auto"``
    (one operation: the kernel on CUDA, the reference elsewhere), ``"triton"`` or ``"reference"``.  Raises
    ``ValueError`` on mismatched shapes / dtypes or an unknown metric.
    """
    metric = METRICS[metric] if isinstance(metric, str) and metric in METRICS else metric
    _check(cur, prev, due, metric)
    return pick(_DRIFT_KEEP, backend, cur)(cur, prev, due, int(metric), float(eps))
