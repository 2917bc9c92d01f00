"""Batched spherical k-means for Polestar's per-layer clustering of window hidden states.

Method: the Polestar-Cache clustering of *Polestar: Drift-Aware Cache Calibration and Token
Commitment* (Lee et al., 2026).  Per layer, the input hidden states of the local window are
clustered with spherical k-means: cosine assignment, a fixed number of iterations (5), mean
centroids, empty clusters reseeded (8 clusters per layer: 5 for the prefix part of the window, 3
for the suffix part).  The paper fixes only these points; the exact rules below are this
implementation's.

Shapes: ``x [G, N, D]`` (``G`` groups clustered independently, e.g. sequences x window parts),
optional ``valid [G, N]`` bool, ``keys [G, N]``, ``k_valid [G, k]`` bool ->
``centroids [G, k, D]``, ``labels [G, N]`` int64 (``-1`` for invalid points), ``counts [G, k]``
int64.  Every step is vectorised over ``G`` with fixed shapes: no Python loop over groups or
clusters, no host syncs (``.item()``, ``nonzero``, boolean-mask indexing), no data-dependent
shapes and no Python branch on tensor values, so a whole call traces with
``torch.compile(fullgraph=True)``.

* Invalid points (``valid`` False) are ignored: their values are treated as zero, they get label
  ``-1`` and are never counted.
* Disabled clusters (``k_valid`` False) never receive a point: count 0, zero centroid.  Groups can
  thus have different numbers of clusters in one call, e.g. a 5-cluster prefix part and a
  3-cluster suffix part stacked as groups padded to the same ``N`` (``valid`` False on padding),
  ``k = 5`` and clusters 3 and 4 disabled in the suffix groups.  Every group needs at least one
  enabled cluster.
* Init: the enabled clusters, in index order, start at the valid points with the largest
  ``keys``, in decreasing key order (distinct points; ``keys`` from :func:`init_keys`, or drawn
  from ``generator``).  When a group has fewer valid points than enabled clusters, the remaining
  enabled clusters start at zero.
* Assignment: label = ``argmax_k cos(x_n, c_k)`` over the enabled clusters, evaluated as
  ``<x_n, c_k / |c_k|>`` (dividing by ``|x_n|`` does not change the argmax) by one fp32 ``bmm``.
  Ties go to the lowest cluster index: ``max`` keeps the first maximum, and a cluster whose unit
  centroid equals that of a lower-indexed enabled cluster bit for bit is skipped (the ``bmm`` does
  not give identical columns bit-identical scores).  With ``backend="triton"`` the assignment is
  :func:`kmeans_assign_triton` (fp64).
* Reseeding, after every assignment: the ``r``-th empty enabled cluster (in index order) takes the
  ``r``-th farthest eligible point, farthest = lowest cosine to its assigned centroid (one
  ``topk`` over ``[G, N]``, no sort; equal cosines come in ``topk``'s order).  Eligible: valid and
  not the closest member (highest cosine, lowest index on ties) of its cluster.  As every
  non-empty cluster keeps its closest member, reseeding never empties a cluster, so when a group
  has at least as many valid points as enabled clusters no enabled cluster is empty on return.
* Update: centroid = mean of the members (the plain average, not re-normalised); an empty
  cluster's centroid is zero (possible only with fewer valid points than enabled clusters).  The
  iterations carry the member sums, whose direction is the mean's.

The standalone assignment op (:func:`reference_kmeans_assign`, :func:`kmeans_assign_triton`,
:func:`kmeans_assign`) evaluates the same argmax in fp64, cluster by cluster, so exact ties are
ties; it agrees with the fp32 ``bmm`` assignment except for near-ties within fp32 rounding.

The ``"chunks"`` ablation (contiguous groups instead of clusters) is :func:`chunk_clusters`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ._backend import HAS_TRITON, next_pow2, pick, require_triton, resolve_backend
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
        centroids: ``[G, k, D]`` mean of each cluster's members (zero if none), dtype of ``x``.
        labels: ``[G, N]`` int64 cluster index in ``[0, k)``; ``-1`` for invalid points.
        counts: ``[G, k]`` int64 number of valid members per cluster (sums to the valid count).
    """

    centroids: Tensor
    labels: Tensor
    counts: Tensor


_INF = float("inf")

# ----------------------------------------------------------------------------- assignment (fp64 op)


def _unit_centroids(centroids: Tensor) -> Tensor:
    """``c / |c|`` in fp64 (zero centroids stay 0): ``[G, k, D] -> [G, k, D]`` fp64 contiguous."""
    c = centroids.double()
    return (c / c.norm(dim=-1, keepdim=True).clamp_min(_TINY)).contiguous()


def _mask_invalid(labels: Tensor, valid: Tensor | None) -> Tensor:
    return labels if valid is None else labels.masked_fill(~valid, -1)


def _check_assign_args(x: Tensor, centroids: Tensor, k_valid: Tensor | None = None) -> None:
    if x.dim() != 3 or centroids.dim() != 3:
        raise ValueError(
            f"expected x [G, N, D] and centroids [G, k, D], got {tuple(x.shape)}, {tuple(centroids.shape)}"
        )
    if x.shape[0] != centroids.shape[0] or x.shape[2] != centroids.shape[2]:
        raise ValueError(f"x {tuple(x.shape)} and centroids {tuple(centroids.shape)} disagree on G or D")
    _check_k_valid(k_valid, centroids.shape[0], centroids.shape[1])


def _check_k_valid(k_valid: Tensor | None, g: int, k: int) -> None:
    if k_valid is not None and (k_valid.shape != (g, k) or k_valid.dtype != torch.bool):
        raise ValueError(
            f"k_valid must be bool [G, k] = {(g, k)}, got {k_valid.dtype} {tuple(k_valid.shape)}"
        )


def _cosine_scores(x: Tensor, centroids: Tensor) -> Tensor:
    """``<x_n, c_k / |c_k|>`` in fp64: ``[G, N, D], [G, k, D] -> [G, N, k]``.

    One element-wise product and row sum per cluster (not a matmul): identical centroids then get
    bit-identical scores, so exact ties really are ties and resolve to the lowest index.
    """
    x64 = x.double()
    c_hat = _unit_centroids(centroids)
    return torch.stack([(x64 * c_hat[:, j, None, :]).sum(-1) for j in range(c_hat.shape[1])], dim=-1)


def reference_kmeans_assign(
    x: Tensor, centroids: Tensor, valid: Tensor | None = None, *, k_valid: Tensor | None = None
) -> Tensor:
    """Cosine-similarity assignment of points to centroids (torch reference, fp64).

    Method: spherical k-means assignment step (Polestar-Cache clustering): label =
    ``argmax_k <x_n, c_k / |c_k|>`` over the enabled clusters, computed in fp64, first (lowest)
    index on ties.  Scores are computed cluster by cluster (a Python loop over ``k``, not over
    groups), so identical centroids get bit-identical scores.

    Args:
        x: ``[G, N, D]`` points (any float dtype).
        centroids: ``[G, k, D]`` centroids (need not be normalised).
        valid: optional ``[G, N]`` bool; invalid points get label ``-1``.
        k_valid: optional ``[G, k]`` bool; disabled clusters never win (every group needs one
            enabled cluster).

    Returns:
        ``[G, N]`` int64 labels.
    """
    _check_assign_args(x, centroids, k_valid)
    scores = _cosine_scores(x, centroids)
    if k_valid is not None:
        scores = scores.masked_fill(~k_valid[:, None, :], -_INF)
    return _mask_invalid(scores.argmax(dim=-1), valid)


def _kmeans_assign_fake(
    x: Tensor, centroids: Tensor, valid: Tensor | None, k_valid: Tensor | None = None
) -> Tensor:
    return x.new_empty(x.shape[:2], dtype=torch.int64)


@register_op("kmeans_assign", fake=_kmeans_assign_fake)
def _kmeans_assign_op(
    x: Tensor, centroids: Tensor, valid: Tensor | None, k_valid: Tensor | None = None
) -> Tensor:
    """``polestar::kmeans_assign``: launches ``assign_kernel`` (arguments already checked)."""
    g, n, d = x.shape
    k = centroids.shape[1]
    xs = x if x.stride(-1) == 1 else x.contiguous()
    c_hat = _unit_centroids(centroids)
    kv = c_hat if k_valid is None else k_valid.to(torch.int8).contiguous()  # dummy pointer when absent
    out = torch.empty(g, n, dtype=torch.int64, device=x.device)
    if out.numel() > 0:
        block_n = min(next_pow2(n), 16)
        block_d = min(next_pow2(d), 256)
        grid = (g, -(-n // block_n))
        _kmeans_kernels.assign_kernel[grid](
            xs,
            c_hat,
            kv,
            out,
            n,
            d,
            k,
            xs.stride(0),
            xs.stride(1),
            HAS_KV=k_valid is not None,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
        )
    return _mask_invalid(out, valid)


def kmeans_assign_triton(
    x: Tensor, centroids: Tensor, valid: Tensor | None = None, *, k_valid: Tensor | None = None
) -> Tensor:
    """Triton version of :func:`reference_kmeans_assign` (same signature and shapes).

    One program per (group, block of points); scores accumulate in fp64 and the running argmax
    uses a strict ``>`` over the enabled clusters, so ties keep the lowest index.  Labels equal
    the reference exactly except for near-ties closer than fp64 summation rounding (~1e-16
    relative).  Runs as the opaque op ``torch.ops.polestar.kmeans_assign``.

    Args:
        x: ``[G, N, D]``; centroids: ``[G, k, D]``; valid: optional ``[G, N]`` bool;
        k_valid: optional ``[G, k]`` bool (disabled clusters never win).

    Returns:
        ``[G, N]`` int64 labels (``-1`` for invalid points).
    """
    require_triton()
    _check_assign_args(x, centroids, k_valid)
    return torch.ops.polestar.kmeans_assign(x, centroids, valid, k_valid)


_ASSIGN = {"reference": reference_kmeans_assign, "triton": kmeans_assign_triton}


def kmeans_assign(
    x: Tensor,
    centroids: Tensor,
    valid: Tensor | None = None,
    backend: str = "auto",
    *,
    k_valid: Tensor | None = None,
) -> Tensor:
    """Cosine assignment ``[G, N, D], [G, k, D] -> [G, N]`` int64 labels (``-1`` if not ``valid``).

    ``backend``: ``"auto"`` (Triton on CUDA when available), ``"triton"`` or ``"reference"``.
    See :func:`reference_kmeans_assign`.
    """
    return pick(_ASSIGN, backend, x, centroids)(x, centroids, valid, k_valid=k_valid)


# ----------------------------------------------------------------------------- k-means


def init_keys(g: int, n: int, generator: torch.Generator | None, device: torch.device | str) -> Tensor:
    """Random keys ``[G, N]`` in ``[0, 1)`` choosing the initial points (drawn ahead of a compiled region)."""
    rand_device = generator.device if generator is not None else device
    return torch.rand(g, n, generator=generator, device=rand_device).to(device)


def _check_kmeans_args(
    x: Tensor, k: int, iters: int, valid: Tensor | None, keys: Tensor | None, k_valid: Tensor | None
) -> None:
    if x.dim() != 3:
        raise ValueError(f"x must be [G, N, D], got {tuple(x.shape)}")
    g, n, _ = x.shape
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= N, got k={k}, N={n}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if valid is not None and (valid.shape != (g, n) or valid.dtype != torch.bool):
        raise ValueError(f"valid must be bool {(g, n)}, got {valid.dtype} {tuple(valid.shape)}")
    if keys is not None and keys.shape != (g, n):
        raise ValueError(f"keys must be [G, N] = {(g, n)}, got {tuple(keys.shape)}")
    _check_k_valid(k_valid, g, k)


def _initial_sums(x: Tensor, k: int, invalid: Tensor | None, keys: Tensor, k_valid: Tensor | None) -> Tensor:
    """Starting points ``[G, k, D]``: enabled clusters take the valid points with the largest keys, in order.

    ``x`` may carry extra (zero) rows after the ``N`` points of ``keys``; they are never picked.
    """
    g, _, d = x.shape
    if invalid is not None:
        keys = keys.masked_fill(invalid, -_INF)  # invalid points come last (and are zero vectors)
    top = keys.topk(k, dim=1).indices  # [G, k], decreasing key
    if k_valid is not None:
        top = top.gather(1, k_valid.cumsum(1) - k_valid.long())  # rank among the enabled clusters
    start = x.gather(1, top[..., None].expand(g, k, d))
    return start if k_valid is None else start * k_valid[..., None]


def _spherical_kmeans(
    x: Tensor,
    k: int,
    iters: int,
    generator: torch.Generator | None,
    valid: Tensor | None,
    keys: Tensor | None,
    k_valid: Tensor | None,
    use_triton: bool,
) -> KMeansResult:
    """The loop of the module docstring; Python branches only on argument presence and ``use_triton``.

    Two zero scratch points are appended to every group (``N``: the "no donor" sentinel, lowest
    reseeding key; ``N + 1``: the "closest member" of every empty cluster), so reseeding needs no
    padding, sorting or conditional writes: one ``topk`` yields the sentinel first and then the
    farthest points, and a single ``scatter`` moves the donors (non-reseeded clusters write to
    the sentinel).  All loop constants are built once per call.
    """
    _check_kmeans_args(x, k, iters, valid, keys, k_valid)
    g, n, d = x.shape
    dev = x.device
    if keys is None:
        keys = init_keys(g, n, generator, dev)
    scratch = torch.ones(g, 2, dtype=torch.bool, device=dev)
    invalid_pts = None if valid is None else ~valid
    invalid = torch.cat(
        (torch.zeros(g, n, dtype=torch.bool, device=dev) if valid is None else invalid_pts, scratch), 1
    )
    x32 = F.pad(x.float(), (0, 0, 0, 2)).masked_fill_(invalid[..., None], 0.0)  # [G, N + 2, D]
    sums = _initial_sums(x32, k, invalid_pts, keys.to(dev), k_valid)  # [G, k, D], direction of c

    # loop constants
    ar_k = torch.arange(k, device=dev)
    clusters = ar_k.expand(g, k)
    norm = x32.norm(dim=-1).clamp_min(_TINY)  # [G, N + 2]: cos = score / |x|
    cos_bias = torch.zeros(g, n + 2, device=dev).masked_fill_(invalid, _INF)  # invalid: never a donor
    cos_bias[:, n] = -_INF  # the sentinel comes first in the topk
    non_member = torch.full((g, n + 2, k), -_INF, device=dev)
    non_member[:, n + 1] = -2.0  # below any cosine: the closest "member" of an empty cluster
    shadow = torch.ones(k, k, dtype=torch.bool, device=dev).tril(-1)  # [j, i]: i < j, i shadows j
    if k_valid is not None:  # only enabled clusters shadow; a disabled cluster shadows itself
        eye = torch.eye(k, dtype=torch.bool, device=dev)
        shadow = (shadow & k_valid[:, None, :]) | (eye & ~k_valid[:, :, None])

    labels = onehot = None
    for _ in range(iters):
        # assignment -> raw labels and the score of the assigned cluster
        c_hat = sums / sums.norm(dim=-1, keepdim=True).clamp_min(_TINY)
        if use_triton:
            lab = kmeans_assign_triton(x32, sums, k_valid=k_valid)
            best = (x32 * c_hat.gather(1, lab.unsqueeze(-1).expand(g, n + 2, d))).sum(-1)
        else:
            same = torch.eq(c_hat.unsqueeze(2), c_hat.unsqueeze(1)).all(-1)  # [G, k, k] exact duplicates
            drop = same.logical_and_(shadow).any(-1)  # duplicates of earlier clusters, disabled clusters
            best, lab = torch.bmm(x32, c_hat.mT).masked_fill_(drop.unsqueeze(1), -_INF).max(dim=-1)
        labels = lab.masked_fill(invalid, -1)
        member = labels.unsqueeze(-1) == ar_k  # [G, N + 2, k]

        # reseeding: r-th empty enabled cluster <- r-th farthest point that is not its cluster's closest
        cos = torch.addcdiv(cos_bias, best, norm)
        closest = torch.where(member, cos.unsqueeze(-1), non_member).argmax(dim=1)  # [G, k]
        far_cos, far = cos.scatter(1, closest, _INF).topk(k + 1, dim=1, largest=False)  # far[:, 0] = n
        present = member.any(dim=1)
        empty = present.logical_not_() if k_valid is None else k_valid > present
        donors = far.masked_fill_(far_cos == _INF, n)  # not enough eligible points: no donor
        target = donors.gather(1, empty.cumsum(1) * empty)  # [G, k]; n for the other clusters
        labels = labels.scatter_(1, target, clusters)

        # update: member sums (their direction is the mean's)
        onehot = (labels.unsqueeze(-1) == ar_k).float()
        sums = torch.bmm(onehot.mT, x32)

    counts = onehot[:, :n].sum(1)
    centroids = sums / counts.clamp_min(1.0).unsqueeze(-1)
    out_dtype = x.dtype if x.is_floating_point() else torch.float32
    return KMeansResult(centroids.to(out_dtype), labels[:, :n].contiguous(), counts.long())


def reference_spherical_kmeans(
    x: Tensor,
    k: int,
    iters: int = 5,
    generator: torch.Generator | None = None,
    valid: Tensor | None = None,
    keys: Tensor | None = None,
    *,
    k_valid: Tensor | None = None,
) -> KMeansResult:
    """Batched spherical k-means with mean centroids (pure torch).

    Method: Polestar-Cache clustering (paper: cosine assignment, 5 iterations, mean centroids,
    empty clusters reseeded); see the module docstring for the exact rules.  Computation is fp32;
    no host syncs and fixed shapes, so it compiles with ``torch.compile(fullgraph=True)``.
    Reproducible: the same ``keys`` (or ``generator`` state) give the same result.

    Args:
        x: ``[G, N, D]`` points (G groups clustered independently, e.g. sequences x window parts).
        k: clusters per group, ``1 <= k <= N`` (with ``k_valid``: the largest count, ``k_max``).
        iters: number of (assign, reseed, update) iterations, ``>= 1``.
        generator: ``torch.Generator`` for the initial points when ``keys`` is not given (global
            RNG if ``None``); it may live on another device than ``x``.
        valid: optional ``[G, N]`` bool; invalid points (e.g. padding) get label ``-1``, are
            ignored and may hold any values.
        keys: optional ``[G, N]`` random keys from :func:`init_keys` (the enabled clusters start
            at the valid points with the largest keys); given, ``generator`` is unused and no
            random numbers are drawn, so the call can run inside a compiled graph.
        k_valid: optional ``[G, k]`` bool, keyword only: the enabled clusters of each group
            (``None``: all).  Disabled clusters get count 0 and a zero centroid.

    Returns:
        :class:`KMeansResult` ``(centroids [G, k, D] dtype of x, labels [G, N] int64,
        counts [G, k] int64)``; centroids are the means of the final labels' members (zero for
        empty clusters).
    """
    return _spherical_kmeans(x, k, iters, generator, valid, keys, k_valid, use_triton=False)


def spherical_kmeans(
    x: Tensor,
    k: int,
    iters: int = 5,
    generator: torch.Generator | None = None,
    valid: Tensor | None = None,
    backend: str = "auto",
    keys: Tensor | None = None,
    *,
    k_valid: Tensor | None = None,
) -> KMeansResult:
    """:func:`reference_spherical_kmeans` with the assignment step on the chosen ``backend``.

    Shapes as in :func:`reference_spherical_kmeans`: ``x [G, N, D]`` (``valid``, ``keys``
    ``[G, N]``, ``k_valid [G, k]``) -> ``centroids [G, k, D]``, ``labels [G, N]``,
    ``counts [G, k]``.  ``backend``: ``"auto"`` (Triton on CUDA when available), ``"triton"``
    (assignment by :func:`kmeans_assign_triton`, fp64) or ``"reference"`` (fp32 ``bmm``).
    """
    use_triton = resolve_backend(backend, x) == "triton"
    return _spherical_kmeans(x, k, iters, generator, valid, keys, k_valid, use_triton=use_triton)


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
