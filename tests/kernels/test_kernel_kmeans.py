"""Tests for ``polestar.kernels.kmeans``: naive per-group loops, invariants, Triton assignment."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polestar.kernels import kmeans as km

FAST = settings(
    max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
needs_triton = pytest.mark.skipif(not km.HAS_TRITON, reason="triton not importable")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ----------------------------------------------------------------------------- naive restatement


def _unit(v: list[float]) -> list[float]:
    n = math.sqrt(sum(a * a for a in v))
    return [a / n for a in v] if n > 0 else [0.0] * len(v)


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))


def naive_assign(points: list[list[float]], cents: list[list[float]]) -> list[int]:
    """argmax_k cos(x, c_k), first index on ties (plain Python, float64)."""
    units = [_unit(c) for c in cents]
    labels = []
    for x in points:
        scores = [_dot(x, u) for u in units]
        labels.append(scores.index(max(scores)))
    return labels


def naive_kmeans_group(pts, valid, keys, k, iters):
    """The documented algorithm for one group, with Python lists (float64)."""
    n = len(pts)
    order = sorted(range(n), key=lambda i: -(keys[i] if valid[i] else -1.0))
    cents = [list(pts[i]) for i in order[:k]]
    labels = [-1] * n
    counts = [0] * k
    for _ in range(iters):
        assigned = naive_assign(pts, cents)
        labels = [assigned[i] if valid[i] else -1 for i in range(n)]
        # reseed: r-th empty cluster <- r-th farthest eligible point
        cos = {i: _dot(_unit(pts[i]), _unit(cents[labels[i]])) for i in range(n) if valid[i]}
        closest = {}
        for i in sorted(cos, key=lambda i: (-cos[i], i)):
            closest.setdefault(labels[i], i)
        eligible = sorted((i for i in cos if closest[labels[i]] != i), key=lambda i: (cos[i], i))
        empty = [j for j in range(k) if j not in set(labels)]
        for j, i in zip(empty, eligible):
            labels[i] = j
        # update: mean of members, previous centroid if empty
        counts = [labels.count(j) for j in range(k)]
        for j in range(k):
            members = [pts[i] for i in range(n) if labels[i] == j]
            if members:
                cents[j] = [sum(col) / len(members) for col in zip(*members)]
    return cents, labels, counts


def naive_kmeans(x, k, iters, seed, valid):
    keys = torch.rand(x.shape[:2], generator=torch.Generator().manual_seed(seed))
    out = [
        naive_kmeans_group(x[g].double().tolist(), valid[g].tolist(), keys[g].tolist(), k, iters)
        for g in range(x.shape[0])
    ]
    cents = torch.tensor([o[0] for o in out], dtype=torch.float64)
    labels = torch.tensor([o[1] for o in out])
    counts = torch.tensor([o[2] for o in out])
    return cents, labels, counts


# ----------------------------------------------------------------------------- strategies


@st.composite
def kmeans_cases(draw):
    g = draw(st.integers(1, 3))
    n = draw(st.integers(1, 16))
    d = draw(st.integers(1, 12))
    k = draw(st.integers(1, n))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(g, n, d, generator=gen)
    valid = torch.rand(g, n, generator=gen) > draw(st.sampled_from([0.0, 0.3]))
    return x, k, draw(st.integers(1, 4)), seed, valid


def check_invariants(res: km.KMeansResult, x: torch.Tensor, k: int, valid: torch.Tensor) -> None:
    cents, labels, counts = res
    g, n, d = x.shape
    assert cents.shape == (g, k, d) and cents.dtype == x.dtype
    assert labels.shape == (g, n) and labels.dtype == torch.int64
    assert counts.shape == (g, k) and counts.dtype == torch.int64
    assert ((labels >= 0) == valid).all() and (labels[~valid] == -1).all()
    assert (labels < k).all()
    assert torch.equal(counts.sum(1), valid.sum(1))
    for gi in range(g):
        for j in range(k):
            members = x[gi][labels[gi] == j].double()
            assert counts[gi, j] == members.shape[0]
            if members.shape[0]:
                tol = 1e-5 if x.dtype == torch.float32 else 1e-2
                torch.testing.assert_close(cents[gi, j].double(), members.mean(0), rtol=tol, atol=tol)
    enough = valid.sum(1) >= k
    assert (counts[enough] > 0).all(), "empty cluster although there are >= k valid points"


# ----------------------------------------------------------------------------- assignment


@FAST
@given(kmeans_cases())
def test_reference_assign_matches_naive(case):
    x, k, _, seed, valid = case
    cents = torch.randn(x.shape[0], k, x.shape[2], generator=torch.Generator().manual_seed(seed + 1))
    labels = km.reference_kmeans_assign(x, cents, valid)
    for g in range(x.shape[0]):
        expected = naive_assign(x[g].double().tolist(), cents[g].double().tolist())
        expected = torch.tensor(expected).masked_fill(~valid[g], -1)
        assert torch.equal(labels[g], expected)


def test_assign_ties_go_to_lowest_index():
    x = torch.tensor([[[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]]])
    c = torch.tensor([[[0.0, 2.0], [1.0, 0.0], [3.0, 0.0], [0.0, 1.0]]])  # duplicate directions
    assert km.reference_kmeans_assign(x, c).tolist() == [[1, 0, 0]]


# ----------------------------------------------------------------------------- k-means


@FAST
@given(kmeans_cases())
def test_reference_kmeans_matches_naive(case):
    x, k, iters, seed, valid = case
    res = km.reference_spherical_kmeans(x, k, iters, torch.Generator().manual_seed(seed), valid)
    if (valid.sum(1) < k).any():  # initial picks among invalid points are unordered in topk
        check_invariants(res, x, k, valid)
        return
    cents, labels, counts = naive_kmeans(x, k, iters, seed, valid)
    assert torch.equal(res.labels, labels)
    assert torch.equal(res.counts, counts)
    torch.testing.assert_close(res.centroids.double(), cents, rtol=1e-5, atol=1e-5)


@FAST
@given(kmeans_cases(), st.sampled_from(DTYPES))
def test_kmeans_invariants(case, dtype):
    x, k, iters, seed, valid = case
    x = x.to(dtype)
    res = km.reference_spherical_kmeans(x, k, iters, torch.Generator().manual_seed(seed), valid)
    check_invariants(res, x, k, valid)


def test_kmeans_reproducible_with_generator():
    x = torch.randn(4, 24, 8, generator=torch.Generator().manual_seed(0))
    a = km.reference_spherical_kmeans(x, 5, generator=torch.Generator().manual_seed(7))
    b = km.reference_spherical_kmeans(x, 5, generator=torch.Generator().manual_seed(7))
    c = km.reference_spherical_kmeans(x, 5, generator=torch.Generator().manual_seed(8))
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    assert not torch.equal(a.labels, c.labels)


def test_kmeans_keys_drawn_ahead_equal_generator_draws():
    """Keys from ``init_keys`` reproduce the generator path exactly, so a compiled caller can draw them eagerly."""
    x = torch.randn(3, 20, 6, generator=torch.Generator().manual_seed(4))
    from_gen = km.spherical_kmeans(x, 4, generator=torch.Generator().manual_seed(9))
    keys = km.init_keys(3, 20, torch.Generator().manual_seed(9), x.device)
    from_keys = km.spherical_kmeans(x, 4, keys=keys)
    for u, v in zip(from_gen, from_keys):
        assert torch.equal(u, v)
    with pytest.raises(ValueError, match="keys must be"):
        km.spherical_kmeans(x, 4, keys=keys[:, :5])


def test_kmeans_k_equals_n():
    x = torch.randn(2, 7, 5, generator=torch.Generator().manual_seed(1))
    res = km.reference_spherical_kmeans(x, 7, generator=torch.Generator().manual_seed(2))
    assert (res.counts == 1).all()
    for g in range(2):
        assert sorted(res.labels[g].tolist()) == list(range(7))
        torch.testing.assert_close(res.centroids[g][res.labels[g]], x[g])


def test_kmeans_all_equal_points():
    x = torch.full((2, 10, 4), 0.5)
    res = km.reference_spherical_kmeans(x, 3, generator=torch.Generator().manual_seed(0))
    check_invariants(res, x, 3, torch.ones(2, 10, dtype=torch.bool))
    assert torch.equal(res.centroids, torch.full((2, 3, 4), 0.5))
    assert res.counts.tolist() == [[8, 1, 1], [8, 1, 1]]


def test_kmeans_k1_is_mean_and_invalid_ignored():
    x = torch.randn(3, 9, 4, generator=torch.Generator().manual_seed(3))
    valid = torch.ones(3, 9, dtype=torch.bool)
    valid[:, ::3] = False
    res = km.reference_spherical_kmeans(x, 1, generator=torch.Generator().manual_seed(0), valid=valid)
    torch.testing.assert_close(
        res.centroids[:, 0], (x * valid[..., None]).sum(1) / valid.sum(1, keepdim=True)
    )
    assert (res.labels[~valid] == -1).all() and (res.labels[valid] == 0).all()


def test_kmeans_fewer_valid_points_than_k():
    x = torch.randn(1, 6, 3, generator=torch.Generator().manual_seed(5))
    valid = torch.tensor([[True, False, True, False, False, False]])
    res = km.reference_spherical_kmeans(x, 4, generator=torch.Generator().manual_seed(0), valid=valid)
    check_invariants(res, x, 4, valid)
    assert (res.counts > 0).sum() == 2


def test_kmeans_bad_arguments():
    x = torch.randn(1, 4, 3)
    with pytest.raises(ValueError):
        km.reference_spherical_kmeans(x, 5)
    with pytest.raises(ValueError):
        km.reference_spherical_kmeans(x, 2, iters=0)
    with pytest.raises(ValueError):
        km.reference_spherical_kmeans(x[0], 2)


def test_chunk_clusters():
    assert km.chunk_clusters(96, 8).tolist() == [i // 12 for i in range(96)]
    labels = km.chunk_clusters(10, 3)
    assert labels.tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert km.chunk_clusters(5, 5).tolist() == [0, 1, 2, 3, 4]
    sizes = torch.bincount(km.chunk_clusters(37, 6))
    assert sizes.max() - sizes.min() <= 1 and sizes.sum() == 37
    with pytest.raises(ValueError):
        km.chunk_clusters(3, 4)


def test_dispatch_auto_on_cpu_is_reference():
    x = torch.randn(2, 12, 6, generator=torch.Generator().manual_seed(0))
    a = km.spherical_kmeans(x, 3, generator=torch.Generator().manual_seed(1))
    b = km.reference_spherical_kmeans(x, 3, generator=torch.Generator().manual_seed(1))
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert torch.equal(km.kmeans_assign(x, a.centroids), km.reference_kmeans_assign(x, a.centroids))


# ----------------------------------------------------------------------------- triton


@needs_triton
@FAST
@given(kmeans_cases(), st.sampled_from(DTYPES), st.booleans())
def test_triton_assign_matches_reference(kdev, case, dtype, duplicate):
    x, k, _, seed, valid = case
    x = x.to(dtype)
    cents = torch.randn(x.shape[0], k, x.shape[2], generator=torch.Generator().manual_seed(seed + 1))
    if duplicate:  # exact ties between clusters
        cents[:, -1] = cents[:, 0]
    ref = km.reference_kmeans_assign(x, cents, valid)
    out = km.kmeans_assign_triton(x.to(kdev), cents.to(kdev), valid.to(kdev))
    assert out.dtype == torch.int64 and torch.equal(out.cpu(), ref)


@needs_triton
def test_triton_assign_large_d_and_ties(kdev):
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 40, 600, generator=gen)
    x[:, 5] = 0.0  # zero point: all scores 0 -> label 0
    cents = torch.randn(2, 6, 600, generator=gen)
    cents[:, 3] = cents[:, 1] * 2.0  # same direction as cluster 1
    ref = km.reference_kmeans_assign(x, cents)
    assert (ref[:, 5] == 0).all() and not (ref == 3).any()
    assert torch.equal(km.kmeans_assign_triton(x.to(kdev), cents.to(kdev)).cpu(), ref)


@needs_triton
def test_triton_kmeans_matches_reference(kdev):
    x = torch.randn(3, 20, 16, generator=torch.Generator().manual_seed(11))
    valid = torch.rand(3, 20, generator=torch.Generator().manual_seed(12)) > 0.2
    ref = km.reference_spherical_kmeans(x, 4, generator=torch.Generator().manual_seed(5), valid=valid)
    out = km.spherical_kmeans(
        x.to(kdev), 4, generator=torch.Generator().manual_seed(5), valid=valid.to(kdev), backend="triton"
    )
    assert torch.equal(out.labels.cpu(), ref.labels) and torch.equal(out.counts.cpu(), ref.counts)
    torch.testing.assert_close(out.centroids.cpu(), ref.centroids)
