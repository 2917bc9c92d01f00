"""Offloaders (kind ``offload``): where stored window members live and how they are fetched back.

``put(tree)`` stores a (possibly quantized) tensor tree, ``fetch(stored, device)`` brings it back for compute.
"""

from __future__ import annotations

import attrs
import torch

from polestar.registry import register
from polestar.stages import Stage


def _map(fn, tree):
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_map(fn, v) for v in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(_map(fn, v) for v in tree)
    return tree


class Offloader(Stage):
    def put(self, tree):  # pragma: no cover - abstract
        raise NotImplementedError

    def fetch(self, stored, device):  # pragma: no cover - abstract
        raise NotImplementedError


@register("offload", "none")
class NoOffload(Offloader):
    """Members stay on the compute device."""

    @attrs.frozen
    class Config:
        pass

    def put(self, tree):
        return tree

    def fetch(self, stored, device):
        return stored


@register("offload", "cpu")
class CPUOffload(Offloader):
    """Members kept in CPU memory (pinned when CUDA is present) and copied back asynchronously
    (``non_blocking``) when a sparse update needs them (Polestar's system design). On a CPU-only machine the
    copies are no-ops and tokens are identical to ``none``."""

    @attrs.frozen
    class Config:
        pass

    def put(self, tree):
        pin = torch.cuda.is_available()

        def to_cpu(t):
            # a device-to-host copy, synchronous on CUDA: the price of keeping members off the device (paid at a
            # block start and at each sparse update that rewrites members)
            t = t.detach().to("cpu", copy=True)
            return t.pin_memory() if pin else t

        return _map(to_cpu, tree)

    def fetch(self, stored, device):
        return _map(lambda t: t.to(device, non_blocking=True), stored)
