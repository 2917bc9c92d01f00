"""Polestar-Cache's update-packet write and member-row gather at one layer of a sparse-update step, as single
operations.

Polestar ("Polestar: Drift-Aware Cache Calibration and Token Commitment", section "Polestar-Cache") carries each
layer's member outputs, the *update packet*, to the next layer, which writes them into its store of window inputs
and shifts each cluster centroid by its members' mean change; after choosing its own members, the layer writes the
packet rows' fresh queries into its query store and gathers the members' stored queries and inputs to join the
plan's rows for attention. Written as torch code each is several gathers, scatters, casts and concatenations per
layer; here each is one operation (:func:`polestar.kernels._library.fused_op`: a Triton kernel on CUDA, the torch
reference elsewhere), so an uncompiled step launches one kernel for it and a compiler traces one node.

* :func:`packet_write`: the packet's previous stored rows read, its outputs written in their place and each
  centroid shifted by :func:`~polestar.kernels.member_choice.reference_centroid_shift` of the change (a row store
  with the lossless ``none`` quantizer on the compute device: values cast to the store's dtype, rows scattered).
* :func:`member_rows`: the packet rows' queries written into the query store, then the members' queries and inputs
  gathered and joined to the plan's rows, and the members' cache slots.

Shapes: ``N1`` store rows (the window's ``Nw`` rows and a trash row ``N1 - 1`` that absorbs unused slots), ``K``
clusters, ``P`` packet slots, ``M`` member slots, ``C`` plan rows, ``d`` model width, ``H`` heads of width ``hd``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._backend import HAS_TRITON, pick, require_triton
from ._library import fused_op
from .member_choice import reference_centroid_shift

if HAS_TRITON:
    from . import _member_rows_kernels

__all__ = [
    "member_rows",
    "member_rows_triton",
    "packet_write",
    "packet_write_triton",
    "reference_member_rows",
    "reference_packet_write",
]


def _shape(t: Tensor | None) -> tuple[int, ...] | None:
    return None if t is None else tuple(t.shape)


def _gather_rows(buf: Tensor, rows: Tensor) -> Tensor:
    """``buf [B, N, w]``, ``rows [B, R]`` → ``buf[b, rows[b, r]]`` as ``[B, R, w]`` (the row store's gather)."""
    return buf.gather(1, rows[..., None].expand(-1, -1, buf.shape[-1]))


def _scatter_rows_(buf: Tensor, rows: Tensor, src: Tensor) -> None:
    """In place ``buf[b, rows[b, r]] = src[b, r]`` (the row store's scatter; repeated rows get one of their
    sources)."""
    buf.scatter_(1, rows[..., None].expand(-1, -1, src.shape[-1]), src)


# ----------------------------------------------------------------------------- packet write


def check_packet_args(store: Tensor, centroids: Tensor, labels: Tensor, counts: Tensor, rows: Tensor, valid: Tensor,
                      new: Tensor) -> None:
    """Validate the arguments of :func:`packet_write` (``ValueError`` naming the mismatch)."""
    if store.dim() != 3 or store.shape[1] < 1:
        raise ValueError(f"store must be [B, N1, d] with N1 >= 1 (the window's rows and a trash row), got "
                         f"{tuple(store.shape)}")
    b, n1, d = store.shape
    if centroids.dim() != 3 or centroids.shape[0] != b or centroids.shape[2] != d:
        raise ValueError(f"centroids must be [B, K, d] = [{b}, K, {d}], got {tuple(centroids.shape)}")
    k = centroids.shape[1]
    if labels.shape != (b, n1 - 1):
        raise ValueError(f"labels must be [B, Nw] = ({b}, {n1 - 1}) (the store's rows less the trash row), got "
                         f"{tuple(labels.shape)}")
    if counts.shape != (b, k):
        raise ValueError(f"counts must be [B, K] = ({b}, {k}), got {tuple(counts.shape)}")
    if rows.dim() != 2 or rows.shape[0] != b or valid.shape != rows.shape:
        raise ValueError(f"rows and valid must be [B, P] with B = {b}, got {tuple(rows.shape)}, "
                         f"{tuple(valid.shape)}")
    if valid.dtype != torch.bool:
        raise ValueError(f"valid must be bool, got {valid.dtype}")
    if new.shape != (b, rows.shape[1], d):
        raise ValueError(f"new must be [B, P, d] = ({b}, {rows.shape[1]}, {d}), got {tuple(new.shape)}")


def reference_packet_write(store: Tensor, centroids: Tensor, labels: Tensor, counts: Tensor, rows: Tensor,
                           valid: Tensor, new: Tensor) -> None:
    """Write an update packet into one layer's row store and shift the centroids (torch reference, in place).

    Args:
        store: ``[B, N1, d]`` the layer's stored window inputs (``N1 = Nw + 1``: row ``Nw`` is the trash row),
            written in place: ``store[b, rows[b, p]] = new[b, p]`` cast to the store's dtype.
        centroids: ``[B, K, d]`` the layer's centroids, written in place: ``+=`` :func:`reference_centroid_shift`
            of the packet's members (its change ``new - old``, ``old`` the rows' stored values before the write).
        labels: ``[B, Nw]`` long each window row's cluster (-1: none); counts: ``[B, K]`` cluster sizes.
        rows: ``[B, P]`` long store rows in ``[0, N1)`` (the trash row where unused; valid rows distinct).
        valid: ``[B, P]`` bool slots holding a member.
        new: ``[B, P, d]`` the packet's outputs.

    Which invalid slot's value the trash row ends up holding is unspecified.
    """
    old = _gather_rows(store, rows).to(store.dtype)  # RowStore.read: gather, decode (identity), cast
    _scatter_rows_(store, rows, new.to(store.dtype).contiguous())  # RowStore.write: cast, encode, scatter
    centroids.add_(reference_centroid_shift(labels, counts, rows, valid, new, old, centroids.dtype))


def _packet_fake(store: Tensor, centroids: Tensor, labels: Tensor, counts: Tensor, rows: Tensor, valid: Tensor,
                 new: Tensor) -> None:
    return None


def _packet_launch(store: Tensor, centroids: Tensor, labels: Tensor, counts: Tensor, rows: Tensor, valid: Tensor,
                   new: Tensor) -> None:
    """Launch the packet-write kernel: one program per (batch row, cluster, ``d`` block) (see
    :mod:`._member_rows_kernels`)."""
    _member_rows_kernels.packet_write(store, centroids, labels, counts, rows, valid, new)


def packet_write_triton(store: Tensor, centroids: Tensor, labels: Tensor, counts: Tensor, rows: Tensor,
                        valid: Tensor, new: Tensor) -> None:
    """Triton version of :func:`reference_packet_write` (same signature; the store's rows equal the reference's bit
    for bit, the centroid shift sums in fp32, in member order)."""
    require_triton()
    check_packet_args(store, centroids, labels, counts, rows, valid, new)
    _packet_launch(store, centroids, labels, counts, rows, valid, new)


_PACKET = {"reference": reference_packet_write, "triton": packet_write_triton,
           "fused": fused_op("packet_write", _packet_fake, cuda=_packet_launch,
                             mutates_args=("store", "centroids"))(reference_packet_write)}


def packet_write(store: Tensor, centroids: Tensor, labels: Tensor, counts: Tensor, rows: Tensor, valid: Tensor,
                 new: Tensor, backend: str = "auto") -> None:
    """Polestar's update-packet write (:func:`reference_packet_write`), in place: ``store [B, N1, d]`` gets
    ``new [B, P, d]`` at ``rows [B, P]``, ``centroids [B, K, d]`` their members' mean change (``labels [B, N1 - 1]``,
    ``counts [B, K]``, ``valid [B, P]``). ``backend``: ``"auto"`` (one operation: the kernel on CUDA, the reference
    elsewhere), ``"triton"`` or ``"reference"``."""
    check_packet_args(store, centroids, labels, counts, rows, valid, new)
    pick(_PACKET, backend, store, centroids, labels, counts, rows, valid, new)(store, centroids, labels, counts,
                                                                              rows, valid, new)


# ----------------------------------------------------------------------------- member rows


def check_member_rows_args(qstore: Tensor, store: Tensor, q_plan: Tensor, h: Tensor, rows: Tensor, row_slot: Tensor,
                           packet_rows: Tensor | None, q_packet: Tensor | None) -> None:
    """Validate the arguments of :func:`member_rows` (``ValueError`` naming the mismatch)."""
    if q_plan.dim() != 4:
        raise ValueError(f"q_plan must be [B, H, C, hd], got {tuple(q_plan.shape)}")
    b, n_heads, c, hd = q_plan.shape
    if store.dim() != 3 or store.shape[0] != b or store.shape[1] < 1:
        raise ValueError(f"store must be [B, N1, d] with B = {b}, N1 >= 1, got {tuple(store.shape)}")
    n1, d = store.shape[1], store.shape[2]
    if qstore.shape != (b, n1, n_heads * hd):
        raise ValueError(f"qstore must be [B, N1, H * hd] = ({b}, {n1}, {n_heads * hd}), got {tuple(qstore.shape)}")
    if h.shape != (b, c, d):
        raise ValueError(f"h must be [B, C, d] = ({b}, {c}, {d}), got {tuple(h.shape)}")
    if rows.dim() != 2 or rows.shape[0] != b:
        raise ValueError(f"rows must be [B, M] with B = {b}, got {tuple(rows.shape)}")
    if row_slot.shape != (n1,):
        raise ValueError(f"row_slot must be [N1] = ({n1},), got {tuple(row_slot.shape)}")
    if (packet_rows is None) != (q_packet is None):
        raise ValueError(f"packet_rows and q_packet go together, got {_shape(packet_rows)}, {_shape(q_packet)}")
    if packet_rows is not None:
        if packet_rows.dim() != 2 or packet_rows.shape[0] != b:
            raise ValueError(f"packet_rows must be [B, P] with B = {b}, got {tuple(packet_rows.shape)}")
        if q_packet.shape != (b, n_heads, packet_rows.shape[1], hd):
            raise ValueError(f"q_packet must be [B, H, P, hd] = ({b}, {n_heads}, {packet_rows.shape[1]}, {hd}), "
                             f"got {tuple(q_packet.shape)}")


def reference_member_rows(qstore: Tensor, store: Tensor, q_plan: Tensor, h: Tensor, rows: Tensor, row_slot: Tensor,
                          packet_rows: Tensor | None, q_packet: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Write the packet rows' queries, gather the members' queries and inputs, join them to the plan's rows (torch
    reference; ``qstore`` written in place).

    Args:
        qstore: ``[B, N1, H * hd]`` the layer's stored queries (heads side by side), written in place: ``qstore[b,
            packet_rows[b, p]] = q_packet[b, :, p]`` cast to its dtype, before the members' queries are read.
        store: ``[B, N1, d]`` the layer's stored window inputs.
        q_plan: ``[B, H, C, hd]`` the plan rows' queries (any strides: a slice of the layer's queries).
        h: ``[B, C, d]`` the plan rows' inputs.
        rows: ``[B, M]`` long the members' store rows (the trash row ``N1 - 1`` where unused).
        row_slot: ``[N1]`` long each store row's cache slot.
        packet_rows: ``[B, P]`` long the packet's store rows (trash where unused), or None (no packet).
        q_packet: ``[B, H, P, hd]`` the packet rows' new queries (any strides), or None.

    Returns:
        ``q_att [B, H, C + M, hd]`` (``q_plan``'s dtype), ``resid [B, C + M, d]`` (``h``'s dtype): the plan's rows
        then the members'; ``slots [B, M]`` the members' cache slots. The trash row's values are unspecified.
    """
    B, H, C, hd = q_plan.shape
    if packet_rows is not None:  # RowStore.write: cast, encode (identity), scatter
        q_new = q_packet.transpose(1, 2).reshape(B, -1, H * hd).to(qstore.dtype).contiguous()
        _scatter_rows_(qstore, packet_rows, q_new)
    q = _gather_rows(qstore, rows).to(qstore.dtype).view(B, -1, H, hd).transpose(1, 2)  # RowStore.read
    inputs = _gather_rows(store, rows).to(store.dtype)
    q_att = torch.cat([q_plan, q.to(q_plan.dtype)], dim=2)
    resid = torch.cat([h, inputs.to(h.dtype)], dim=1)
    return q_att, resid, row_slot[rows]


def _member_rows_fake(qstore: Tensor, store: Tensor, q_plan: Tensor, h: Tensor, rows: Tensor, row_slot: Tensor,
                      packet_rows: Tensor | None, q_packet: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    b, n_heads, c, hd = q_plan.shape
    m = rows.shape[1]
    return (q_plan.new_empty((b, n_heads, c + m, hd)), h.new_empty((b, c + m, h.shape[2])),
            row_slot.new_empty((b, m)))


def _member_rows_launch(qstore: Tensor, store: Tensor, q_plan: Tensor, h: Tensor, rows: Tensor, row_slot: Tensor,
                        packet_rows: Tensor | None, q_packet: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the member-rows kernel: one program per (output or packet row, batch row, column block) (see
    :mod:`._member_rows_kernels`)."""
    return _member_rows_kernels.member_rows(qstore, store, q_plan, h, rows, row_slot, packet_rows, q_packet)


def member_rows_triton(qstore: Tensor, store: Tensor, q_plan: Tensor, h: Tensor, rows: Tensor, row_slot: Tensor,
                       packet_rows: Tensor | None = None, q_packet: Tensor | None = None
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """Triton version of :func:`reference_member_rows` (same signature and results, bit for bit: copies and casts
    only)."""
    require_triton()
    check_member_rows_args(qstore, store, q_plan, h, rows, row_slot, packet_rows, q_packet)
    return _member_rows_launch(qstore, store, q_plan, h, rows, row_slot, packet_rows, q_packet)


_MEMBER_ROWS = {"reference": reference_member_rows, "triton": member_rows_triton,
                "fused": fused_op("member_rows", _member_rows_fake, cuda=_member_rows_launch,
                                  mutates_args=("qstore",))(reference_member_rows)}


def member_rows(qstore: Tensor, store: Tensor, q_plan: Tensor, h: Tensor, rows: Tensor, row_slot: Tensor,
                packet_rows: Tensor | None = None, q_packet: Tensor | None = None, backend: str = "auto"
                ) -> tuple[Tensor, Tensor, Tensor]:
    """Polestar's member rows (:func:`reference_member_rows`): ``qstore [B, N1, H * hd]`` gets ``q_packet
    [B, H, P, hd]`` at ``packet_rows [B, P]`` (in place; both None: no packet), then → ``q_att [B, H, C + M, hd]``
    (``q_plan [B, H, C, hd]`` and the members' stored queries), ``resid [B, C + M, d]`` (``h [B, C, d]`` and the
    members' rows of ``store [B, N1, d]``), ``slots [B, M]`` (``row_slot [N1]`` at ``rows [B, M]``). ``backend`` as
    in :func:`packet_write`."""
    check_member_rows_args(qstore, store, q_plan, h, rows, row_slot, packet_rows, q_packet)
    tensors = [t for t in (qstore, store, q_plan, h, rows, row_slot, packet_rows, q_packet) if t is not None]
    return pick(_MEMBER_ROWS, backend, *tensors)(qstore, store, q_plan, h, rows, row_slot, packet_rows, q_packet)
