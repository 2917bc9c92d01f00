"""A clusterer (kind ``cluster``): interleaved groups, position ``i`` of a group's valid positions in cluster
``i mod k``.

Contract: ``cluster(x [G, N, D], k, valid [G, N], generator, keys=None, k_valid=None)`` returns
``(centroids [G, k, D], labels [G, N], counts [G, k])``: ``labels`` in ``[-1, k)`` with -1 exactly at invalid
positions, ``counts`` the members per cluster. ``needs_keys = True`` asks for random ``keys [G, N]`` drawn before
the step (a clusterer never draws inside it); ``k_valid [G, k]`` (optional) disables clusters per group.
Consumer: the ``polestar`` refresh selector (policies ``polestar``, ``polestar-cache``).
"""

import attrs
import torch

import polestar
from polestar.policies.cluster import Clusterer
from polestar.testing import check_stage


@polestar.register("cluster", "stride")
class StrideClusters(Clusterer):
    """Valid position number ``j`` of each group goes to cluster ``j mod k`` (for a disabled cluster, ``j mod
    k_g`` with the group's own count ``k_g``); centroids are the members' means. Shapes as in the module docstring."""

    @attrs.frozen
    class Config:
        pass

    def cluster(self, x, k, valid, generator, keys=None, k_valid=None):
        order = valid.long().cumsum(dim=1) - 1  # [G, N] rank among the valid positions
        per_group = k_valid.sum(dim=1, keepdim=True) if k_valid is not None else torch.full_like(order[:, :1], k)
        labels = torch.where(valid, order.clamp_min(0) % per_group.clamp_min(1), -1)
        onehot = torch.nn.functional.one_hot(labels.clamp_min(0), k).to(x.dtype) * valid[..., None]
        counts = onehot.sum(1)
        centroids = torch.einsum("gnk,gnd->gkd", onehot, x) / counts.clamp_min(1)[..., None]
        return centroids, labels, counts.long()


if __name__ == "__main__":
    check_stage("cluster", "stride", ["contract", "laws"])
    model = polestar.load("tiny-llada")
    out = polestar.generate(model, ["3+4*2-5"], task="arith", policy="polestar", cluster="stride")
    print(out.texts[0], out.pipeline.describe()["cluster"])
