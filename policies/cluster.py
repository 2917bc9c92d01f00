"""Clusterers (kind ``cluster``): group the window's hidden states so one proxy query stands for many tokens.

``cluster(x [G, N, D], k, valid [G, N], generator, keys=None, k_valid=None) → (centroids [G, k, D], labels [G, N]
(-1 invalid), counts [G, k])``. ``keys [G, N]`` (from :func:`polestar.kernels.kmeans.init_keys`) replace the draws
from ``generator`` so that clustering can run inside a compiled graph; clusterers that need no randomness ignore
both. ``k_valid [G, k]`` bool (optional) disables clusters per group (a group with fewer clusters than ``k``):
a disabled cluster gets no member, count 0 and a zero centroid.
"""

from __future__ import annotations

import attrs
import torch

from polestar.kernels.kmeans import chunk_clusters, spherical_kmeans
from polestar.registry import register
from polestar.stages import Stage


class Clusterer(Stage):
    """Base of clusterers (kind ``cluster``), read by the ``polestar`` refresh selector to group the window's
    hidden states. ``needs_keys``: whether :meth:`cluster` consumes random ``keys [G, N]`` (drawn before the step).
    Example: ``docs/examples/cluster_stride.py``."""

    needs_keys = False

    def cluster(self, x, k, valid, generator, keys=None, k_valid=None):  # pragma: no cover - abstract
        """``x [G, N, D]``, ``k`` clusters, ``valid [G, N]`` bool → ``(centroids [G, k, D], labels [G, N] long in
        [-1, k) with -1 exactly at invalid positions, counts [G, k])``. ``keys [G, N]`` replace draws from
        ``generator``; ``k_valid [G, k]`` bool (optional) disables clusters per group (no member, count 0, zero
        centroid)."""
        raise NotImplementedError


@register("cluster", "kmeans")
class SphericalKMeans(Clusterer):
    """Spherical k-means (cosine assignment, mean centroids, ``iters`` iterations, empty clusters reseeded),
    seeded through a ``torch.Generator`` (Polestar, Lee et al. 2026). Shapes as in the module docstring."""

    @attrs.frozen
    class Config:
        iters: int = attrs.field(default=5, validator=attrs.validators.ge(1))

    needs_keys = True

    def cluster(self, x, k, valid, generator, keys=None, k_valid=None):
        return spherical_kmeans(x, k, self.config.iters, generator=generator, valid=valid, keys=keys, k_valid=k_valid)


@register("cluster", "chunks")
class ChunkClusters(Clusterer):
    """Ablation: ``k`` contiguous equal groups of a group's valid positions (``k_valid``: each group's own count),
    centroid = mean of the members. Shapes as in the module docstring."""

    @attrs.frozen
    class Config:
        pass

    def cluster(self, x, k, valid, generator, keys=None, k_valid=None):
        G, N, _ = x.shape
        if k_valid is None:
            labels = chunk_clusters(N, k, device=x.device).expand(G, N)
        else:  # each group's own cluster count, over its valid length: k_g contiguous groups of its columns
            k_g = k_valid.sum(dim=1, keepdim=True)
            n_g = valid.sum(dim=1, keepdim=True).clamp_min(1)
            col = valid.long().cumsum(dim=1) - 1
            labels = (col.clamp_min(0) * k_g).div(n_g, rounding_mode="floor")
        labels = torch.where(valid, labels, -1)
        onehot = torch.nn.functional.one_hot(labels.clamp_min(0), k).to(x.dtype) * valid[..., None]
        counts = onehot.sum(1)
        centroids = torch.einsum("gnk,gnd->gkd", onehot, x) / counts.clamp_min(1)[..., None]
        return centroids, labels, counts.long()
