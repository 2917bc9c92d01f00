"""Triton kernels of :mod:`polestar.kernels.member_rows` (imported only when Triton is available).

* :func:`packet_write_kernel`: one program per (batch row, cluster, ``d`` block), as
  :func:`~polestar.kernels._member_kernels.centroid_shift_kernel`. It scans the packet's slots in chunks; for the
  valid slots whose window row belongs to its cluster it reads the row's stored value, then (after a barrier, so no
  thread writes a row another thread of the program still reads) writes the slot's new value there, and sums
  ``new - old`` in fp32; finally it adds the sum over the cluster's size to the centroid. Each valid slot belongs to
  one cluster and the valid slots' rows are distinct window rows (never the trash row), so no two programs touch the
  same store row; the slots no cluster owns (invalid ones, at the trash row, and valid ones without a cluster) are
  written by the cluster-0 programs.
* :func:`member_rows_kernel`: one program per (output or packet row, batch row, column block). The first ``C`` rows
  copy the plan's query and input rows, the next ``M`` gather a member's query (from the packet's new queries when
  the member is a packet row, so no read waits on another program's write; else from the query store) and stored
  input, and its cache slot; the last ``P`` write the packet's new queries into the query store.

Index math is int64 (program ids and strided offsets); inputs may have any strides, outputs are contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import next_pow2
from ._common_kernels import reduce_max, reduce_sum

_MAX_BLOCK_P = 16
_MAX_BLOCK_D = 128
_MAX_BLOCK_COL = 1024
_MAX_BLOCK_SCAN = 128


@triton.jit
def _bf16_rne(v):
    """fp32 ``v`` → bfloat16, rounded to nearest even (as torch; NaN stays a quiet NaN) from integer operations:
    the interpreter's own fp32 → bf16 cast truncates."""
    bits = v.to(tl.uint32, bitcast=True)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    rounded = tl.where(v != v, bits | 0x400000, rounded)
    return (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _cast(x, dst: tl.constexpr):
    """``x.to(dst)`` rounded as torch rounds it: to bfloat16 through fp32 (:func:`_bf16_rne`), else Triton's cast."""
    if dst == tl.bfloat16:  # resolved at compile time; a bf16 x comes back unchanged
        y = _bf16_rne(x.to(tl.float32))
    else:
        y = x.to(dst)
    return y


# ----------------------------------------------------------------------------- packet write


@triton.jit
def packet_write_kernel(
    store_ptr,  # [B, N1, D] in/out, any strides
    cent_ptr,  # [B, K, D] in/out, any strides
    labels_ptr,  # [B, NW] int cluster of each window row (-1: none), any strides
    counts_ptr,  # [B, K] int cluster sizes, any strides
    rows_ptr,  # [B, P] int store row of each packet slot, any strides
    valid_ptr,  # [B, P] uint8 (bool) slots holding a member, any strides
    new_ptr,  # [B, P, D] float, any strides
    K,
    NW,
    P,
    D,
    stride_sb,
    stride_sn,
    stride_sd,
    stride_cb,
    stride_ck,
    stride_cd,
    stride_lb,
    stride_ln,
    stride_kb,
    stride_kk,
    stride_rb,
    stride_rp,
    stride_vb,
    stride_vp,
    stride_nb,
    stride_np,
    stride_nd,
    UPCAST: tl.constexpr,  # add to the centroids in fp32 (16-bit centroids), else in their dtype
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """For ``(b, k, d-block) = program_id(0, 1, 2)``: ``store[b, rows[b, p], d-block] = new[b, p, d-block]`` (cast to
    the store's dtype) for the slots ``p`` of cluster ``k`` (valid, ``labels[b, min(rows[b, p], NW - 1)] == k``),
    and for ``k == 0`` the slots of no cluster too; then ``cent[b, k, d-block] += (Σ_p (new - old) /
    max(counts[b, k], 1))`` in the centroids' dtype, ``old`` the store's value before the write (``k < K`` only:
    with ``K == 0`` one program per row writes the slots)."""
    b = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1).to(tl.int64)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    d64 = offs_d.to(tl.int64)
    store_ty = store_ptr.dtype.element_ty
    acc = tl.full([BLOCK_P, BLOCK_D], 0.0, dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        mask_p = offs_p < P
        p64 = offs_p.to(tl.int64)
        row = tl.load(rows_ptr + b * stride_rb + p64 * stride_rp, mask=mask_p, other=0).to(tl.int64)
        ok = mask_p & (tl.load(valid_ptr + b * stride_vb + p64 * stride_vp, mask=mask_p, other=0) != 0)
        lrow = tl.maximum(tl.minimum(row, NW - 1), 0)
        lab = tl.load(labels_ptr + b * stride_lb + lrow * stride_ln, mask=ok & (lrow < NW), other=-1).to(tl.int64)
        own = ok & (lab == k)
        orphan = mask_p & ~(ok & (lab >= 0) & (lab < K))
        write = own | (orphan & ((p64 * 0 + k) == 0))  # (a vector: the interpreter's `bool & scalar` is int32)
        tile_own = own[:, None] & mask_d[None, :]
        tile_write = write[:, None] & mask_d[None, :]
        at = store_ptr + b * stride_sb + row[:, None] * stride_sn + d64[None, :] * stride_sd
        old = tl.load(at, mask=tile_own, other=0.0)
        new = tl.load(new_ptr + b * stride_nb + p64[:, None] * stride_np + d64[None, :] * stride_nd,
                      mask=tile_write, other=0.0)
        new = _cast(new, store_ty)
        tl.debug_barrier()  # every thread has read its old values before any writes
        tl.store(at, new, mask=tile_write)
        acc += tl.where(tile_own, new.to(tl.float32) - old.to(tl.float32), 0.0)
    if k < K:
        cnt = tl.load(counts_ptr + b * stride_kb + k * stride_kk)
        cent_ty = cent_ptr.dtype.element_ty
        delta = _cast(reduce_sum(acc, axis=0) / tl.maximum(cnt, 1).to(tl.float32), cent_ty)
        at_c = cent_ptr + b * stride_cb + k * stride_ck + d64 * stride_cd
        c = tl.load(at_c, mask=mask_d, other=0.0)
        if UPCAST:
            total = _cast(c.to(tl.float32) + delta.to(tl.float32), cent_ty)
        else:
            total = c + delta
        tl.store(at_c, total, mask=mask_d)


def packet_write(store: torch.Tensor, centroids: torch.Tensor, labels: torch.Tensor, counts: torch.Tensor,
                 rows: torch.Tensor, valid: torch.Tensor, new: torch.Tensor) -> None:
    """Launch :func:`packet_write_kernel` (shapes checked by the caller): ``store [B, N1, d]`` and ``centroids
    [B, K, d]`` written in place from ``labels [B, N1 - 1]``, ``counts [B, K]``, ``rows, valid [B, P]``, ``new
    [B, P, d]`` (as :func:`polestar.kernels.member_rows.reference_packet_write`)."""
    b, n1, d = store.shape
    n_clusters = centroids.shape[1]
    p = rows.shape[1]
    if b == 0 or d == 0 or (p == 0 and n_clusters == 0):
        return
    vv = valid.view(torch.uint8)
    block_d = min(next_pow2(d), _MAX_BLOCK_D)
    grid = (b, max(n_clusters, 1), triton.cdiv(d, block_d))
    packet_write_kernel[grid](
        store, centroids, labels, counts, rows, vv, new, n_clusters, n1 - 1, p, d,
        *store.stride(), *centroids.stride(), *labels.stride(), *counts.stride(), *rows.stride(), *vv.stride(),
        *new.stride(),
        UPCAST=centroids.element_size() < 4, BLOCK_P=min(next_pow2(p), _MAX_BLOCK_P), BLOCK_D=block_d,
    )  # fmt: skip


# ----------------------------------------------------------------------------- member rows


@triton.jit
def member_rows_kernel(
    qstore_ptr,  # [B, N1, H * HDIM] in/out, any strides
    store_ptr,  # [B, N1, D], any strides
    qplan_ptr,  # [B, H, C, HDIM], any strides
    h_ptr,  # [B, C, D], any strides
    rows_ptr,  # [B, M] int members' store rows, any strides
    slot_ptr,  # [N1] int each store row's cache slot
    prows_ptr,  # [B, P] int packet's store rows, any strides (unused when P == 0)
    qpk_ptr,  # [B, H, P, HDIM] packet's new queries, any strides (unused when P == 0)
    qatt_ptr,  # [B, H, C + M, HDIM] out, contiguous
    resid_ptr,  # [B, C + M, D] out, contiguous
    slots_ptr,  # [B, M] out, contiguous
    C,
    M,
    P,
    H,
    HDIM,
    D,
    stride_qsb,
    stride_qsn,
    stride_qsc,
    stride_sb,
    stride_sn,
    stride_sd,
    stride_qb,
    stride_qh,
    stride_qc,
    stride_qe,
    stride_hb,
    stride_hc,
    stride_hd,
    stride_rb,
    stride_rm,
    stride_slot,
    stride_pb,
    stride_pp,
    stride_kb,
    stride_kh,
    stride_kp,
    stride_ke,
    BLOCK_COL: tl.constexpr,
    BLOCK_SCAN: tl.constexpr,
):
    """Row ``j = program_id(0)`` of batch row ``b = program_id(1)``, columns ``program_id(2) * BLOCK_COL + ...`` of
    the ``H * HDIM`` query and ``D`` input columns: ``j < C``: the plan's row ``j``; ``C <= j < C + M``: member
    ``m = j - C`` (row ``rows[b, m]``: its query from the first packet slot holding the row, cast to the query
    store's dtype, else from the store; its input; its slot); ``j >= C + M``: packet slot ``p = j - C - M``'s query
    written into the query store."""
    j = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_COL + tl.arange(0, BLOCK_COL)
    c64 = cols.to(tl.int64)
    n_q = H * HDIM
    mask_q = cols < n_q
    mask_d = cols < D
    head = c64 // HDIM
    elem = c64 % HDIM
    CM = C + M
    qatt_at = qatt_ptr + ((b * H + head) * CM + j) * HDIM + elem
    resid_at = resid_ptr + (b * CM + j) * D + c64
    qs_ty = qstore_ptr.dtype.element_ty
    # (each branch names its values apart: the compiler merges same-named values of branches, types and all)
    if j < C:
        q_plan = tl.load(qplan_ptr + b * stride_qb + head * stride_qh + j * stride_qc + elem * stride_qe,
                         mask=mask_q)
        tl.store(qatt_at, q_plan, mask=mask_q)
        h_plan = tl.load(h_ptr + b * stride_hb + j * stride_hc + c64 * stride_hd, mask=mask_d)
        tl.store(resid_at, h_plan, mask=mask_d)
    elif j < CM:
        m = j - C
        row = tl.load(rows_ptr + b * stride_rb + m * stride_rm).to(tl.int64)
        first = tl.full([], 0, dtype=tl.int32) + P  # the first packet slot holding the member's row (P: none)
        for p0 in range(0, P, BLOCK_SCAN):
            offs_p = p0 + tl.arange(0, BLOCK_SCAN)
            mask_p = offs_p < P
            prows = tl.load(prows_ptr + b * stride_pb + offs_p.to(tl.int64) * stride_pp, mask=mask_p, other=-1)
            cand = tl.where(mask_p & (prows.to(tl.int64) == row), offs_p, P)
            first = tl.minimum(first, -reduce_max(-cand, axis=0))
        in_packet = (cols * 0 + first) < P  # a vector: the interpreter's `bool & scalar` is int32
        p_first = tl.maximum(tl.minimum(first, P - 1), 0).to(tl.int64)
        q_fresh = tl.load(qpk_ptr + b * stride_kb + head * stride_kh + p_first * stride_kp + elem * stride_ke,
                          mask=mask_q & in_packet, other=0.0)
        q_fresh = _cast(q_fresh, qs_ty)
        q_kept = tl.load(qstore_ptr + b * stride_qsb + row * stride_qsn + c64 * stride_qsc,
                         mask=mask_q & ~in_packet, other=0.0)
        q_member = tl.where(in_packet, q_fresh, q_kept)
        tl.store(qatt_at, _cast(q_member, qatt_ptr.dtype.element_ty), mask=mask_q)
        h_member = tl.load(store_ptr + b * stride_sb + row * stride_sn + c64 * stride_sd, mask=mask_d)
        tl.store(resid_at, _cast(h_member, resid_ptr.dtype.element_ty), mask=mask_d)
        if tl.program_id(2) == 0:
            tl.store(slots_ptr + b * M + m, tl.load(slot_ptr + row * stride_slot))
    else:
        p = j - CM
        p_row = tl.load(prows_ptr + b * stride_pb + p * stride_pp).to(tl.int64)
        q_pk = tl.load(qpk_ptr + b * stride_kb + head * stride_kh + p * stride_kp + elem * stride_ke, mask=mask_q)
        tl.store(qstore_ptr + b * stride_qsb + p_row * stride_qsn + c64 * stride_qsc, _cast(q_pk, qs_ty),
                 mask=mask_q)


def member_rows(qstore: torch.Tensor, store: torch.Tensor, q_plan: torch.Tensor, h: torch.Tensor, rows: torch.Tensor,
                row_slot: torch.Tensor, packet_rows: torch.Tensor | None, q_packet: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch :func:`member_rows_kernel` (shapes checked by the caller): ``qstore [B, N1, H * hd]`` written in place
    at ``packet_rows [B, P]`` from ``q_packet [B, H, P, hd]`` (None: no packet); → ``q_att [B, H, C + M, hd]``,
    ``resid [B, C + M, d]``, ``slots [B, M]`` (as :func:`polestar.kernels.member_rows.reference_member_rows`)."""
    b, n_heads, c, hd = q_plan.shape
    d = store.shape[2]
    m = rows.shape[1]
    dev = q_plan.device
    q_att = torch.empty((b, n_heads, c + m, hd), dtype=q_plan.dtype, device=dev)
    resid = torch.empty((b, c + m, d), dtype=h.dtype, device=dev)
    slots = torch.empty((b, m), dtype=row_slot.dtype, device=dev)
    if packet_rows is None:  # no packet slots: any tensors stand in for the unused pointers
        packet_rows, q_packet = rows, q_plan
        p = 0
    else:
        p = packet_rows.shape[1]
    n_rows = c + m + p
    if b == 0 or n_rows == 0:
        return q_att, resid, slots
    block_col = min(next_pow2(max(n_heads * hd, d)), _MAX_BLOCK_COL)
    grid = (n_rows, b, max(triton.cdiv(max(n_heads * hd, d), block_col), 1))
    member_rows_kernel[grid](
        qstore, store, q_plan, h, rows, row_slot, packet_rows, q_packet, q_att, resid, slots,
        c, m, p, n_heads, max(hd, 1), d,
        *qstore.stride(), *store.stride(), *q_plan.stride(), *h.stride(), *rows.stride(), row_slot.stride(0),
        *packet_rows.stride(), *q_packet.stride(),
        BLOCK_COL=block_col, BLOCK_SCAN=min(next_pow2(p), _MAX_BLOCK_SCAN),
    )  # fmt: skip
    return q_att, resid, slots
