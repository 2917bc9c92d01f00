"""Data parallelism on ``torch.distributed`` for ``polestar bench`` and the lm-eval model.

A process learns its place from an initialised default process group, or from the variables every launcher sets
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``: ``torchrun``, ``accelerate launch``),
in which case :func:`init_from_env` starts the group (``nccl`` when the device is CUDA, else ``gloo``). A single
process without those variables is rank 0 of 1 and never touches ``torch.distributed``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


def env_world_size() -> int:
    """``WORLD_SIZE`` set by the launcher (1 when absent)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_from_env(device: str | torch.device = "cpu") -> tuple[int, int]:
    """Join the launcher's process group when there is one; return ``(rank, world_size)``.

    Uses an already initialised default group as it is. Otherwise, with ``WORLD_SIZE`` > 1 in the environment,
    initialises it with ``nccl`` for a CUDA ``device`` and ``gloo`` otherwise.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if env_world_size() <= 1:
        return 0, 1
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        raise ValueError("WORLD_SIZE > 1 but RANK / MASTER_ADDR are not set; start the run with "
                         "`torchrun --nproc-per-node N ...` (or `accelerate launch`), not by setting WORLD_SIZE alone")
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size()


def local_device(device: str | torch.device) -> torch.device:
    """``device`` for this process: a bare ``cuda`` becomes ``cuda:LOCAL_RANK`` under a launcher."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and "LOCAL_RANK" in os.environ:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return device


def is_distributed() -> bool:
    """Whether a process group with more than one process is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` without a process group)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    if is_distributed():
        dist.barrier()


def shard(count: int, rank: int, world_size: int) -> list[int]:
    """Indices ``0..count-1`` this rank owns: ``rank, rank + world_size, ...`` (round robin, so shards differ in
    length by at most one)."""
    return list(range(rank, count, world_size))


def shutdown() -> None:
    """Leave the process group, if one is running (end of a ``torchrun`` command)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
