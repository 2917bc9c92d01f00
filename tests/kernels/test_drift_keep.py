"""Tests for ``polestar.kernels.drift_keep``: Triton kernel vs reference, fused op, opcheck, compile."""

from __future__ import annotations

import pytest
import torch

from polestar.kernels import drift as dr
from polestar.kernels import drift_keep as dk
from tests.kernels.conftest import kernel_device

needs_triton = pytest.mark.skipif(not dk.HAS_TRITON, reason="triton not importable")
METRICS = list(dk.METRICS)


def case(b: int, h: int, r: int, n: int, seed: int = 0, transposed: bool = False):
    """``cur, prev [B, H, R, N]`` softmax rows with some exact zeros (non-contiguous views if ``transposed``),
    ``due [B]`` mixed."""
    g = torch.Generator().manual_seed(seed)

    def rows():
        x = torch.softmax(torch.randn(b, h, r, n, generator=g) * 3, -1)
        x = x.masked_fill(torch.rand(x.shape, generator=g) < 0.2, 0.0)
        return x.transpose(1, 2).contiguous().transpose(1, 2) if transposed else x

    cur, prev = rows(), rows()
    prev[:, :, : r // 2] = cur[:, :, : r // 2]  # some equal rows: drift 0
    due = torch.arange(b) % 2 == 0
    return cur, prev, due


def run_ref(cur, prev, due, metric, eps=dk.DEFAULT_EPS):
    prev = prev.clone()
    return dk.reference_drift_keep(cur, prev, due, dk.METRICS[metric], eps), prev


SHAPES = [(1, 1, 1, 1), (2, 3, 4, 7), (3, 1, 5, 33), (3, 2, 3, 2500), (2, 4, 6, 64)]


@needs_triton
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_triton_matches_reference(metric, shape, transposed):
    dev = kernel_device()
    cur, prev, due = case(*shape, seed=sum(shape), transposed=transposed)
    ref_d, ref_prev = run_ref(cur, prev, due, metric)
    c, p = cur.to(dev), prev.clone().to(dev)  # both keep their strides
    assert c.stride() == cur.stride() and p.stride() == prev.stride()
    d = dk.drift_keep(c, p, due.to(dev), metric, backend="triton")
    assert d.shape == ref_d.shape and d.dtype == torch.float32
    torch.testing.assert_close(d.cpu(), ref_d, rtol=1e-5, atol=1e-6)
    assert torch.equal(p.cpu(), ref_prev)
    assert torch.equal(ref_prev[due], cur[due]) and torch.equal(ref_prev[~due], prev[~due])


@needs_triton
def test_triton_strided_slices_and_empty():
    dev = kernel_device()
    cur, prev, due = case(3, 2, 8, 40, seed=5)
    big = torch.zeros(3, 2, 8, 80)
    big[..., ::2] = prev
    big = big.to(dev)
    p = big[..., ::2]  # last-dim stride 2, written in place through the view
    ref_d, ref_prev = run_ref(cur, prev, due, "js")
    d = dk.drift_keep_triton(cur.to(dev), p, due.to(dev), 1, dk.DEFAULT_EPS)
    torch.testing.assert_close(d.cpu(), ref_d, rtol=1e-5, atol=1e-6)
    assert torch.equal(p.cpu(), ref_prev) and (big[..., 1::2] == 0).all()
    e, no = torch.empty(0, 2, 3, 4, device=dev), torch.empty(0, dtype=torch.bool, device=dev)
    assert dk.drift_keep(e, e.clone(), no, 0, backend="triton").shape == (0, 3)


@pytest.mark.parametrize("metric", METRICS)
def test_fused_cpu_is_reference_bit_for_bit(metric):
    cur, prev, due = case(3, 4, 5, 17, seed=1)
    ref_d, ref_prev = run_ref(cur, prev, due, metric)
    p = prev.clone()
    d = dk.drift_keep(cur, p, due, metric)
    assert torch.equal(d, ref_d) and torch.equal(p, ref_prev)
    if metric == "kl":  # the composition it replaces
        old = dr.kl_drift(cur, prev).mean(1)
        kept = torch.where(due[:, None, None, None], cur, prev)
        assert torch.equal(d, old) and torch.equal(p, kept)


def test_opcheck():
    cur, prev, due = case(2, 2, 3, 5, seed=2)
    for metric in range(3):
        torch.library.opcheck(torch.ops.polestar_fused.drift_keep.default, (cur, prev.clone(), due, metric, 1e-10))


def test_compile_aot_eager_mutates_prev_like_eager():
    torch._dynamo.reset()

    def f(cur, prev, due):
        return dk.drift_keep(cur, prev, due, "kl") * 1.0

    cur, prev, due = case(3, 2, 4, 9, seed=3)
    p_eager, p_comp = prev.clone(), prev.clone()
    eager = f(cur, p_eager, due)
    comp = torch.compile(f, fullgraph=True, backend="aot_eager")(cur, p_comp, due)
    assert torch.equal(comp, eager) and torch.equal(p_comp, p_eager)
    assert not torch.equal(p_comp, prev)


@pytest.mark.parametrize(
    "cur, prev, due, metric",
    [
        (torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 5), torch.ones(2, dtype=torch.bool), 0),
        (torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), torch.ones(2, dtype=torch.bool), 0),
        (torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4), torch.ones(3, dtype=torch.bool), 0),
        (torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4), torch.ones(2), 0),
        (torch.zeros(2, 1, 3, 4).half(), torch.zeros(2, 1, 3, 4).half(), torch.ones(2, dtype=torch.bool), 0),
        (torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4), torch.ones(2, dtype=torch.bool), 3),
        (torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4), torch.ones(2, dtype=torch.bool), "entropy"),
    ],
)
def test_bad_arguments_raise(cur, prev, due, metric):
    for backend in ("auto", "reference") + (("triton",) if dk.HAS_TRITON else ()):
        with pytest.raises(ValueError):
            dk.drift_keep(cur, prev, due, metric, backend=backend)
