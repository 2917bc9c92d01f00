"""Batched spherical k-means for Polestar's per-layer clustering of window hidden states.

Polestar (Lee et al., 2026, ``shared/PAPER.md``, "Polestar-Cache") clusters, per layer, the
input hidden states of the local window with spherical k-means: cosine-similarity assignment,
a fixed number of iterations (5), *mean* centroids (the plain average of the members, not
re-normalised) and empty clusters reseeded.  Many groups (layers x sequences x window parts)
are clustered at once: ``x`` is ``[G, N, D]`` and every step is vectorised over ``G`` (no
Python loop over groups, no ``.item()`` / ``nonzero`` host syncs inside the iterations).

* Assignment (:func:`reference_kmeans_assign`, :func:`kmeans_assign_triton`): label =
  ``argmax_k cos(x_n, c_k)``, evaluated as ``argmax_k <x_n, c_k / |c_k|>`` in fp64 (dividing by
  ``|x_n| > 0`` does not change the argmax); ties go to the lowest cluster index.
* Update: centroid = mean of the valid members; a cluster that stays empty keeps its previous
  centroid.
* Reseeding: after each assignment, every empty cluster takes one of the points farthest
  (lowest cosine) from their assigned centroid, the most distant first; the closest member of
  every cluster is never taken, so reseeding never empties another cluster.  Hence when the
  number of valid points is ``>= k`` no cluster is empty on return.
* Init: ``k`` distinct (valid) points chosen at random with the given ``torch.Generator``.

The ``"chunks"`` ablation (contiguous groups instead of clusters) is :func:`chunk_clusters`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ._backend import HAS_TRITON, next_pow2, pick, require_triton
from ._library import register_op

if HAS_TRITON:
    from . import _kmeans_kernels

__all__ = [
    "HAS_TRITON",
    "KMeansResult",
    "chunk_clusters",
    "init_keys",
    "kmeans_assign",
    "kmeans_assign_triton",
    "reference_kmeans_assign",
    "reference_spherical_kmeans",
    "spherical_kmeans",
]

_TINY = 1e-30


class KMeansResult(NamedTuple):
    """Output of :func:`spherical_kmeans` (unpacks as ``centroids, labels, counts``).

    Attributes:
        centroids: ``[G, k, D]`` mean of each cluster's members, dtype of ``x``.
        labels: ``[G, N]`` int64 cluster index in ``[0, k)``; ``-1`` for invalid points.
        counts: ``[G, k]`` int64 number of valid members per cluster (sums to the valid count).
    """

    centroids: Tensor
    labels: Tensor
    counts: Tensor


AssignFn = Callable[[Tensor, Tensor, "Tensor | None"], Tensor]

# ----------------------------------------------------------------------------- assignment


def _unit_centroids(centroids: Tensor) -> Tensor:
    """``c / |c|`` in fp64 (zero centroids stay 0): ``[G, k, D] -> [G, k, D]`` fp64 contiguous."""
    c = centroids.double()
    return (c / c.norm(dim=-1, keepdim=True).clamp_min(_TINY)).contiguous()


def _mask_invalid(labels: Tensor, valid: Tensor | None) -> Tensor:
    return labels if valid is None else labels.masked_fill(~valid, -1)


def _check_assign_args(x: Tensor, centroids: Tensor) -> None:
    if x.dim() != 3 or centroids.dim() != 3:
        raise ValueError(
            f"expected x [G, N, D] and centroids [G, k, D], got {tuple(x.shape)}, {tuple(centroids.shape)}"
        )
    if x.shape[0] != centroids.shape[0] or x.shape[2] != centroids.shape[2]:
        raise ValueError(f"x {tuple(x.shape)} and centroids {tuple(centroids.shape)} disagree on G or D")


def _cosine_scores(x: Tensor, centroids: Tensor) -> Tensor:
    """``<x_n, c_k / |c_k|>`` in fp64: ``[G, N, D], [G, k, D] -> [G, N, k]``.

    One element-wise product and row sum per cluster (not a matmul): identical centroids then get
    bit-identical scores, so exact ties really are ties and resolve to the lowest index.
    """
    x64 = x.double()
    c_hat = _unit_centroids(centroids)
    return torch.stack([(x64 * c_hat[:, j, None, :]).sum(-1) for j in range(c_hat.shape[1])], dim=-1)


def reference_kmeans_assign(x: Tensor, centroids: Tensor, valid: Tensor | None = None) -> Tensor:
    """Cosine-similarity assignment of points to centroids (torch reference).

    Method: spherical k-means assignment step (Polestar-Cache clustering): label =
    ``argmax_k <x_n, c_k / |c_k|>`` computed in fp64, first (lowest) index on ties.  Scores are
    computed cluster by cluster (a Python loop over ``k``, not over groups).

    Args:
        x: ``[G, N, D]`` points (any float dtype).
        centroids: ``[G, k, D]`` centroids (need not be normalised).
        valid: optional ``[G, N]`` bool; invalid points get label ``-1``.

    Returns:
        ``[G, N]`` int64 labels.
    """
    _check_assign_args(x, centroids)
    return _mask_invalid(_cosine_scores(x, centroids).argmax(dim=-1), valid)


def _kmeans_assign_fake(x: Tensor, centroids: Tensor, valid: Tensor | None) -> Tensor:
    return x.new_empty(x.shape[:2], dtype=torch.int64)


@register_op("kmeans_assign", fake=_kmeans_assign_fake)
def _kmeans_assign_op(x: Tensor, centroids: Tensor, valid: Tensor | None) -> Tensor:
    """``polestar::kmeans_assign``: launches ``assign_kernel`` (arguments already checked)."""
    g, n, d = x.shape
    k = centroids.shape[1]
    xs = x if x.stride(-1) == 1 else x.contiguous()
    c_hat = _unit_centroids(centroids)
    out = torch.empty(g, n, dtype=torch.int64, device=x.device)
    if out.numel() > 0:
        block_n = min(next_pow2(n), 16)
        block_d = min(next_pow2(d), 256)
        grid = (g, -(-n // block_n))
        _kmeans_kernels.assign_kernel[grid](
            xs, c_hat, out, n, d, k, xs.stride(0), xs.stride(1), BLOCK_N=block_n, BLOCK_D=block_d
        )
    return _mask_invalid(out, valid)


def kmeans_assign_triton(x: Tensor, centroids: Tensor, valid: Tensor | None = None) -> Tensor:
    """Triton version of :func:`reference_kmeans_assign` (same signature and shapes).

    One program per (group, block of points); scores accumulate in fp64 and the running argmax
    uses a strict ``>`` so ties keep the lowest index.  Labels equal the reference exactly
    except for near-ties closer than fp64 summation rounding (~1e-16 relative).  Runs as the
    opaque op ``torch.ops.polestar.kmeans_assign``.

    Args:
        x: ``[G, N, D]``; centroids: ``[G, k, D]``; valid: optional ``[G, N]`` bool.

    Returns:
        ``[G, N]`` int64 labels (``-1`` for invalid points).
    """
    require_triton()
    _check_assign_args(x, centroids)
    return torch.ops.polestar.kmeans_assign(x, centroids, valid)


_ASSIGN: dict[str, AssignFn] = {"reference": reference_kmeans_assign, "triton": kmeans_assign_triton}


def kmeans_assign(x: Tensor, centroids: Tensor, valid: Tensor | None = None, backend: str = "auto") -> Tensor:
    """Cosine assignment ``[G, N, D], [G, k, D] -> [G, N]`` int64 labels (``-1`` if not ``valid``).

    ``backend``: ``"auto"`` (Triton on CUDA when available), ``"triton"`` or ``"reference"``.
    See :func:`reference_kmeans_assign`.
    """
    return pick(_ASSIGN, backend, x, centroids)(x, centroids, valid)


# ----------------------------------------------------------------------------- k-means steps


def init_keys(g: int, n: int, generator: torch.Generator | None, device: torch.device | str) -> Tensor:
    """Random keys ``[G, N]`` in ``[0, 1)`` choosing the initial points (drawn ahead of a compiled region)."""
    rand_device = generator.device if generator is not None else device
    return torch.rand(g, n, generator=generator, device=rand_device).to(device)


def _init_centroids(x: Tensor, k: int, valid: Tensor, generator: torch.Generator | None, keys: Tensor | None) -> Tensor:
    """``k`` distinct points per group, valid ones first, in random order: ``[G, k, D]`` fp32."""
    g, n, d = x.shape
    if keys is None:
        keys = init_keys(g, n, generator, x.device)
    elif keys.shape != (g, n):
        raise ValueError(f"keys must be [G, N] = {(g, n)}, got {tuple(keys.shape)}")
    keys = keys.masked_fill(~valid, -1.0)
    idx = keys.topk(k, dim=1).indices  # [G, k]
    return x.gather(1, idx.unsqueeze(-1).expand(g, k, d)).float()


def _one_hot(labels: Tensor, k: int) -> Tensor:
    """``[G, N]`` labels (``-1`` = none) -> ``[G, N, k]`` fp32 membership."""
    oh = F.one_hot(labels.clamp_min(0), k).float()
    return oh * (labels >= 0).unsqueeze(-1).float()


def _assigned_cosine(x: Tensor, centroids: Tensor, labels: Tensor) -> Tensor:
    """Cosine of each point to its assigned centroid: ``[G, N]`` fp32, ``+inf`` for label ``-1``."""
    g, n, d = x.shape
    c_hat = centroids / centroids.norm(dim=-1, keepdim=True).clamp_min(_TINY)
    x_hat = x / x.norm(dim=-1, keepdim=True).clamp_min(_TINY)
    own = c_hat.gather(1, labels.clamp_min(0).unsqueeze(-1).expand(g, n, d))
    cos = (x_hat * own).sum(-1)
    return cos.masked_fill(labels < 0, float("inf"))


def _closest_member_mask(cos: Tensor, labels: Tensor) -> Tensor:
    """``[G, N]`` bool: True for exactly one member (the most similar, lowest index on ties) per cluster."""
    by_cos = cos.argsort(dim=1, descending=True, stable=True)
    by_cluster = labels.gather(1, by_cos).argsort(dim=1, stable=True)
    perm = by_cos.gather(1, by_cluster)  # points sorted by cluster, then by cos descending
    lab = labels.gather(1, perm)
    first = torch.ones_like(lab, dtype=torch.bool)
    first[:, 1:] = lab[:, 1:] != lab[:, :-1]
    return torch.zeros_like(first).scatter(1, perm, first)


def _reseed_empty(x: Tensor, centroids: Tensor, labels: Tensor, k: int) -> Tensor:
    """Give every empty cluster one far point (lowest cosine to its centroid); ``[G, N]`` labels.

    The ``r``-th empty cluster (in index order) takes the ``r``-th farthest eligible point.
    Eligible: valid and not the closest member of its cluster.  Without enough eligible points
    the remaining clusters stay empty.
    """
    g, n, _ = x.shape
    counts = _one_hot(labels, k).sum(1)  # [G, k]
    empty = counts == 0
    cos = _assigned_cosine(x, centroids, labels)
    eligible = (labels >= 0) & ~_closest_member_mask(cos, labels)
    key = cos.masked_fill(~eligible, float("inf"))
    far_first = key.argsort(dim=1, stable=True)  # [G, N]
    rank = empty.long().cumsum(1) - 1  # [G, k]
    ok = empty & (rank < eligible.sum(1, keepdim=True))
    donor = far_first.gather(1, rank.clamp(0, n - 1))
    target = torch.where(ok, donor, torch.full_like(donor, n))  # column n is a scratch slot
    cluster = torch.arange(k, device=x.device).expand(g, k)
    padded = torch.cat([labels, labels.new_full((g, 1), -1)], dim=1)
    return padded.scatter(1, target, cluster)[:, :n]


def _update(x: Tensor, labels: Tensor, k: int, prev: Tensor) -> tuple[Tensor, Tensor]:
    """Mean centroids ``[G, k, D]`` fp32 (previous centroid where empty) and counts ``[G, k]`` int64."""
    oh = _one_hot(labels, k)  # [G, N, k]
    counts = oh.sum(1)
    sums = torch.bmm(oh.transpose(1, 2), x)
    means = sums / counts.clamp_min(1).unsqueeze(-1)
    return torch.where((counts > 0).unsqueeze(-1), means, prev), counts.long()


def _check_kmeans_args(x: Tensor, k: int, iters: int, valid: Tensor | None) -> Tensor:
    if x.dim() != 3:
        raise ValueError(f"x must be [G, N, D], got {tuple(x.shape)}")
    if not 1 <= k <= x.shape[1]:
        raise ValueError(f"need 1 <= k <= N, got k={k}, N={x.shape[1]}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if valid is None:
        return torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
    if valid.shape != x.shape[:2] or valid.dtype != torch.bool:
        raise ValueError(f"valid must be bool {tuple(x.shape[:2])}, got {valid.dtype} {tuple(valid.shape)}")
    return valid


def _spherical_kmeans(
    x: Tensor, k: int, iters: int, generator: torch.Generator | None, valid: Tensor | None, assign: AssignFn,
    keys: Tensor | None = None,
) -> KMeansResult:
    valid_mask = _check_kmeans_args(x, k, iters, valid)
    x32 = x.float()
    centroids = _init_centroids(x32, k, valid_mask, generator, keys)
    labels = counts = None
    for _ in range(iters):
        labels = assign(x32, centroids, valid_mask)
        labels = _reseed_empty(x32, centroids, labels, k)
        centroids, counts = _update(x32, labels, k, centroids)
    out_dtype = x.dtype if x.is_floating_point() else torch.float32
    return KMeansResult(centroids.to(out_dtype), labels, counts)


def reference_spherical_kmeans(
    x: Tensor,
    k: int,
    iters: int = 5,
    generator: torch.Generator | None = None,
    valid: Tensor | None = None,
    keys: Tensor | None = None,
) -> KMeansResult:
    """Batched spherical k-means with mean centroids (torch reference).

    Method: Polestar-Cache clustering (paper: cosine assignment, 5 iterations, mean centroids,
    empty clusters reseeded); see the module docstring for the exact rules.  Reproducible:
    the same ``generator`` state gives the same result.  Computation is fp32 (assignment fp64).

    Args:
        x: ``[G, N, D]`` points (G groups clustered independently, e.g. layers x sequences).
        k: clusters per group, ``1 <= k <= N``.
        iters: number of (assign, reseed, update) iterations, ``>= 1``.
        generator: ``torch.Generator`` for the initial points (global RNG if ``None``); it may
            live on another device than ``x``.
        valid: optional ``[G, N]`` bool; invalid points get label ``-1`` and are ignored.
        keys: optional ``[G, N]`` random keys from :func:`init_keys` (the ``k`` valid points with the largest
            keys start the clusters); given, ``generator`` is unused and the function draws no random numbers,
            so it can run inside a compiled graph.

    Returns:
        :class:`KMeansResult` ``(centroids [G, k, D] dtype of x, labels [G, N] int64,
        counts [G, k] int64)``; centroids are the means of the final labels' members.
    """
    return _spherical_kmeans(x, k, iters, generator, valid, reference_kmeans_assign, keys)


def spherical_kmeans(
    x: Tensor,
    k: int,
    iters: int = 5,
    generator: torch.Generator | None = None,
    valid: Tensor | None = None,
    backend: str = "auto",
    keys: Tensor | None = None,
) -> KMeansResult:
    """:func:`reference_spherical_kmeans` with the assignment step on the chosen ``backend``.

    Shapes as in :func:`reference_spherical_kmeans`: ``x [G, N, D]`` -> ``centroids [G, k, D]``,
    ``labels [G, N]``, ``counts [G, k]``.  ``backend``: ``"auto" | "triton" | "reference"``.
    """
    return _spherical_kmeans(x, k, iters, generator, valid, pick(_ASSIGN, backend, x), keys)


def chunk_clusters(n: int, k: int, device: torch.device | str | None = None) -> Tensor:
    """Contiguous equal-size groups for the paper's "chunks" ablation (no clustering).

    Point ``i`` gets label ``floor(i * k / n)``: ``k`` contiguous groups whose sizes differ by at
    most one (exactly ``n / k`` when ``k`` divides ``n``).

    Args:
        n: number of points, ``>= 1``.
        k: number of groups, ``1 <= k <= n``.
        device: device of the result.

    Returns:
        ``[n]`` int64 labels in ``[0, k)``, non-decreasing.
    """
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    return torch.arange(n, device=device) * k // n
