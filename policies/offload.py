"""Offloaders (kind ``offload``): where stored window members live and how they are fetched back.

The interface is by rows (:class:`~polestar.policies.row_store.RowStore`): ``alloc(like)`` allocates, once,
storage for a tuple of leaves ``[B, N, ...]`` (initialized to ``like``'s values);
``read_rows(stored, rows [B, M], device)`` → leaves ``[B, M, ...]`` on ``device``;
``write_rows(stored, rows [B, M], leaves [B, M, ...])`` scatters rows in place. Rows are long indices along dim 1; a
read or write never syncs the host with the device.

``compilable``: whether ``read_rows`` / ``write_rows`` can be captured in a CUDA graph with the rest of the step
(when False, a pipeline's steps on CUDA run as Python, uncaptured; the layer regions still compile).
"""

from __future__ import annotations

import attrs
import torch

from polestar.contracts import fail
from polestar.registry import register
from polestar.stage_kinds import StageKind, register_kind
from polestar.stages import Stage


def _row_index(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``rows [B, M]`` → index ``[B, M, *like.shape[2:]]`` for ``gather`` / ``scatter_`` along dim 1."""
    b, m = rows.shape
    return rows.view(b, m, *([1] * (like.dim() - 2))).expand(b, m, *like.shape[2:])


def gather_rows(buf: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``buf [B, N, ...]``, ``rows [B, M]`` long in ``[0, N)`` → ``buf[b, rows[b, m]]`` as ``[B, M, ...]``."""
    return buf.gather(1, _row_index(rows.to(buf.device), buf))


def scatter_rows_(buf: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """In place ``buf[b, rows[b, m]] = src[b, m]`` (``buf [B, N, ...]``, ``rows [B, M]``, ``src [B, M, ...]``).

    Rows repeated within a sequence get one of their sources (unspecified which): only a trash row may repeat.
    """
    buf.scatter_(1, _row_index(rows.to(buf.device), src), src.to(buf.device))


class Offloader(Stage):
    """Where stored rows live (see the module docstring for both interfaces and every shape)."""

    compilable: bool = True
    #: the stored leaves are tensors on the compute device, ``alloc`` returns them as a tuple and rows are read and
    #: written with :func:`gather_rows` / :func:`scatter_rows_` (checked by the laws), so fused row operations may
    #: read and write them directly
    resident: bool = False

    def alloc(self, like: tuple[torch.Tensor, ...]):  # pragma: no cover - abstract
        raise NotImplementedError

    def read_rows(self, stored, rows: torch.Tensor, device) -> tuple[torch.Tensor, ...]:  # pragma: no cover
        raise NotImplementedError

    def write_rows(self, stored, rows: torch.Tensor, leaves: tuple[torch.Tensor, ...]) -> None:  # pragma: no cover
        raise NotImplementedError


def check_rows(stage, out, stored, rows: torch.Tensor, device) -> None:
    """``read_rows(stored, rows [B, M], device)`` → tuple of ``[B, M, ...]`` tensors."""
    if not isinstance(out, tuple) or not all(isinstance(t, torch.Tensor) for t in out):
        fail(stage, "read_rows", out, "expected a tuple of tensors [B, M, ...]")
    for leaf in out:
        if tuple(leaf.shape[:2]) != tuple(rows.shape):
            fail(stage, "read_rows", out, f"every leaf must start with the rows' shape {list(rows.shape)}")


def offload_examples(gen: torch.Generator, n: int):
    """``n`` row writes ``(leaves, rows [B, M], values)``: leaves ``[B, N, 4]`` float and ``[B, N, 2]`` uint8,
    distinct rows per sequence, values ``[B, M, ...]`` to write there."""
    for _ in range(n):
        b, size, m = (int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((1, 3), (2, 9), (1, 3)))
        m = min(m, size)
        leaves = (torch.randn(b, size, 4, generator=gen),
                  torch.randint(0, 255, (b, size, 2), generator=gen).to(torch.uint8))
        rows = torch.stack([torch.randperm(size, generator=gen)[:m] for _ in range(b)])
        values = (torch.randn(b, m, 4, generator=gen), torch.randint(0, 255, (b, m, 2), generator=gen).to(torch.uint8))
        yield leaves, rows, values


def offload_laws(stage: Offloader, leaves, rows: torch.Tensor, values) -> None:
    """``alloc(leaves)``, ``write_rows(rows, values)`` then ``read_rows(rows)`` gives the values back; unwritten
    rows keep ``leaves``' values."""
    stored = stage.alloc(tuple(leaves))
    stage.write_rows(stored, rows, tuple(values))
    back = stage.read_rows(stored, rows, leaves[0].device)
    assert all(torch.equal(a, b) for a, b in zip(back, values)), f"offload stage {stage.name!r} read back other " \
        "values than it wrote"
    others = torch.ones(leaves[0].shape[:2], dtype=torch.bool).scatter_(1, rows, False)
    keep = torch.stack([torch.arange(leaves[0].shape[1])[o] for o in others]) if others.any() else None
    if keep is not None and keep.shape[1] > 0:
        kept = stage.read_rows(stored, keep, leaves[0].device)
        assert all(torch.equal(a, gather_rows(b, keep)) for a, b in zip(kept, leaves)), (
            f"offload stage {stage.name!r} changed rows it was not asked to write")
    if stage.resident:  # the stored leaves are the tensors themselves, holding what was written
        assert isinstance(stored, tuple) and all(isinstance(t, torch.Tensor) for t in stored), (
            f"offload stage {stage.name!r} is declared resident but alloc did not return a tuple of tensors")
        expect = tuple(t.clone() for t in leaves)
        for e, v in zip(expect, values):
            scatter_rows_(e, rows, v)
        assert all(torch.equal(a, b) for a, b in zip(stored, expect)), (
            f"offload stage {stage.name!r} is declared resident but its stored tensors do not hold the rows written")


OFFLOAD = register_kind(StageKind(
    "offload", Offloader, "where stored window rows live and how they are fetched back",
    contract={"read_rows": check_rows}, examples=offload_examples, laws=offload_laws, default="none"))


@register("offload", "none")
class NoOffload(Offloader):
    """Members stay on the compute device: ``alloc`` clones the leaves ``[B, N, ...]`` there, rows are gathered and
    scattered in place. Capturable in a CUDA graph."""

    compilable = True
    resident = True

    @attrs.frozen
    class Config:
        pass

    def alloc(self, like):
        return tuple(t.clone() for t in like)

    def read_rows(self, stored, rows, device):
        return tuple(gather_rows(t, rows) for t in stored)

    def write_rows(self, stored, rows, leaves):
        for buf, src in zip(stored, leaves):
            scatter_rows_(buf, rows, src)


class _Staged:
    """Host staging of one pending row write: ``rows [B, M]`` long and ``leaves [B, M, ...]`` (pinned with CUDA)."""

    __slots__ = ("leaves", "rows")

    def __init__(self, rows: torch.Tensor, leaves: tuple[torch.Tensor, ...], pin: bool):
        self.rows = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=pin)
        self.leaves = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in leaves)


class HostRows:
    """The host side of one stored tree (the ``stored`` object of :class:`CPUOffload`; per-store state).

    ``host``: the leaves ``[B, N, ...]`` in host memory, pinned when CUDA is available, allocated once.
    ``staging``: per write width ``M``, pinned buffers a device→host row write lands in (allocated on first use).
    ``pending``: the staged write not yet applied to ``host``; ``event``: a CUDA event (created once, None on a
    CPU-only machine) recorded after the pending write's device→host copies; ``recorded``: whether it was.
    """

    __slots__ = ("event", "host", "pending", "pin", "recorded", "staging")

    def __init__(self, host: tuple[torch.Tensor, ...], pin: bool):
        self.host, self.pin = host, pin
        self.staging: dict[tuple, _Staged] = {}
        self.pending: _Staged | None = None
        self.event = torch.cuda.Event() if pin else None
        self.recorded = False

    def flush(self) -> None:
        """Apply the pending write to ``host``: wait for its copies (the only host wait), then scatter the rows.

        The event was recorded after the write's device→host copies, which the stream ordered after every earlier
        host→device read of ``host``, so those reads are done too before ``host`` changes.
        """
        staged, self.pending = self.pending, None
        if staged is None:
            return
        if self.recorded:
            self.event.synchronize()
            self.recorded = False
        for buf, src in zip(self.host, staged.leaves):
            scatter_rows_(buf, staged.rows, src)


@register("offload", "cpu")
class CPUOffload(Offloader):
    """Members kept in CPU memory (pinned when CUDA is present), copied with ``non_blocking=True`` (Polestar's system
    design: the window's stored inputs live off the device).

    Rows: ``alloc(like)`` allocates the host leaves ``[B, N, ...]`` once (a :class:`HostRows`). ``write_rows`` copies
    the rows ``[B, M]`` and leaves ``[B, M, ...]`` into preallocated pinned staging buffers without blocking, records a
    CUDA event and returns; the host-side scatter is applied lazily, right before the next read or write of the same
    storage, waiting on the event only then. ``read_rows`` copies the host leaves to the device (``non_blocking``)
    and gathers the rows there: the rows are chosen on the device, and reading them on the host would sync. On a
    CPU-only machine the same path runs (CPU→CPU copies) and values equal ``none``'s. Not capturable in a CUDA graph
    (``compilable = False``: host buffers, events and a lazy host-side scatter), so on CUDA the steps of a pipeline
    with this offloader run uncaptured (the layer regions still compile).
    """

    compilable = False

    @attrs.frozen
    class Config:
        pass

    def alloc(self, like):
        pin = torch.cuda.is_available()
        host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t) for t in like)
        return HostRows(host, pin)

    def read_rows(self, stored: HostRows, rows, device):
        stored.flush()
        return tuple(gather_rows(h.to(device, non_blocking=True), rows) for h in stored.host)

    def write_rows(self, stored: HostRows, rows, leaves):
        stored.flush()  # the staging buffers may still hold the previous write
        key = tuple(rows.shape)
        staged = stored.staging.get(key)
        if staged is None:
            staged = stored.staging[key] = _Staged(rows, leaves, stored.pin)
        staged.rows.copy_(rows, non_blocking=True)
        for dst, src in zip(staged.leaves, leaves):
            dst.copy_(src, non_blocking=True)
        if rows.is_cuda and stored.event is not None:
            stored.event.record()
            stored.recorded = True
        stored.pending = staged
