"""A preallocated, row-addressable store of per-layer window rows, kept through a quantizer and an offloader.

The sparse refresh (Polestar-Cache, Lee et al. 2026; Elastic-Cache; dLLM-Cache) keeps, per layer, the input hidden
states of the ``n_rows`` window positions of each sequence and rewrites a few of them per step. Every quant stage
encodes rows independently (:mod:`polestar.policies.quant`), so a write re-encodes only the rows it changes and every
other row keeps its encoded bytes.
"""

from __future__ import annotations

import torch

from polestar.models.layer_regions import StageRegion

from .offload import gather_rows


class RowStore:
    """Per-layer rows ``[B, n_rows, dim]`` stored encoded by ``quant`` in ``offload``'s storage.

    Method: each layer holds the quantizer's leaves (:meth:`Quantizer.to_leaves`), each ``[B, n_rows + 1, k]``,
    allocated once here through ``offload.alloc``; row ``n_rows`` is a trash row that absorbs the writes of invalid
    slots, so writes have a static shape. Lossy quantizers (``quant.lossless`` False) store ``value − anchor`` when
    :meth:`write_all` is given an anchor (Polestar stores NVFP4 residuals to the block-start centroid of each member's
    cluster); the anchor is copied into a preallocated ``[B, n_rows + 1, dim]`` buffer on the compute device whose
    trash row stays 0. Lossless quantizers store the values and ignore anchors.

    Shapes: ``values [B, n_rows, dim]`` (:meth:`write_all`); ``rows [B, M]`` long in ``[0, n_rows]``, ``valid [B, M]``
    bool, ``values [B, M, dim]`` (:meth:`write`); :meth:`read` → ``[B, M, dim]``, :meth:`read_all` →
    ``[B, n_rows, dim]``, both in ``dtype`` on ``device``. Within a sequence the valid rows of one :meth:`write` must
    be distinct.

    No host syncs in :meth:`read` / :meth:`write`; with ``offload.compilable`` they trace under
    ``torch.compile(fullgraph=True)``. This object is per-generation state (one per generation, never on a stage).
    """

    def __init__(self, quant, offload, n_layers: int, batch: int, n_rows: int, dim: int, device, dtype):
        self.quant, self.offload = quant, offload
        self.n_layers, self.batch, self.n_rows, self.dim = n_layers, batch, n_rows, dim
        self.device, self.dtype = torch.device(device), dtype
        zeros = torch.zeros(batch, n_rows + 1, dim, device=self.device, dtype=dtype)
        like = tuple(t.contiguous() for t in quant.to_leaves(quant.encode(zeros)))
        lossy = not quant.lossless
        #: every layer's leaves stacked (``[n_layers, B, n_rows + 1, k]`` each) and the anchors (``[n_layers, B,
        #: n_rows + 1, dim]``, lossy quantizers) where the rows stay on the device: ``stored`` and ``anchor`` are
        #: their rows (a scan over layers reads and writes back the stacks); None elsewhere
        self.stacked: tuple[torch.Tensor, ...] | None = None
        self.anchor_stack: torch.Tensor | None = None
        if offload.on_device:
            self.stacked = tuple(t.expand(n_layers, *t.shape).clone() for t in offload.alloc(like))
            self.stored = [tuple(t[layer] for t in self.stacked) for layer in range(n_layers)]
            if lossy:
                self.anchor_stack = zeros.expand(n_layers, *zeros.shape).clone()
            self.anchor = list(self.anchor_stack.unbind(0)) if lossy else [None] * n_layers
        else:
            self.stored = [offload.alloc(like) for _ in range(n_layers)]
            self.anchor = [torch.zeros_like(zeros) if lossy else None for _ in range(n_layers)]
        self.anchored = [False] * n_layers
        self._all_rows = torch.arange(n_rows, device=self.device).expand(batch, n_rows)
        #: :meth:`read` as stage regions (plain, anchored) where the quantizer and offloader are the package's own
        #: traceable stages (a compiled step compiles one read for every layer); else None (read in the step)
        self._readers = (tuple(_row_reader(quant, offload, dim, dtype, self.device, a) for a in (False, True))
                         if _traceable(quant, offload) else None)

    def write_all(self, layer: int, values: torch.Tensor, anchor: torch.Tensor | None = None) -> None:
        """Store every row of ``layer``: ``values [B, n_rows, dim]``; ``anchor [B, n_rows, dim]`` or None (see the
        class docstring: lossy quantizers store ``values − anchor``, and later writes are residuals to it too)."""
        payload = values.to(self.dtype)
        self.anchored[layer] = anchor is not None and not self.quant.lossless
        if self.anchored[layer]:
            kept = self.anchor[layer][:, : self.n_rows]
            kept.copy_(anchor)
            payload = payload - kept
        self._put(layer, self._all_rows, payload)

    def written_all(self, stored: tuple[torch.Tensor, ...], kept: torch.Tensor | None, values: torch.Tensor,
                    anchor: torch.Tensor | None) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
        """:meth:`write_all` as a pure function of one layer's ``stored`` leaves and anchor buffer ``kept
        [B, n_rows + 1, dim]`` (None for a lossless store) → the new leaves and anchor buffer (for a layer region;
        the caller sets the layer's ``anchored`` flag as :meth:`write_all` does)."""
        payload = values.to(self.dtype)
        if anchor is not None and not self.quant.lossless:
            first = anchor.to(kept.dtype)
            kept = torch.cat([first, kept[:, self.n_rows:]], dim=1)
            payload = payload - first
        rows = torch.arange(self.n_rows, device=payload.device).expand(payload.shape[0], -1)
        return self.offload.with_rows(stored, rows, self.quant.to_leaves(self.quant.encode(payload.contiguous()))), kept

    def read(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Decode rows ``rows [B, M]`` (long in ``[0, n_rows]``; ``n_rows`` is the trash row, meaningless values) of
        ``layer`` → ``[B, M, dim]`` in ``dtype`` on the compute device. Only those rows are gathered and decoded."""
        stored = self.stored[layer]
        if self._readers is not None:
            if self.anchored[layer]:
                return self._readers[1](rows, self.anchor[layer], *stored)
            return self._readers[0](rows, *stored)
        return _read_rows(self.quant, self.offload, self.dim, self.dtype, self.device, rows,
                          self.anchor[layer] if self.anchored[layer] else None, stored)

    def write(self, layer: int, rows: torch.Tensor, valid: torch.Tensor, values: torch.Tensor) -> None:
        """Re-encode and store ``values [B, M, dim]`` at ``rows [B, M]`` where ``valid [B, M]``; invalid slots go to
        the trash row, so every other row keeps its encoded bytes."""
        rows, leaves = self._encoded(rows, valid, values, self.anchor[layer] if self.anchored[layer] else None)
        self.offload.write_rows(self.stored[layer], rows, leaves)

    def written(self, stored: tuple[torch.Tensor, ...], anchor: torch.Tensor | None, rows: torch.Tensor,
                valid: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """:meth:`write` as a pure function of one layer's ``stored`` leaves (and its ``anchor [B, n_rows + 1, dim]``
        where the layer is anchored, else None): → the new leaves, nothing written in place (for a layer region,
        which may not write its inputs). Only for an offloader that keeps rows on the device
        (:attr:`~polestar.policies.offload.Offloader.on_device`)."""
        rows, leaves = self._encoded(rows, valid, values, anchor)
        return self.offload.with_rows(stored, rows, leaves)

    def _encoded(self, rows, valid, values, anchor):
        """Rows to write (invalid ones sent to the trash row) and the leaves of ``values`` encoded (residuals to
        ``anchor`` where given)."""
        rows = torch.where(valid, rows, self.n_rows)
        payload = values.to(self.dtype)
        if anchor is not None:
            payload = payload - gather_rows(anchor, rows)
        return rows, self.quant.to_leaves(self.quant.encode(payload.contiguous()))

    def read_leaves(self, stored: tuple[torch.Tensor, ...], anchor: torch.Tensor | None,
                    rows: torch.Tensor) -> torch.Tensor:
        """:meth:`read` of one layer's ``stored`` leaves given as tensors (with its ``anchor`` where the layer is
        anchored, else None) → ``[B, M, dim]``: for a layer region, which takes the leaves as arguments."""
        return _read_rows(self.quant, self.offload, self.dim, self.dtype, self.device, rows, anchor, stored)

    def read_all(self, layer: int) -> torch.Tensor:
        """Every row of ``layer`` decoded: ``[B, n_rows, dim]`` (for tests and debugging)."""
        return self.read(layer, self._all_rows)

    def _put(self, layer: int, rows: torch.Tensor, payload: torch.Tensor) -> None:
        leaves = self.quant.to_leaves(self.quant.encode(payload.contiguous()))
        self.offload.write_rows(self.stored[layer], rows, leaves)

    @property
    def regional(self) -> bool:
        """Whether this store's reads and writes may run inside a layer region: the package's own traceable stages,
        rows kept on the device (:meth:`written`)."""
        return self._readers is not None and self.offload.on_device


def _read_rows(quant, offload, dim: int, dtype, device, rows: torch.Tensor, anchor: torch.Tensor | None,
               stored) -> torch.Tensor:
    """Rows ``rows [B, M]`` of one layer's ``stored`` leaves, fetched, decoded and (with ``anchor [B, n_rows + 1,
    dim]``) added to their anchors → ``[B, M, dim]``."""
    leaves = offload.read_rows(stored, rows, device)
    out = quant.decode(quant.from_leaves(leaves, dim, dtype)).to(dtype)
    return out if anchor is None else out + gather_rows(anchor, rows)


def _row_reader(quant, offload, dim: int, dtype, device, anchored: bool) -> StageRegion:
    """:func:`_read_rows` for one store as a stage region taking tensors only: ``(rows, anchor, *leaves)`` when
    ``anchored``, else ``(rows, *leaves)`` (the stages and sizes are the closure's, the same at every layer)."""

    def read(rows: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        anchor, stored = (args[0], args[1:]) if anchored else (None, args)
        return _read_rows(quant, offload, dim, dtype, device, rows, anchor, tuple(stored))

    return StageRegion(read)


def _traceable(quant, offload) -> bool:
    """Whether both stages are the package's own, traceable ones (a plugin's stage runs in the step's glue, where a
    compile that cannot trace it falls back to eager steps instead of failing a region)."""
    return (getattr(offload, "compilable", True) and
            all(type(stage).__module__.startswith("polestar.") for stage in (quant, offload)))
