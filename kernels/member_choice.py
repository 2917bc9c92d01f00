"""Polestar-Cache's member choice and centroid shift at one layer of a sparse-update step, as single operations.

Polestar ("Polestar: Drift-Aware Cache Calibration and Token Commitment", section "Polestar-Cache") recomputes, at
each layer of an update step, the window positions of the most drifting clusters, and after the update shifts each
cluster's centroid by its members' mean change. Written as torch code each is some twenty small operations per
layer; here each is one operation (:func:`polestar.kernels._library.fused_op`: a Triton kernel on CUDA, the torch
reference elsewhere), so an uncompiled step launches one kernel for it and a compiler traces one node.

* :func:`cluster_members`: the clusters' drift ranking (:func:`cluster_ranks`, drifts compared on a grid of
  :data:`DRIFT_RESOLUTION`, ties to the lower cluster index, empty clusters last), the ``k`` best-ranked non-empty
  clusters of the rows due for an update, and their window members gathered into a fixed-capacity buffer
  (:func:`to_capacity`, the best-ranked clusters first, window order within a cluster).
* :func:`centroid_shift`: each cluster's mean change of its members, to be added to its centroid.

Shapes: ``K`` clusters, ``Nw`` window columns, ``M`` member slots, ``d`` model width.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._backend import HAS_TRITON, pick, require_triton
from ._library import fused_op

if HAS_TRITON:
    from . import _member_kernels

__all__ = [
    "DRIFT_RESOLUTION",
    "centroid_shift",
    "cluster_members",
    "cluster_ranks",
    "reference_centroid_shift",
    "reference_cluster_members",
    "to_capacity",
    "top_ranked",
]

#: drifts are ranked on a grid of this step: differences below it are rounding noise (they change with the
#: batch's matmul shapes and with a compiler's fusion), and a tie goes to the lower cluster index
DRIFT_RESOLUTION = 2.0**-20


def cluster_ranks(drift: Tensor, counts: Tensor) -> Tensor:
    """Rank of each cluster by drift, 0 = most drifting, empty clusters last: ``drift, counts [B, K]`` → long
    ``[B, K]``. Drifts are compared on a grid of :data:`DRIFT_RESOLUTION`; ties go to the lower cluster index."""
    scores = torch.round(drift.float() / DRIFT_RESOLUTION).masked_fill(counts == 0, float("-inf"))
    return scores.argsort(dim=1, descending=True, stable=True).argsort(dim=1)


def top_ranked(ranks: Tensor, counts: Tensor, k: int) -> Tensor:
    """The ``k`` best-ranked non-empty clusters of each row, from their :func:`cluster_ranks` ``ranks [B, K]``:
    bool ``[B, K]``. A larger ``k`` always selects a superset."""
    return (ranks < min(k, ranks.shape[1])) & (counts > 0)


def to_capacity(member: Tensor, priority: Tensor, capacity: int, trash: int) -> tuple[Tensor, Tensor]:
    """Gather the chosen rows into a fixed-capacity buffer.

    ``member [B, N]`` bool, ``priority [B, N]`` (lower first; ties keep column order) → ``rows [B, capacity]`` long
    (``trash`` in unused slots) and ``valid [B, capacity]`` bool. When more than ``capacity`` rows are chosen, the
    ones with the largest priority are left out."""
    key = priority.masked_fill(~member, torch.iinfo(torch.long).max)
    order = key.argsort(dim=1, stable=True)[:, :capacity]
    valid = member.gather(1, order)
    return torch.where(valid, order, trash), valid


def check_member_args(drift: Tensor, counts: Tensor, labels: Tensor, window_valid: Tensor, due: Tensor,
                      capacity: int) -> None:
    """Validate the arguments of :func:`cluster_members` (``ValueError`` naming the mismatch)."""
    b, k = drift.shape
    if counts.shape != (b, k) or labels.dim() != 2 or labels.shape[0] != b:
        raise ValueError(f"expected drift, counts [B, K] and labels [B, Nw]; got {tuple(drift.shape)}, "
                         f"{tuple(counts.shape)}, {tuple(labels.shape)}")
    if window_valid.shape != labels.shape or window_valid.dtype != torch.bool:
        raise ValueError(f"window_valid must be bool {tuple(labels.shape)}, got {window_valid.dtype} "
                         f"{tuple(window_valid.shape)}")
    if due.shape != (b,) or due.dtype != torch.bool:
        raise ValueError(f"due must be bool ({b},), got {due.dtype} {tuple(due.shape)}")
    if not 0 <= capacity <= labels.shape[1]:
        raise ValueError(f"capacity must lie in [0, {labels.shape[1]}] (the window's columns), got {capacity}")


def reference_cluster_members(drift: Tensor, counts: Tensor, labels: Tensor, window_valid: Tensor, due: Tensor,
                              k: int, capacity: int, trash: int) -> tuple[Tensor, Tensor, Tensor]:
    """Polestar's member choice at one layer (torch reference).

    Args:
        drift: ``[B, K]`` fp32 each cluster's drift.
        counts: ``[B, K]`` long members per cluster (0: an empty cluster, never chosen).
        labels: ``[B, Nw]`` long each window column's cluster (-1: none).
        window_valid: ``[B, Nw]`` bool window columns holding a token.
        due: ``[B]`` bool rows updating at this step (the others choose nothing).
        k: clusters chosen per row; capacity: member slots ``M`` (≤ ``Nw``); trash: the row index of unused slots.

    Returns:
        ``rows [B, M]`` long window columns (``trash`` where unused), ``valid [B, M]`` bool, ``chosen [B, K]`` bool.
        Members are ordered by their cluster's rank, then by column.
    """
    rank = cluster_ranks(drift, counts)
    chosen = top_ranked(rank, counts, k) & due[:, None]
    label = labels.clamp_min(0)
    member = window_valid & (labels >= 0) & chosen.gather(1, label)
    rows, valid = to_capacity(member, rank.gather(1, label), capacity, trash)
    return rows, valid, chosen


def _members_fake(drift: Tensor, counts: Tensor, labels: Tensor, window_valid: Tensor, due: Tensor, k: int,
                  capacity: int, trash: int) -> tuple[Tensor, Tensor, Tensor]:
    b = drift.shape[0]
    return (labels.new_empty((b, capacity)), window_valid.new_empty((b, capacity)),
            counts.new_empty(drift.shape, dtype=torch.bool))


def _members_launch(drift: Tensor, counts: Tensor, labels: Tensor, window_valid: Tensor, due: Tensor, k: int,
                    capacity: int, trash: int) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the member-choice kernel: one program per batch row (see :mod:`._member_kernels`)."""
    return _member_kernels.cluster_members(drift, counts, labels, window_valid, due, k, capacity, trash)


def cluster_members_triton(drift: Tensor, counts: Tensor, labels: Tensor, window_valid: Tensor, due: Tensor,
                           k: int, capacity: int, trash: int) -> tuple[Tensor, Tensor, Tensor]:
    """Triton version of :func:`reference_cluster_members` (same signature and results, bit for bit: integer
    comparisons only)."""
    require_triton()
    check_member_args(drift, counts, labels, window_valid, due, capacity)
    return _members_launch(drift, counts, labels, window_valid, due, k, capacity, trash)


_MEMBERS = {"reference": reference_cluster_members, "triton": cluster_members_triton,
            "fused": fused_op("cluster_members", _members_fake, cuda=_members_launch)(reference_cluster_members)}


def cluster_members(drift: Tensor, counts: Tensor, labels: Tensor, window_valid: Tensor, due: Tensor, k: int,
                    capacity: int, trash: int, backend: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """Polestar's member choice (:func:`reference_cluster_members`): → ``rows, valid [B, M]``, ``chosen [B, K]``.
    ``backend``: ``"auto"`` (one operation: the kernel on CUDA, the reference elsewhere), ``"triton"`` or
    ``"reference"``."""
    check_member_args(drift, counts, labels, window_valid, due, capacity)
    return pick(_MEMBERS, backend, drift)(drift, counts, labels, window_valid, due, int(k), int(capacity),
                                          int(trash))


def reference_centroid_shift(labels: Tensor, counts: Tensor, rows: Tensor, valid: Tensor, new: Tensor, old: Tensor,
                             dtype: torch.dtype) -> Tensor:
    """Each cluster's mean change of its updated members (torch reference).

    Args:
        labels: ``[B, Nw]`` long the window columns' clusters (-1: none); counts: ``[B, K]`` cluster sizes.
        rows: ``[B, M]`` long updated window columns (``≥ Nw``: the trash row, ignored); valid: ``[B, M]`` bool.
        new, old: ``[B, M, d]`` the members' new and previous layer inputs.
        dtype: the result's dtype (the centroids').

    Returns:
        ``[B, K, d]``: ``Σ_{valid members m of k} (new_m − old_m) / max(count_k, 1)`` in ``old``'s dtype, cast to
        ``dtype``.
    """
    lab = labels.gather(1, rows.clamp(max=labels.shape[1] - 1))
    keep = (valid & (lab >= 0))[..., None].to(old.dtype)
    onehot = torch.nn.functional.one_hot(lab.clamp_min(0), counts.shape[1]).to(old.dtype) * keep
    delta = torch.einsum("bmk,bmd->bkd", onehot, new.to(old.dtype) - old)
    return (delta / counts.clamp_min(1)[..., None].to(old.dtype)).to(dtype)


def _shift_fake(labels: Tensor, counts: Tensor, rows: Tensor, valid: Tensor, new: Tensor, old: Tensor,
                dtype: torch.dtype) -> Tensor:
    return old.new_empty((counts.shape[0], counts.shape[1], old.shape[-1]), dtype=dtype)


def _shift_launch(labels: Tensor, counts: Tensor, rows: Tensor, valid: Tensor, new: Tensor, old: Tensor,
                  dtype: torch.dtype) -> Tensor:
    """Launch the centroid-shift kernel: one program per (batch row, cluster) (see :mod:`._member_kernels`)."""
    return _member_kernels.centroid_shift(labels, counts, rows, valid, new, old, dtype)


def centroid_shift_triton(labels: Tensor, counts: Tensor, rows: Tensor, valid: Tensor, new: Tensor, old: Tensor,
                          dtype: torch.dtype) -> Tensor:
    """Triton version of :func:`reference_centroid_shift` (same signature; sums in fp32, in member order)."""
    require_triton()
    return _shift_launch(labels, counts, rows, valid, new, old, dtype)


_SHIFT = {"reference": reference_centroid_shift, "triton": centroid_shift_triton,
          "fused": fused_op("centroid_shift", _shift_fake, cuda=_shift_launch)(reference_centroid_shift)}


def centroid_shift(labels: Tensor, counts: Tensor, rows: Tensor, valid: Tensor, new: Tensor, old: Tensor,
                   dtype: torch.dtype, backend: str = "auto") -> Tensor:
    """Polestar's centroid shift (:func:`reference_centroid_shift`) → ``[B, K, d]`` in ``dtype``; ``backend`` as
    in :func:`cluster_members`."""
    if new.shape != old.shape or rows.shape != valid.shape or new.shape[:2] != rows.shape:
        raise ValueError(f"expected rows, valid [B, M] and new, old [B, M, d]; got {tuple(rows.shape)}, "
                         f"{tuple(valid.shape)}, {tuple(new.shape)}, {tuple(old.shape)}")
    return pick(_SHIFT, backend, new)(labels, counts, rows, valid, new, old, dtype)
