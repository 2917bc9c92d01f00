"""Triton kernel for the k-means assignment step (imported only when Triton is available)."""

from __future__ import annotations

import triton
import triton.language as tl

from ._common_kernels import reduce_sum

NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def assign_kernel(
    x_ptr,  # [G, N, D] any float dtype, unit stride on D
    c_ptr,  # [G, K, D] fp64 unit-norm centroids, contiguous
    kv_ptr,  # [G, K] int8 enabled clusters, contiguous (unused unless HAS_KV)
    out_ptr,  # [G, N] int64
    N,
    D,
    K,
    stride_xg,
    stride_xn,
    HAS_KV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """labels[g, n] = argmax_k <x[g, n], c_hat[g, k]> in fp64 over the enabled k, ties -> lowest k."""
    g = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    x_rows = x_ptr + g * stride_xg + offs_n[:, None].to(tl.int64) * stride_xn
    best = tl.full([BLOCK_N], NEG_INF, dtype=tl.float64)
    best_idx = tl.full([BLOCK_N], 0, dtype=tl.int64)
    for j in range(0, K):
        c_row = c_ptr + (g * K + j) * D
        acc = tl.full([BLOCK_N, BLOCK_D], 0.0, dtype=tl.float64)
        for start in range(0, D, BLOCK_D):
            offs_d = start + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            xt = tl.load(x_rows + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
            ct = tl.load(c_row + offs_d, mask=mask_d, other=0.0)
            acc += xt.to(tl.float64) * ct[None, :]
        score = reduce_sum(acc, axis=1)
        better = score > best  # strict: ties keep the lower index
        if HAS_KV:
            better = better & (tl.load(kv_ptr + g * K + j) != 0)
        best = tl.where(better, score, best)
        best_idx = tl.where(better, j, best_idx)
    tl.store(out_ptr + g * N + offs_n, best_idx, mask=mask_n)
