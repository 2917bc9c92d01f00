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

from polestar.contracts import expect_tensor, fail
from polestar.kernels.kmeans import chunk_clusters, spherical_kmeans
from polestar.registry import register
from polestar.stage_kinds import StageKind, register_kind
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


def check_cluster(stage, out, x: torch.Tensor, k: int, valid: torch.Tensor, *_, **__) -> None:
    """``cluster(x [G, N, D], k, valid, ...)`` → ``(centroids [G, k, D], labels [G, N] in [-1, k), counts [G, k])``."""
    G, N, D = x.shape
    if not isinstance(out, tuple) or len(out) != 3:
        fail(stage, "cluster", out, "expected (centroids, labels, counts)")
    centroids, labels, counts = out
    expect_tensor(stage, "cluster", centroids, (G, k, D), "centroids [G, k, D]")
    expect_tensor(stage, "cluster", labels, (G, N), "labels [G, N]")
    expect_tensor(stage, "cluster", counts, (G, k), "counts [G, k]")
    if labels.is_floating_point() or ((labels < -1) | (labels >= k)).any():
        fail(stage, "cluster", out, f"labels must be integers in [-1, {k})")
    if ((labels >= 0) & ~valid).any():
        fail(stage, "cluster", out, "an invalid position got a cluster label (expected -1)")


def cluster_examples(gen: torch.Generator, n: int):
    """``n`` clusterings ``(x [G, N, D], k, valid [G, N], seed)`` of random sizes, every other one with a padded
    tail in every group (at least ``k`` positions left)."""
    for i in range(n):
        g, m, d = (int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((1, 3), (2, 17), (2, 9)))
        k = int(torch.randint(1, m + 1, (1,), generator=gen))
        valid = torch.ones(g, m, dtype=torch.bool)
        if i % 2:
            valid[:, max(k, m - int(torch.randint(0, m, (1,), generator=gen))):] = False
        yield torch.randn(g, m, d, generator=gen), k, valid, i


def cluster_laws(stage: Clusterer, x: torch.Tensor, k: int, valid: torch.Tensor, seed: int) -> None:
    """Counts that match the labels, and the same result for the same generator seed."""

    def run():
        gen = torch.Generator().manual_seed(seed)
        keys = torch.rand(x.shape[0], x.shape[1], generator=gen) if stage.needs_keys else None
        return stage.cluster(x, k, valid, gen, keys)

    centroids, labels, counts = run()
    onehot = torch.nn.functional.one_hot(labels.clamp_min(0).long(), k) * (labels >= 0)[..., None]
    assert torch.equal(onehot.sum(1).to(counts.dtype), counts), f"cluster stage {stage.name!r}: counts do not " \
        "match the labels"
    again = run()
    assert all(torch.equal(a, b) for a, b in zip((centroids, labels, counts), again)), (
        f"cluster stage {stage.name!r} is not deterministic for a fixed generator seed")


CLUSTER = register_kind(StageKind(
    "cluster", Clusterer, "groups the window's hidden states so one proxy query stands for many tokens",
    contract={"cluster": check_cluster}, examples=cluster_examples, laws=cluster_laws, default="kmeans"))


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
