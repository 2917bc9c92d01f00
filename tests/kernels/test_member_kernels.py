"""Tests for ``polestar.kernels.member_choice``: the Triton kernels (under the interpreter on CPU) against the torch
references, the fused ops on CPU, argument checks."""

from __future__ import annotations

import pytest
import torch

from polestar.kernels import member_choice as mc

needs_triton = pytest.mark.skipif(not mc.HAS_TRITON, reason="triton not importable")
RES = mc.DRIFT_RESOLUTION


# ----------------------------------------------------------------------------- inputs


def member_case(b: int, k: int, nw: int, seed: int, drift_dtype: torch.dtype = torch.float32):
    """Random member-choice inputs with many ties: drifts on the grid, half-way between grid points, just off
    them and unrounded; empty clusters, labels -1, columns outside the window, rows not due."""
    g = torch.Generator().manual_seed(seed)
    steps = torch.randint(-4, 8, (b, k), generator=g).double()
    kind = torch.randint(0, 4, (b, k), generator=g)
    frac = torch.stack([torch.zeros(b, k), torch.full((b, k), 0.5), torch.full((b, k), 0.4999),
                        torch.rand(b, k, generator=g)]).double()
    frac = frac.gather(0, kind[None])[0]
    drift = ((steps + frac) * RES).to(drift_dtype)
    counts = torch.randint(0, 4, (b, k), generator=g) * (torch.rand(b, k, generator=g) < 0.8)
    labels = torch.randint(-1, k, (b, nw), generator=g)
    window_valid = torch.rand(b, nw, generator=g) < 0.85
    due = torch.rand(b, generator=g) < 0.8
    if b > 0:
        due[0] = True
    return drift, counts, labels, window_valid, due


def strided(t: torch.Tensor, device: str) -> torch.Tensor:
    """``t``'s values on ``device`` in a non-contiguous view (every other element of the last dimension of a larger
    buffer)."""
    out = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=device)[..., ::2]
    return out.copy_(t)


def assert_members_equal(kdev, drift, counts, labels, window_valid, due, k, capacity, trash):
    ref = mc.reference_cluster_members(drift, counts, labels, window_valid, due, k, capacity, trash)
    out = mc.cluster_members_triton(drift.to(kdev), counts.to(kdev), labels.to(kdev), window_valid.to(kdev),
                                    due.to(kdev), k, capacity, trash)
    for name, a, r in zip(("rows", "valid", "chosen"), out, ref):
        assert a.dtype == r.dtype and a.shape == r.shape, name
        assert torch.equal(a.cpu(), r), (name, a, r)
    return ref


# ----------------------------------------------------------------------------- member choice (Triton)


@needs_triton
@pytest.mark.parametrize(
    "b, k, nw, seed",
    [(1, 1, 1, 0), (3, 5, 17, 1), (4, 8, 40, 2), (2, 3, 64, 3), (2, 70, 130, 4)],
)
def test_triton_cluster_members_matches_reference(kdev, b, k, nw, seed):
    args = member_case(b, k, nw, seed)
    third = max(1, nw // 3)
    # k: none, one, some, all, more than K; capacity: one slot, fewer than the members, the whole window
    for n_sel, capacity in [(0, nw), (1, 1), (k // 2, third), (k, nw), (k + 3, third), (k + 3, nw)]:
        assert_members_equal(kdev, *args, n_sel, capacity, trash=nw)


@needs_triton
def test_triton_capacity_below_chosen_members(kdev):
    drift, counts, labels, window_valid, due = member_case(3, 6, 48, 7)
    counts.fill_(2)
    due.fill_(True)
    rows, valid, chosen = assert_members_equal(kdev, drift, counts, labels, window_valid, due, 6, 5, trash=999)
    assert valid.all() and chosen.all()  # more members than slots: every slot is used


@needs_triton
def test_triton_rounding_half_to_even_and_ties(kdev):
    # one member per cluster and k = K: the rows give the whole ranking
    pairs = [[2.0, 2.5], [3.0, 2.5], [3.0, 3.5], [-2.0, -2.5], [-3.0, -2.5], [0.5, 0.0], [-0.5, 0.0],
             [1.5, 2.0], [1.5, 1.0], [2.4999, 2.0], [2.5001, 3.0], [2.5001, 2.0], [1e7 + 0.5, 1e7],
             [2.0**23 + 1, 2.0**23 + 2]]
    drift = torch.tensor(pairs, dtype=torch.float64).mul(RES).float()
    b = drift.shape[0]
    counts = torch.ones(b, 2, dtype=torch.long)
    labels = torch.tensor([[0, 1]] * b)
    ones = torch.ones(b, 2, dtype=torch.bool)
    rows, _, _ = assert_members_equal(kdev, drift, counts, labels, ones, ones[:, 0], 2, 2, trash=2)
    expected = [[0, 1], [0, 1], [1, 0], [0, 1], [1, 0], [0, 1], [0, 1], [0, 1], [0, 1], [0, 1], [0, 1], [0, 1],
                [0, 1], [1, 0]]
    assert rows.tolist() == expected


@needs_triton
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_triton_special_drifts(kdev):
    # huge drifts overflow to inf on the grid, NaN sorts first (as torch.sort), empty clusters last
    nan, inf = float("nan"), float("inf")
    drift = torch.tensor([[nan, 1.0, nan, 1e35, inf, -inf, 0.0, 2e35],
                          [-inf, -inf, 5.0, -1e36, nan, 0.0, -0.0, 1e-40]])
    counts = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 1], [1, 0, 2, 1, 0, 1, 1, 1]])
    labels = torch.arange(8).repeat(2, 2)
    window_valid = torch.ones(2, 16, dtype=torch.bool)
    due = torch.ones(2, dtype=torch.bool)
    for n_sel in (3, 8):
        assert_members_equal(kdev, drift, counts, labels, window_valid, due, n_sel, 16, trash=16)


@needs_triton
@pytest.mark.parametrize("drift_dtype", [torch.bfloat16, torch.float64])
def test_triton_drift_dtypes_and_int32_counts(kdev, drift_dtype):
    drift, counts, labels, window_valid, due = member_case(2, 6, 20, 11, drift_dtype)
    assert_members_equal(kdev, drift, counts.int(), labels, window_valid, due, 3, 12, trash=20)


@needs_triton
def test_triton_strided_inputs(kdev):
    drift, counts, labels, window_valid, due = member_case(3, 7, 24, 5)
    args = (drift.to(kdev).t().contiguous().t(), strided(counts, kdev), strided(labels, kdev),
            window_valid.to(kdev).t().contiguous().t(), strided(due, kdev))
    assert not any(t.is_contiguous() for t in args)
    ref = mc.reference_cluster_members(drift, counts, labels, window_valid, due, 4, 10, 24)
    out = mc.cluster_members_triton(*args, 4, 10, 24)
    assert all(torch.equal(a.cpu(), r) for a, r in zip(out, ref))


@needs_triton
def test_triton_no_row_due_and_empty_batch(kdev):
    drift, counts, labels, window_valid, due = member_case(2, 4, 9, 6)
    rows, valid, chosen = assert_members_equal(kdev, drift, counts, labels, window_valid, due.fill_(False), 4, 9,
                                               trash=-7)
    assert not valid.any() and not chosen.any() and (rows == -7).all()
    empty = member_case(0, 4, 9, 6)
    rows, valid, chosen = assert_members_equal(kdev, *empty, 2, 3, trash=9)
    assert rows.shape == (0, 3) and chosen.shape == (0, 4)


@needs_triton
def test_triton_no_slots_and_empty_window(kdev):
    # through the launcher (the public check may refuse capacity 0): chosen is still computed
    from polestar.kernels import _member_kernels

    for nw in (0, 9):
        args = member_case(3, 5, nw, 10)
        ref = mc.reference_cluster_members(*args, 2, 0, nw)
        out = _member_kernels.cluster_members(*(t.to(kdev) for t in args), 2, 0, nw)
        assert all(torch.equal(a.cpu(), r) for a, r in zip(out, ref))
        assert out[0].shape == (3, 0) and ref[2].any()


# ----------------------------------------------------------------------------- centroid shift (Triton)


def shift_case(b: int, k: int, nw: int, capacity: int, d: int, seed: int, dtype: torch.dtype = torch.float32):
    """Members from the reference member choice (trash row ``nw``), new/old values, in ``dtype``."""
    drift, counts, labels, window_valid, due = member_case(b, k, nw, seed)
    rows, valid, _ = mc.reference_cluster_members(drift, counts, labels, window_valid, due, max(k // 2, 1),
                                                  capacity, nw)
    g = torch.Generator().manual_seed(seed + 100)
    new = torch.randn(b, capacity, d, generator=g).to(dtype)
    old = torch.randn(b, capacity, d, generator=g).to(dtype)
    return labels, counts, rows, valid, new, old


def shift_tensors(kdev, *tensors):
    return [t.to(kdev) for t in tensors]


@needs_triton
@pytest.mark.parametrize("b, k, nw, capacity, d, seed", [(1, 1, 1, 1, 1, 0), (3, 5, 20, 20, 40, 1),
                                                         (2, 6, 33, 9, 200, 2)])
def test_triton_centroid_shift_matches_reference_fp32(kdev, b, k, nw, capacity, d, seed):
    case = shift_case(b, k, nw, capacity, d, seed)
    ref = mc.reference_centroid_shift(*case, torch.float32)
    out = mc.centroid_shift_triton(*shift_tensors(kdev, *case), torch.float32)
    assert out.dtype == torch.float32 and out.shape == ref.shape == (b, k, d)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-6)


@needs_triton
def test_triton_centroid_shift_bf16_and_cast(kdev):
    labels, counts, rows, valid, new, old = shift_case(2, 4, 24, 16, 48, 3, torch.bfloat16)
    ref = mc.reference_centroid_shift(labels, counts, rows, valid, new, old, torch.bfloat16)
    out = mc.centroid_shift_triton(*shift_tensors(kdev, labels, counts, rows, valid, new, old), torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=2e-2, atol=2e-2)
    exact = mc.reference_centroid_shift(labels, counts, rows, valid, new.double(), old.double(), torch.float64)
    torch.testing.assert_close(out.cpu().double(), exact, rtol=1e-2, atol=1e-2)
    # fp32 values into bf16 centroids: the cast is the last step
    new32, old32 = new.float(), old.float()
    ref = mc.reference_centroid_shift(labels, counts, rows, valid, new32, old32, torch.bfloat16)
    out = mc.centroid_shift_triton(*shift_tensors(kdev, labels, counts, rows, valid, new32, old32), torch.bfloat16)
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=1e-2, atol=1e-3)


@needs_triton
def test_triton_centroid_shift_strided_and_mixed_dtypes(kdev):
    labels, counts, rows, valid, new, old = shift_case(2, 5, 16, 12, 24, 4)
    new_h = new.half()  # cast to old's dtype first, as the reference
    new_s = new_h.to(kdev).transpose(1, 2).contiguous().transpose(1, 2)  # d not the unit stride
    args = (strided(labels, kdev), counts.to(kdev).t().contiguous().t(), rows.to(kdev).t().contiguous().t(),
            strided(valid, kdev), new_s, strided(old, kdev))
    assert not any(t.is_contiguous() for t in args)
    ref = mc.reference_centroid_shift(labels, counts, rows, valid, new_h, old, torch.float32)
    out = mc.centroid_shift_triton(*args, torch.float32)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-6)


@needs_triton
def test_triton_centroid_shift_empty(kdev):
    labels, counts, rows, valid, new, old = shift_case(0, 3, 8, 4, 6, 5)
    out = mc.centroid_shift_triton(*shift_tensors(kdev, labels, counts, rows, valid, new, old), torch.float32)
    assert out.shape == (0, 3, 6)
    labels, counts, rows, valid, new, old = shift_case(2, 3, 8, 4, 6, 5)
    valid = torch.zeros_like(valid)
    out = mc.centroid_shift_triton(*shift_tensors(kdev, labels, counts, rows, valid, new, old), torch.float32)
    assert (out.cpu() == 0).all()


# ----------------------------------------------------------------------------- fused ops and checks (CPU)


def test_fused_ops_on_cpu_equal_reference():
    args = member_case(3, 6, 30, 8)
    ref = mc.reference_cluster_members(*args, 3, 12, 30)
    for out in (torch.ops.polestar_fused.cluster_members(*args, 3, 12, 30),
                mc.cluster_members(*args, 3, 12, 30)):
        assert all(torch.equal(a, r) for a, r in zip(out, ref))
    case = shift_case(3, 6, 30, 12, 16, 8)
    ref = mc.reference_centroid_shift(*case, torch.bfloat16)
    for out in (torch.ops.polestar_fused.centroid_shift(*case, torch.bfloat16),
                mc.centroid_shift(*case, torch.bfloat16)):
        assert out.dtype == torch.bfloat16 and torch.equal(out, ref)


def test_member_args_checked():
    drift, counts, labels, window_valid, due = member_case(2, 4, 10, 9)
    good = dict(drift=drift, counts=counts, labels=labels, window_valid=window_valid, due=due)
    bad = [
        dict(counts=counts[:, :3]),
        dict(labels=labels[0]),
        dict(labels=labels[:1]),
        dict(window_valid=window_valid[:, :9]),
        dict(window_valid=window_valid.long()),
        dict(due=due[:1]),
        dict(due=due.long()),
    ]
    for change in bad:
        with pytest.raises(ValueError):
            mc.cluster_members(**{**good, **change}, k=2, capacity=5, trash=10, backend="reference")
    for capacity in (-1, 11):
        with pytest.raises(ValueError):
            mc.cluster_members(**good, k=2, capacity=capacity, trash=10, backend="reference")
    case = shift_case(2, 4, 10, 5, 8, 9)
    with pytest.raises(ValueError):
        mc.centroid_shift(*case[:4], case[4][:, :, :7], case[5], torch.float32, backend="reference")
