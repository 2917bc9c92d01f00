"""Triton kernels of :mod:`polestar.kernels.member_choice` (imported only when Triton is available).

* :func:`cluster_members_kernel`: one program per batch row. Phase 1 ranks the row's clusters (drift on the
  :data:`~polestar.kernels.member_choice.DRIFT_RESOLUTION` grid, round half to even as ``torch.round``, ``-inf`` for
  empty clusters; rank = how many clusters come before in a stable descending sort) by comparing all pairs in
  tiles, and writes ``chosen`` plus each cluster's sort key (its rank if chosen, else ``K``) to a scratch row.
  Phase 2 gives each window column its cluster's key (``K`` for a non-member). Phase 3 computes each column's
  position in the stable ascending order of the keys, again by comparing all pairs in tiles, and scatters the
  columns with a position below ``capacity`` into the output slots. The phases hand data over through the scratch
  row in global memory, separated by ``tl.debug_barrier`` (one thread block per program). Integer comparisons
  only, so the results equal the torch reference bit for bit.
* :func:`centroid_shift_kernel`: one program per (batch row, cluster, ``d`` block); it scans the member slots in
  chunks, adds ``new - old`` of the slots whose window column belongs to the cluster in fp32 and divides by the
  cluster's size.

Index math is int64 (program ids and strided offsets); inputs may have any strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import next_pow2
from ._common_kernels import reduce_sum

NEG_INF = tl.constexpr(float("-inf"))
#: 1 / DRIFT_RESOLUTION: multiplying by a power of two is exact, so this equals the reference's division
INV_RESOLUTION = tl.constexpr(2.0**20)

# tile caps: a [BLOCK_K, BLOCK_K] and a [BLOCK_N, BLOCK_N] comparison tile per loop step
_MAX_BLOCK_K = 64
_MAX_BLOCK_N = 64
_MAX_BLOCK_M = 16
_MAX_BLOCK_D = 128


# ----------------------------------------------------------------------------- member choice


@triton.jit
def _round_half_even(x):
    """``torch.round`` (half to even) of fp32 ``x`` from exact operations: ``x - floor(x)`` is exact, and beyond
    2**23 every fp32 is an integer (``frac`` 0); ``±inf`` and NaN pass through (their ``frac`` is NaN)."""
    r = tl.floor(x)
    frac = x - r
    half = r * 0.5
    odd = (half - tl.floor(half)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, r + 1.0, r)


@triton.jit
def _load_scores(drift_ptr, counts_ptr, b, offs, K, stride_db, stride_dk, stride_cb, stride_ck):
    """Ranking scores of clusters ``offs`` of row ``b``: ``round(drift * 2**20)``, ``-inf`` where empty (or
    ``offs >= K``), and whether each cluster is non-empty (``counts > 0``)."""
    mask = offs < K
    o64 = offs.to(tl.int64)
    d = tl.load(drift_ptr + b * stride_db + o64 * stride_dk, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(counts_ptr + b * stride_cb + o64 * stride_ck, mask=mask, other=0)
    s = _round_half_even(d * INV_RESOLUTION)
    s = tl.where(mask & (c != 0), s, NEG_INF)
    return s, mask & (c > 0)


@triton.jit
def _before(s_j, s_k, j, k):
    """Whether cluster ``j`` (score ``s_j``) precedes cluster ``k`` in a stable descending sort (broadcasting):
    a larger score, or an equal one and a lower index. NaN counts as larger than any number (as in
    ``torch.sort``), NaNs as equal to each other."""
    nan_j = s_j != s_j
    nan_k = s_k != s_k
    greater = (s_j > s_k) | (nan_j & ~nan_k)
    equal = (s_j == s_k) | (nan_j & nan_k)
    return greater | (equal & (j < k))


@triton.jit
def cluster_members_kernel(
    drift_ptr,  # [B, K] float, any strides
    counts_ptr,  # [B, K] int, any strides
    labels_ptr,  # [B, Nw] int64 cluster of each window column (-1: none), any strides
    wvalid_ptr,  # [B, Nw] uint8 (bool) window columns holding a token, any strides
    due_ptr,  # [B] uint8 (bool) rows updating at this step
    rows_ptr,  # [B, CAP] int64 out, contiguous
    valid_ptr,  # [B, CAP] uint8 (bool) out, contiguous
    chosen_ptr,  # [B, K] uint8 (bool) out, contiguous
    scratch_ptr,  # [B, K + Nw] int32 scratch, contiguous: cluster keys, then column keys
    K,
    NW,
    CAP,
    KSEL,  # min(k, K): clusters with a rank below it are chosen
    trash,
    stride_db,
    stride_dk,
    stride_cb,
    stride_ck,
    stride_lb,
    stride_ln,
    stride_wb,
    stride_wn,
    stride_due,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Member choice of batch row ``b = program_id(0)`` (see the module docstring for the method).

    Writes ``chosen[b, :K]`` (rank < KSEL, non-empty, row due), ``rows[b, :CAP]`` (window column of each slot,
    ``trash`` for a non-member) and ``valid[b, :CAP]``: slot ``p`` holds the column at position ``p`` of the
    stable ascending order of the column keys (its cluster's rank if a member of a chosen cluster, else ``K``).
    """
    b = tl.program_id(0).to(tl.int64)
    due = tl.load(due_ptr + b * stride_due) != 0
    key_row = scratch_ptr + b * (K + NW)

    # phase 1: cluster ranks (stable descending order of the scores) -> chosen, cluster keys
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        s_k, nonempty = _load_scores(drift_ptr, counts_ptr, b, offs_k, K, stride_db, stride_dk, stride_cb,
                                     stride_ck)
        rank = tl.full([BLOCK_K], 0, dtype=tl.int32)
        for j0 in range(0, K, BLOCK_K):
            offs_j = j0 + tl.arange(0, BLOCK_K)
            s_j, _ = _load_scores(drift_ptr, counts_ptr, b, offs_j, K, stride_db, stride_dk, stride_cb,
                                  stride_ck)
            before = _before(s_j[None, :], s_k[:, None], offs_j[None, :], offs_k[:, None]) & (offs_j < K)[None, :]
            rank += reduce_sum(before.to(tl.int32), axis=1)
        chosen = (rank < KSEL) & nonempty & due
        mask_k = offs_k < K
        tl.store(chosen_ptr + b * K + offs_k, chosen.to(tl.uint8), mask=mask_k)
        tl.store(key_row + offs_k, tl.where(chosen, rank, K), mask=mask_k)
    tl.debug_barrier()

    # phase 2: column keys = their cluster's key (K: not in the window, no cluster, or cluster not chosen)
    for n0 in range(0, NW, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < NW
        o64 = offs_n.to(tl.int64)
        lab = tl.load(labels_ptr + b * stride_lb + o64 * stride_ln, mask=mask_n, other=-1).to(tl.int64)
        inwin = tl.load(wvalid_ptr + b * stride_wb + o64 * stride_wn, mask=mask_n, other=0) != 0
        inwin = inwin & (lab >= 0) & (lab < K)
        key = tl.load(key_row + tl.where(inwin, lab, 0), mask=inwin, other=K)
        tl.store(key_row + K + offs_n, key, mask=mask_n)
    tl.debug_barrier()

    # phase 3: position of each column in the stable ascending order of the keys -> output slot
    for n0 in range(0, NW, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < NW
        key_n = tl.load(key_row + K + offs_n, mask=mask_n, other=K)
        pos = tl.full([BLOCK_N], 0, dtype=tl.int32)
        for m0 in range(0, NW, BLOCK_N):
            offs_m = m0 + tl.arange(0, BLOCK_N)
            key_m = tl.load(key_row + K + offs_m, mask=offs_m < NW, other=K + 1)  # padding sorts last
            km, kn = key_m[None, :], key_n[:, None]
            first = (km < kn) | ((km == kn) & (offs_m[None, :] < offs_n[:, None]))
            pos += reduce_sum(first.to(tl.int32), axis=1)
        member = key_n < K
        slot = mask_n & (pos < CAP)
        out = b * CAP + pos
        tl.store(rows_ptr + out, tl.where(member, offs_n.to(tl.int64), trash), mask=slot)
        tl.store(valid_ptr + out, member.to(tl.uint8), mask=slot)


def cluster_members(drift: torch.Tensor, counts: torch.Tensor, labels: torch.Tensor, window_valid: torch.Tensor,
                    due: torch.Tensor, k: int, capacity: int, trash: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch :func:`cluster_members_kernel` (arguments checked by the caller): ``drift, counts [B, K]``,
    ``labels, window_valid [B, Nw]``, ``due [B]`` → ``rows [B, capacity]`` long, ``valid [B, capacity]`` bool,
    ``chosen [B, K]`` bool (as :func:`polestar.kernels.member_choice.reference_cluster_members`)."""
    b, n_clusters = drift.shape
    nw = labels.shape[1]
    dev = drift.device
    rows = torch.empty((b, capacity), dtype=torch.long, device=dev)
    valid = torch.empty((b, capacity), dtype=torch.bool, device=dev)
    chosen = torch.empty((b, n_clusters), dtype=torch.bool, device=dev)
    if b == 0:
        return rows, valid, chosen
    scratch = torch.empty((b, n_clusters + nw), dtype=torch.int32, device=dev)
    wv = window_valid.view(torch.uint8)
    du = due.view(torch.uint8)
    cluster_members_kernel[(b,)](
        drift, counts, labels, wv, du, rows, valid.view(torch.uint8), chosen.view(torch.uint8), scratch,
        n_clusters, nw, capacity, min(int(k), n_clusters), int(trash),
        *drift.stride(), *counts.stride(), *labels.stride(), *wv.stride(), du.stride(0),
        BLOCK_K=min(next_pow2(n_clusters), _MAX_BLOCK_K), BLOCK_N=min(next_pow2(nw), _MAX_BLOCK_N),
    )  # fmt: skip
    return rows, valid, chosen


# ----------------------------------------------------------------------------- centroid shift


@triton.jit
def centroid_shift_kernel(
    labels_ptr,  # [B, Nw] int cluster of each window column (-1: none), any strides
    counts_ptr,  # [B, K] int cluster sizes, any strides
    rows_ptr,  # [B, M] int window column of each member slot (>= Nw: trash), any strides
    valid_ptr,  # [B, M] uint8 (bool) slots holding a member, any strides
    new_ptr,  # [B, M, D] float, any strides
    old_ptr,  # [B, M, D] float, any strides
    out_ptr,  # [B, K, D] out (the centroids' dtype), contiguous
    K,
    NW,
    M,
    D,
    stride_lb,
    stride_ln,
    stride_cb,
    stride_ck,
    stride_rb,
    stride_rm,
    stride_vb,
    stride_vm,
    stride_nb,
    stride_nm,
    stride_nd,
    stride_ob,
    stride_om,
    stride_od,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``out[b, k, d-block] = Σ_m [valid[b, m] and labels[b, min(rows[b, m], Nw - 1)] == k] (new - old)[b, m] /
    max(counts[b, k], 1)`` for ``(b, k, d-block) = program_id(0, 1, 2)``; ``new`` is first cast to ``old``'s
    dtype (as in the reference), the sum runs in fp32 over ``BLOCK_M``-slot chunks."""
    b = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1).to(tl.int64)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    d64 = offs_d.to(tl.int64)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
    for m0 in range(0, M, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        m64 = offs_m.to(tl.int64)
        row = tl.load(rows_ptr + b * stride_rb + m64 * stride_rm, mask=mask_m, other=0).to(tl.int64)
        row = tl.maximum(tl.minimum(row, NW - 1), 0)
        sel = tl.load(valid_ptr + b * stride_vb + m64 * stride_vm, mask=mask_m, other=0) != 0
        lab = tl.load(labels_ptr + b * stride_lb + row * stride_ln, mask=sel, other=-1)
        sel = sel & (lab == k)
        tile = sel[:, None] & mask_d[None, :]
        new = tl.load(new_ptr + b * stride_nb + m64[:, None] * stride_nm + d64[None, :] * stride_nd, mask=tile,
                      other=0.0)
        old = tl.load(old_ptr + b * stride_ob + m64[:, None] * stride_om + d64[None, :] * stride_od, mask=tile,
                      other=0.0)
        acc += new.to(old_ptr.dtype.element_ty).to(tl.float32) - old.to(tl.float32)
    cnt = tl.load(counts_ptr + b * stride_cb + k * stride_ck)
    delta = reduce_sum(acc, axis=0) / tl.maximum(cnt, 1).to(tl.float32)
    tl.store(out_ptr + (b * K + k) * D + d64, delta.to(out_ptr.dtype.element_ty), mask=mask_d)


def centroid_shift(labels: torch.Tensor, counts: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor,
                   new: torch.Tensor, old: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Launch :func:`centroid_shift_kernel` (shapes checked by the caller): ``labels [B, Nw]``, ``counts [B, K]``,
    ``rows, valid [B, M]``, ``new, old [B, M, d]`` → ``[B, K, d]`` in ``dtype`` (as
    :func:`polestar.kernels.member_choice.reference_centroid_shift`)."""
    b, n_clusters = counts.shape
    m, d = new.shape[1], new.shape[2]
    nw = labels.shape[1]
    out = torch.empty((b, n_clusters, d), dtype=dtype, device=new.device)
    if out.numel() == 0:
        return out
    if m == 0 or nw == 0:
        return out.zero_()
    vv = valid.view(torch.uint8)
    block_d = min(next_pow2(d), _MAX_BLOCK_D)
    grid = (b, n_clusters, triton.cdiv(d, block_d))
    centroid_shift_kernel[grid](
        labels, counts, rows, vv, new, old, out, n_clusters, nw, m, d,
        *labels.stride(), *counts.stride(), *rows.stride(), *vv.stride(), *new.stride(), *old.stride(),
        BLOCK_M=min(next_pow2(m), _MAX_BLOCK_M), BLOCK_D=block_d,
    )  # fmt: skip
    return out
