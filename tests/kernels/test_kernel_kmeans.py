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


def naive_kmeans_group(pts, valid, keys, k, iters, enabled=None):
    """The documented algorithm for one group, with Python lists (float64)."""
    n, d = len(pts), len(pts[0])
    enabled = [True] * k if enabled is None else enabled
    pts = [p if v else [0.0] * d for p, v in zip(pts, valid)]  # invalid points count as zero
    order = sorted((i for i in range(n) if valid[i]), key=lambda i: -keys[i])
    starts = iter(order)  # enabled clusters, in index order, take the points with the largest keys
    picks = [next(starts, None) if on else None for on in enabled]
    cents = [list(pts[i]) if i is not None else [0.0] * d for i in picks]
    on_idx = [j for j in range(k) if enabled[j]]
    labels = [-1] * n
    counts = [0] * k
    for _ in range(iters):
        sub = naive_assign(pts, [cents[j] for j in on_idx])
        labels = [on_idx[sub[i]] if valid[i] else -1 for i in range(n)]
        # reseed: r-th empty enabled cluster <- r-th farthest eligible point
        cos = {i: _dot(_unit(pts[i]), _unit(cents[labels[i]])) for i in range(n) if valid[i]}
        closest = {}
        for i in sorted(cos, key=lambda i: (-cos[i], i)):
            closest.setdefault(labels[i], i)
        eligible = sorted((i for i in cos if closest[labels[i]] != i), key=lambda i: (cos[i], i))
        empty = [j for j in on_idx if j not in set(labels)]
        for j, i in zip(empty, eligible):
            labels[i] = j
        # update: mean of members, zero if empty
        counts = [labels.count(j) for j in range(k)]
        for j in range(k):
            members = [pts[i] for i in range(n) if labels[i] == j]
            cents[j] = [sum(col) / len(members) for col in zip(*members)] if members else [0.0] * d
    return cents, labels, counts


def naive_kmeans(x, k, iters, seed, valid, k_valid=None):
    keys = torch.rand(x.shape[:2], generator=torch.Generator().manual_seed(seed))
    out = [
        naive_kmeans_group(
            x[g].double().tolist(),
            valid[g].tolist(),
            keys[g].tolist(),
            k,
            iters,
            None if k_valid is None else k_valid[g].tolist(),
        )
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


@st.composite
def k_valid_masks(draw, g: int, k: int):
    """``None`` or a ``[G, k]`` bool mask with at least one enabled cluster per group."""
    if not draw(st.booleans()):
        return None
    rows = [draw(st.lists(st.booleans(), min_size=k, max_size=k).filter(any)) for _ in range(g)]
    return torch.tensor(rows)


def check_invariants(
    res: km.KMeansResult, x: torch.Tensor, k: int, valid: torch.Tensor, k_valid: torch.Tensor | None = None
) -> None:
    cents, labels, counts = res
    g, n, d = x.shape
    enabled = torch.ones(g, k, dtype=torch.bool) if k_valid is None else k_valid
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
            else:
                assert (cents[gi, j] == 0).all(), "an empty cluster's centroid is zero"
    assert (counts[~enabled] == 0).all(), "a disabled cluster received points"
    for gi in range(g):
        if valid[gi].sum() >= enabled[gi].sum():
            assert (counts[gi][enabled[gi]] > 0).all(), "empty cluster although there are enough valid points"


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
@given(kmeans_cases(), st.data())
def test_reference_kmeans_matches_naive(case, data):
    x, k, iters, seed, valid = case
    k_valid = data.draw(k_valid_masks(x.shape[0], k))
    res = km.reference_spherical_kmeans(
        x, k, iters, torch.Generator().manual_seed(seed), valid, k_valid=k_valid
    )
    check_invariants(res, x, k, valid, k_valid)
    enabled = k if k_valid is None else k_valid.sum(1)
    if x.shape[2] < 2 or (valid.sum(1) < enabled).any():  # D = 1: all cosines +-1 (exact ties, topk order)
        return
    cents, labels, counts = naive_kmeans(x, k, iters, seed, valid, k_valid)
    assert torch.equal(res.labels, labels)
    assert torch.equal(res.counts, counts)
    torch.testing.assert_close(res.centroids.double(), cents, rtol=1e-5, atol=1e-5)


@FAST
@given(kmeans_cases(), st.sampled_from(DTYPES), st.data())
def test_kmeans_invariants(case, dtype, data):
    x, k, iters, seed, valid = case
    x = x.to(dtype)
    k_valid = data.draw(k_valid_masks(x.shape[0], k))
    res = km.reference_spherical_kmeans(
        x, k, iters, torch.Generator().manual_seed(seed), valid, k_valid=k_valid
    )
    check_invariants(res, x, k, valid, k_valid)


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
    with pytest.raises(ValueError, match="valid must be"):
        km.reference_spherical_kmeans(x, 2, valid=torch.ones(1, 4))
    with pytest.raises(ValueError, match="k_valid must be"):
        km.reference_spherical_kmeans(x, 2, k_valid=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="k_valid must be"):
        km.reference_kmeans_assign(x, torch.randn(1, 2, 3), k_valid=torch.ones(1, 2))


def test_kmeans_duplicate_centroids_ties_go_to_lowest_index():
    """Two clusters start at equal points: every tie goes to cluster 0, cluster 1 is reseeded with the far point."""
    x = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [2.0, 0.0]]])
    keys = torch.tensor([[0.9, 0.8, 0.1, 0.2]])
    res = km.reference_spherical_kmeans(x, 2, keys=keys)
    assert res.labels.tolist() == [[0, 0, 1, 0]] and res.counts.tolist() == [[3, 1]]
    torch.testing.assert_close(res.centroids, torch.tensor([[[4 / 3, 0.0], [0.0, 1.0]]]))


def test_kmeans_invalid_points_values_ignored():
    """Invalid points (padding) may hold anything, even non-finite values."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 12, 5, generator=gen)
    valid = torch.rand(3, 12, generator=gen) > 0.3
    keys = torch.rand(3, 12, generator=gen)
    a = km.reference_spherical_kmeans(x, 3, valid=valid, keys=keys)
    junk = x.masked_fill(~valid[..., None], float("nan"))
    junk[~valid] = torch.where(
        torch.rand(junk[~valid].shape, generator=gen) > 0.5, float("inf"), float("nan")
    )
    b = km.reference_spherical_kmeans(junk, 3, valid=valid, keys=keys)
    assert torch.equal(a.labels, b.labels) and torch.equal(a.counts, b.counts)
    assert torch.equal(a.centroids, b.centroids)


def test_kmeans_k_valid_disabled_clusters():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4, 16, 8, generator=gen)
    k_valid = torch.tensor(
        [
            [True] * 5,
            [True, True, True, False, False],
            [False, True, False, True, True],
            [True, False, False, False, False],
        ]
    )
    res = km.reference_spherical_kmeans(x, 5, keys=torch.rand(4, 16, generator=gen), k_valid=k_valid)
    check_invariants(res, x, 5, torch.ones(4, 16, dtype=torch.bool), k_valid)
    assert torch.equal(res.counts > 0, k_valid)
    assert (res.centroids[~k_valid] == 0).all()
    assert torch.equal(torch.gather(k_valid, 1, res.labels), torch.ones(4, 16, dtype=torch.bool))
    torch.testing.assert_close(res.centroids[3, 0], x[3].mean(0))  # one enabled cluster: the mean


def _stack_parts(parts):
    """Parts ``(x [B, n_i, D], keys [B, n_i], k_i)`` -> groups padded to ``N_max``, ``valid``, ``keys``, ``k_valid``."""
    n_max = max(p[0].shape[1] for p in parts)
    k_max = max(p[2] for p in parts)
    xs, valids, keys, kvs = [], [], [], []
    for x, key, k in parts:
        b, n, d = x.shape
        xs.append(torch.cat([x, torch.zeros(b, n_max - n, d)], 1))
        valids.append(torch.arange(n_max).expand(b, n_max) < n)
        keys.append(torch.cat([key, torch.rand(b, n_max - n)], 1))  # padding keys are arbitrary
        kvs.append(torch.arange(k_max).expand(b, k_max) < k)
    return torch.cat(xs), k_max, torch.cat(valids), torch.cat(keys), torch.cat(kvs)


@pytest.mark.parametrize("seed", range(4))
def test_kmeans_stacked_parts_equal_separate_calls(seed):
    """A 5-cluster prefix part and a 3-cluster suffix part in one call (padded groups, clusters 3, 4 disabled
    for the suffix) give the results of two separate calls with the same keys."""
    gen = torch.Generator().manual_seed(seed)
    b, d = 2, 32
    parts = [
        (torch.randn(b, n, d, generator=gen), torch.rand(b, n, generator=gen), k)
        for n, k in ((24, 5), (9, 3))
    ]
    parts[1][0][:, 4] = 0.0  # a zero point
    x, k_max, valid, keys, k_valid = _stack_parts(parts)
    both = km.spherical_kmeans(x, k_max, valid=valid, keys=keys, k_valid=k_valid)
    for i, (xp, kp, k) in enumerate(parts):
        alone = km.spherical_kmeans(xp, k, keys=kp)
        rows, n = slice(i * b, (i + 1) * b), xp.shape[1]
        assert torch.equal(both.labels[rows, :n], alone.labels)
        assert (both.labels[rows, n:] == -1).all()
        assert torch.equal(both.counts[rows, :k], alone.counts) and (both.counts[rows, k:] == 0).all()
        torch.testing.assert_close(both.centroids[rows, :k], alone.centroids)
        assert (both.centroids[rows, k:] == 0).all()


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
@FAST
@given(kmeans_cases(), st.data())
def test_triton_assign_k_valid_matches_reference(kdev, case, data):
    x, k, _, seed, valid = case
    k_valid = (
        data.draw(k_valid_masks(x.shape[0], k)) if k > 1 else torch.ones(x.shape[0], 1, dtype=torch.bool)
    )
    if k_valid is None:
        k_valid = torch.ones(x.shape[0], k, dtype=torch.bool)
    cents = torch.randn(x.shape[0], k, x.shape[2], generator=torch.Generator().manual_seed(seed + 1))
    ref = km.reference_kmeans_assign(x, cents, valid, k_valid=k_valid)
    assert torch.gather(k_valid, 1, ref.clamp_min(0))[valid].all()
    out = km.kmeans_assign_triton(x.to(kdev), cents.to(kdev), valid.to(kdev), k_valid=k_valid.to(kdev))
    assert torch.equal(out.cpu(), ref)
    assert torch.equal(km.kmeans_assign(x, cents, valid, backend="reference", k_valid=k_valid), ref)


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


@needs_triton
def test_triton_kmeans_k_valid_matches_reference(kdev):
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(4, 18, 12, generator=gen)
    valid = torch.rand(4, 18, generator=gen) > 0.2
    keys = torch.rand(4, 18, generator=gen)
    k_valid = torch.tensor(
        [[True] * 5, [True] * 3 + [False] * 2, [False, True, True, False, True], [True] * 5]
    )
    ref = km.reference_spherical_kmeans(x, 5, valid=valid, keys=keys, k_valid=k_valid)
    out = km.spherical_kmeans(
        x.to(kdev), 5, valid=valid.to(kdev), keys=keys.to(kdev), k_valid=k_valid.to(kdev), backend="triton"
    )
    assert torch.equal(out.labels.cpu(), ref.labels) and torch.equal(out.counts.cpu(), ref.counts)
    torch.testing.assert_close(out.centroids.cpu(), ref.centroids)


# ----------------------------------------------------------------------------- torch.compile

COMPILE_SHAPE = (4, 20, 16, 5)  # G, N, D, k


@pytest.fixture(scope="module")
def compiled_kmeans():
    """``reference_spherical_kmeans`` compiled once (CPU inductor, fullgraph, static shapes); compile seconds."""
    import time

    g, n, d, k = COMPILE_SHAPE
    fn = torch.compile(km.reference_spherical_kmeans, fullgraph=True, dynamic=False)
    x = torch.randn(g, n, d)
    start = time.perf_counter()
    fn(
        x,
        k,
        5,
        valid=torch.ones(g, n, dtype=torch.bool),
        keys=torch.rand(g, n),
        k_valid=torch.ones(g, k, dtype=torch.bool),
    )
    return fn, time.perf_counter() - start


@pytest.mark.parametrize("seed", range(6))
def test_compiled_kmeans_equals_eager(compiled_kmeans, seed):
    """No host syncs or data-dependent shapes: fullgraph compiles, and compiled == eager exactly."""
    fn, seconds = compiled_kmeans
    print(f"compile time {seconds:.1f} s")
    g, n, d, k = COMPILE_SHAPE
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(g, n, d, generator=gen)
    if seed % 2:  # duplicate points: exact ties between clusters
        x[:, 1::3] = x[:, :1]
    valid = torch.rand(g, n, generator=gen) > (0.3 if seed < 4 else 0.9)  # seeds 4, 5: few valid points
    keys = torch.rand(g, n, generator=gen)
    k_valid = torch.rand(g, k, generator=gen) > 0.3
    k_valid[:, 0] = True
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = fn(x, k, 5, valid=valid, keys=keys, k_valid=k_valid)
    ref = km.reference_spherical_kmeans(x, k, 5, valid=valid, keys=keys, k_valid=k_valid)
    assert torch.equal(out.labels, ref.labels) and torch.equal(out.counts, ref.counts)
    torch.testing.assert_close(out.centroids, ref.centroids, rtol=1e-5, atol=1e-6)
    check_invariants(ref, x, k, valid, k_valid)
