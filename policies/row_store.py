"""A preallocated, row-addressable store of per-layer window rows, kept through a quantizer and an offloader.

The sparse refresh (Polestar-Cache, Lee et al. 2026; Elastic-Cache; dLLM-Cache) keeps, per layer, the input hidden
states of the ``n_rows`` window positions of each sequence and rewrites a few of them per step. Every quant stage
encodes rows independently (:mod:`polestar.policies.quant`), so a write re-encodes only the rows it changes and every
other row keeps its encoded bytes.
"""

from __future__ import annotations

import torch

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

    No host syncs in :meth:`read` / :meth:`write` (with ``offload.compilable`` they can be captured in a CUDA
    graph). This object is per-generation state (one per generation, never on a stage).
    """

    def __init__(self, quant, offload, n_layers: int, batch: int, n_rows: int, dim: int, device, dtype):
        self.quant, self.offload = quant, offload
        self.n_layers, self.batch, self.n_rows, self.dim = n_layers, batch, n_rows, dim
        self.device, self.dtype = torch.device(device), dtype
        zeros = torch.zeros(batch, n_rows + 1, dim, device=self.device, dtype=dtype)
        like = tuple(t.contiguous() for t in quant.to_leaves(quant.encode(zeros)))
        lossy = not quant.lossless
        self.stored = [offload.alloc(like) for _ in range(n_layers)]
        self.anchor = [torch.zeros_like(zeros) if lossy else None for _ in range(n_layers)]
        self.anchored = [False] * n_layers
        self._all_rows = torch.arange(n_rows, device=self.device).expand(batch, n_rows)

    @property
    def plain(self) -> bool:
        """Whether each layer's rows are one tensor ``[B, n_rows + 1, dim]`` on the compute device holding the values
        themselves (a plain quantizer, a resident offloader; never anchored): :meth:`rows` gives it, for fused row
        operations that read and write it directly."""
        return self.quant.plain and self.offload.resident

    def rows(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s stored rows ``[B, n_rows + 1, dim]`` (only for a :attr:`plain` store)."""
        if not self.plain:
            raise ValueError("only a plain store (quant with plain=True, offload with resident=True) exposes its rows")
        return self.stored[layer][0]

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

    def read(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Decode rows ``rows [B, M]`` (long in ``[0, n_rows]``; ``n_rows`` is the trash row, meaningless values) of
        ``layer`` → ``[B, M, dim]`` in ``dtype`` on the compute device. Only those rows are gathered and decoded."""
        stored = self.stored[layer]
        return _read_rows(self.quant, self.offload, self.dim, self.dtype, self.device, rows,
                          self.anchor[layer] if self.anchored[layer] else None, stored)

    def write(self, layer: int, rows: torch.Tensor, valid: torch.Tensor | None, values: torch.Tensor) -> None:
        """Re-encode and store ``values [B, M, dim]`` at ``rows [B, M]`` where ``valid [B, M]``; invalid slots go to
        the trash row, so every other row keeps its encoded bytes. ``valid`` None: ``rows`` already hold the trash
        row where unused (a sparse update's members), and no mask is applied."""
        rows, leaves = self._encoded(rows, valid, values, self.anchor[layer] if self.anchored[layer] else None)
        self.offload.write_rows(self.stored[layer], rows, leaves)

    def _encoded(self, rows, valid, values, anchor):
        """Rows to write (invalid ones sent to the trash row) and the leaves of ``values`` encoded (residuals to
        ``anchor`` where given)."""
        if valid is not None:
            rows = torch.where(valid, rows, self.n_rows)
        payload = values.to(self.dtype)
        if anchor is not None:
            payload = payload - gather_rows(anchor, rows)
        return rows, self.quant.to_leaves(self.quant.encode(payload.contiguous()))

    def read_all(self, layer: int) -> torch.Tensor:
        """Every row of ``layer`` decoded: ``[B, n_rows, dim]`` (for tests and debugging)."""
        return self.read(layer, self._all_rows)

    def _put(self, layer: int, rows: torch.Tensor, payload: torch.Tensor) -> None:
        leaves = self.quant.to_leaves(self.quant.encode(payload.contiguous()))
        self.offload.write_rows(self.stored[layer], rows, leaves)


def _read_rows(quant, offload, dim: int, dtype, device, rows: torch.Tensor, anchor: torch.Tensor | None,
               stored) -> torch.Tensor:
    """Rows ``rows [B, M]`` of one layer's ``stored`` leaves, fetched, decoded and (with ``anchor [B, n_rows + 1,
    dim]``) added to their anchors → ``[B, M, dim]``."""
    leaves = offload.read_rows(stored, rows, device)
    out = quant.decode(quant.from_leaves(leaves, dim, dtype)).to(dtype)
    return out if anchor is None else out + gather_rows(anchor, rows)
