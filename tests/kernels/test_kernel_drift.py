"""Tests for ``polestar.kernels.drift``: references vs naive float64 loops, invariants, Triton."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polestar.kernels import drift as dr

FAST = settings(
    max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
needs_triton = pytest.mark.skipif(not dr.HAS_TRITON, reason="triton not importable")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = dr.DEFAULT_EPS


# ----------------------------------------------------------------------------- naive float64 loops


def naive_kl_sum(p: list[float], q: list[float], eps: float = EPS) -> float:
    """Unclamped sum of p log(p/q) (rows need not be normalised, so it can be < 0)."""
    s = 0.0
    for a, b in zip(p, q):
        a = max(a, 0.0)
        if a > 0:
            s += a * (math.log(max(a, eps)) - math.log(max(b, eps)))
    return s


def naive_kl(p: list[float], q: list[float], eps: float = EPS) -> float:
    return max(naive_kl_sum(p, q, eps), 0.0)


def naive_js(p: list[float], q: list[float], eps: float = EPS) -> float:
    p = [max(a, 0.0) for a in p]
    q = [max(b, 0.0) for b in q]
    m = [(a + b) / 2 for a, b in zip(p, q)]
    return max(0.5 * naive_kl_sum(p, m, eps) + 0.5 * naive_kl_sum(q, m, eps), 0.0)


def naive_cos(p: list[float], q: list[float]) -> float:
    dot = sum(a * b for a, b in zip(p, q))
    npp = math.sqrt(sum(a * a for a in p))
    nqq = math.sqrt(sum(b * b for b in q))
    if npp == 0 or nqq == 0:
        return 0.0 if npp == nqq else 1.0
    return min(max(1.0 - dot / (npp * nqq), 0.0), 2.0)


def naive_entropy(x: list[float]) -> float:
    finite = [v for v in x if v != -math.inf]
    if not finite:
        return 0.0
    mx = max(finite)
    z = sum(math.exp(v - mx) for v in finite)
    probs = [math.exp(v - mx) / z for v in finite]
    return max(-sum(pr * math.log(pr) for pr in probs if pr > 0), 0.0)


def rowwise(fn, *tensors: torch.Tensor) -> torch.Tensor:
    """Apply a naive per-row function to ``[..., N]`` tensors -> ``[...]`` float64."""
    lead = tensors[0].shape[:-1]
    rows = [t.double().reshape(-1, t.shape[-1]).tolist() for t in tensors]
    return torch.tensor([fn(*r) for r in zip(*rows)], dtype=torch.float64).reshape(lead)


def rel_rms(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-12) -> float:
    """``rms(a - b) / max(rms(b), floor)``; the floor is the natural scale of the metric, so that
    fp32 cancellation on near-zero outputs is not judged relative to a tiny denominator."""
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(floor)).item()


def assert_close_to(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-4, atol: float = 2e-5):
    assert actual.dtype == torch.float32
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------- strategies


@st.composite
def dist_pairs(draw, max_n: int = 40):
    """Two ``[..., N]`` attention-like tensors, possibly with zeros, possibly equal."""
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    n = draw(st.integers(1, max_n))
    dtype = draw(st.sampled_from(DTYPES))
    temp = draw(st.sampled_from([0.1, 1.0, 6.0]))
    zero_frac = draw(st.sampled_from([0.0, 0.3, 0.9]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    p = torch.softmax(torch.randn(*lead, n, generator=gen) * temp, -1)
    q = torch.softmax(torch.randn(*lead, n, generator=gen) * temp, -1)
    p = p.masked_fill(torch.rand(p.shape, generator=gen) < zero_frac, 0.0)
    q = q.masked_fill(torch.rand(q.shape, generator=gen) < zero_frac, 0.0)
    if draw(st.booleans()):
        q = p.clone()
    return p.to(dtype), q.to(dtype)


@st.composite
def logits(draw, max_n: int = 40):
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    n = draw(st.integers(1, max_n))
    dtype = draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(*lead, n, generator=gen) * draw(st.sampled_from([0.01, 1.0, 20.0]))
    ninf = draw(st.sampled_from([0.0, 0.3, 1.0]))
    x = x.masked_fill(torch.rand(x.shape, generator=gen) < ninf, float("-inf"))
    return x.to(dtype)


# ----------------------------------------------------------------------------- references vs naive


@FAST
@given(dist_pairs())
def test_reference_kl_matches_naive(pq):
    p, q = pq
    assert_close_to(dr.reference_kl_drift(p, q), rowwise(naive_kl, p, q))


@FAST
@given(dist_pairs())
def test_reference_js_matches_naive(pq):
    p, q = pq
    assert_close_to(dr.reference_js_drift(p, q), rowwise(naive_js, p, q))


@FAST
@given(dist_pairs())
def test_reference_cosine_matches_naive(pq):
    p, q = pq
    assert_close_to(dr.reference_cosine_drift(p, q), rowwise(naive_cos, p, q), atol=1e-6)


@FAST
@given(logits())
def test_reference_entropy_matches_naive(x):
    assert_close_to(dr.reference_entropy(x), rowwise(naive_entropy, x))


# ----------------------------------------------------------------------------- invariants


PAIR_REFS = [dr.reference_kl_drift, dr.reference_js_drift, dr.reference_cosine_drift]


@FAST
@given(dist_pairs())
def test_pair_metrics_nonnegative_finite_and_zero_on_equal(pq):
    p, q = pq
    for fn in PAIR_REFS:
        d = fn(p, q)
        assert torch.isfinite(d).all() and (d >= 0).all()
    assert (dr.reference_kl_drift(p, p) == 0).all()
    assert (dr.reference_js_drift(p, p) == 0).all()
    assert (dr.reference_cosine_drift(p, p) < 1e-6).all()
    assert (dr.reference_js_drift(p, q) <= math.log(2) + 1e-5).all()


@pytest.mark.parametrize("fn", PAIR_REFS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_pair_metric_edge_rows(fn, dtype):
    n = 8
    uniform = torch.full((n,), 1.0 / n)
    onehot = torch.zeros(n)
    onehot[3] = 1.0
    zeros = torch.zeros(n)
    p = torch.stack([uniform, uniform, onehot, onehot, zeros, zeros]).to(dtype)
    q = torch.stack([uniform, onehot, uniform, onehot, zeros, uniform]).to(dtype)
    d = fn(p, q)
    assert d.shape == (6,) and d.dtype == torch.float32
    assert torch.isfinite(d).all() and (d >= 0).all()
    assert d[0] < 1e-6 and d[3] < 1e-6 and d[4] < 1e-6  # equal rows
    assert d[1] > 0.1 and d[2] > 0.1


def test_kl_known_values():
    p = torch.tensor([[0.5, 0.5], [1.0, 0.0]])
    q = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    expected = torch.tensor([0.5 * math.log(2) + 0.5 * math.log(2 / 3), math.log(2)])
    torch.testing.assert_close(dr.reference_kl_drift(p, q), expected)
    # q with a zero where p > 0 is finite (eps floor) and large
    d = dr.reference_kl_drift(torch.tensor([0.5, 0.5]), torch.tensor([1.0, 0.0]))
    assert torch.isfinite(d) and d > 5


def test_entropy_edge_rows():
    n = 16
    x = torch.zeros(4, n)
    x[1, 1:] = float("-inf")  # one finite logit -> entropy 0
    x[2] = float("-inf")  # all masked -> 0
    x[3, ::2] = float("-inf")  # uniform over n/2
    h = dr.reference_entropy(x)
    torch.testing.assert_close(h, torch.tensor([math.log(n), 0.0, 0.0, math.log(n // 2)]))


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        dr.reference_kl_drift(torch.rand(2, 3), torch.rand(2, 4))


# ----------------------------------------------------------------------------- head mean and dispatch


def test_head_mean_kl_drift_shape_and_value():
    gen = torch.Generator().manual_seed(0)
    b, h, q_len, k_len = 2, 3, 4, 9
    cur = torch.softmax(torch.randn(b, h, q_len, k_len, generator=gen), -1)
    prev = torch.softmax(torch.randn(b, h, q_len, k_len, generator=gen), -1)
    d = dr.head_mean_kl_drift(cur, prev)
    assert d.shape == (b, q_len)
    expected = rowwise(naive_kl, cur, prev).mean(dim=1)
    assert_close_to(d, expected)


def test_auto_backend_on_cpu_is_reference():
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(3, 17, generator=gen), -1)
    q = torch.softmax(torch.randn(3, 17, generator=gen), -1)
    x = torch.randn(3, 17, generator=gen)
    assert torch.equal(dr.kl_drift(p, q), dr.reference_kl_drift(p, q))
    assert torch.equal(dr.js_drift(p, q), dr.reference_js_drift(p, q))
    assert torch.equal(dr.cosine_drift(p, q), dr.reference_cosine_drift(p, q))
    assert torch.equal(dr.entropy(x), dr.reference_entropy(x))
    for fn in (dr.kl_drift, dr.js_drift, dr.cosine_drift):  # one signature: (p, q, eps, backend)
        assert fn(p, q, eps=EPS, backend="reference").shape == (3,)
    with pytest.raises(ValueError):
        dr.kl_drift(p, q, backend="cuda")


# ----------------------------------------------------------------------------- triton


TRITON_PAIRS = [
    (dr.kl_drift_triton, dr.reference_kl_drift),
    (dr.js_drift_triton, dr.reference_js_drift),
    (dr.cosine_drift_triton, dr.reference_cosine_drift),
]


def assert_kernel_matches(out: torch.Tensor, ref: torch.Tensor, floor: float = 0.1) -> None:
    """Relative RMS error < 1e-5 (relative to at least ``floor``: 0.1 for drifts, 1 nat for entropy)."""
    assert out.shape == ref.shape and out.dtype == torch.float32
    out = out.cpu()
    assert torch.isfinite(out).all() and (out >= 0).all()
    assert rel_rms(out, ref, floor) < 1e-5


@needs_triton
@FAST
@given(dist_pairs(max_n=70))
def test_triton_pair_metrics_match_reference(kdev, pq):
    p, q = pq
    for kernel, ref in TRITON_PAIRS:
        assert_kernel_matches(kernel(p.to(kdev), q.to(kdev)), ref(p, q))
    assert (dr.kl_drift_triton(p.to(kdev), p.to(kdev)) == 0).all()
    assert (dr.js_drift_triton(p.to(kdev), p.to(kdev)) == 0).all()


@needs_triton
@FAST
@given(logits(max_n=70))
def test_triton_entropy_matches_reference(kdev, x):
    assert_kernel_matches(dr.entropy_triton(x.to(kdev)), dr.reference_entropy(x), floor=1.0)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_long_rows_and_strided_input(kdev, dtype):
    """N larger than the kernel block (several loop iterations) and a non-contiguous view."""
    gen = torch.Generator().manual_seed(3)
    n = 2 * 2048 + 37
    p = torch.softmax(torch.randn(3, n, generator=gen) * 4, -1).to(dtype)
    q = torch.softmax(torch.randn(n, 3, generator=gen) * 4, 0).to(dtype).t()  # strided rows
    for kernel, ref in TRITON_PAIRS:
        assert_kernel_matches(kernel(p.to(kdev), q.to(kdev)), ref(p, q))
    x = torch.randn(2, n, generator=gen).to(dtype)
    x[0, : n // 2] = float("-inf")
    assert_kernel_matches(dr.entropy_triton(x.to(kdev)), dr.reference_entropy(x), floor=1.0)


@needs_triton
def test_triton_head_mean_and_explicit_backend(kdev):
    gen = torch.Generator().manual_seed(4)
    cur = torch.softmax(torch.randn(2, 4, 3, 33, generator=gen), -1)
    prev = torch.softmax(torch.randn(2, 4, 3, 33, generator=gen), -1)
    out = dr.head_mean_kl_drift(cur.to(kdev), prev.to(kdev), backend="triton")
    assert_kernel_matches(out, dr.head_mean_kl_drift(cur, prev, backend="reference"))


@needs_triton
def test_triton_empty_rows(kdev):
    p = torch.rand(0, 5, device=kdev)
    assert dr.kl_drift_triton(p, p).shape == (0,)
    assert dr.entropy_triton(p).shape == (0,)
