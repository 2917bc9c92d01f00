"""Tests for ``polestar.kernels.proxy_attention``.

The reference is checked against a naive float64 softmax; the Triton kernel (run by the interpreter
on CPU, see ``conftest.py``) against the references under hypothesis shapes: odd ``T``,
``P = C = 1``, GQA groups 1 / 2 / 4, rows without any valid key, fp32 and bf16 inputs.  The
kernel's block sizes are shrunk for the hypothesis tests so that several key / query blocks
(and fully masked blocks) are exercised with small, fast shapes.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polestar.kernels import proxy_attention as pa

FAST = settings(
    max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
needs_triton = pytest.mark.skipif(not pa.HAS_TRITON, reason="triton not importable")
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def rel_rms(actual: torch.Tensor, expected: torch.Tensor, floor: float = 1e-6) -> float:
    """``rms(actual - expected) / max(rms(expected), floor)`` in float64."""
    a, b = actual.double(), expected.double()
    if b.numel() == 0:
        return 0.0
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(floor)).item()


# ----------------------------------------------------------------------------- strategies


@st.composite
def attention_problems(draw, dtypes=(torch.float32, torch.bfloat16), max_t: int = 45, max_q: int = 2):
    """``(q [B,H,Q,hd], keys [B,Hkv,T,hd], key_valid [B,T], scale)``; some rows fully masked."""
    b = draw(st.integers(1, 2))
    hkv, group = draw(st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2), (1, 4)]))  # GQA groups 1 / 2 / 4
    nq = draw(st.integers(1, max_q))
    t = draw(st.integers(1, max_t))
    hd = draw(st.sampled_from([4, 7, 16, 24]))
    dtype = draw(st.sampled_from(dtypes))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mag = draw(st.sampled_from([0.5, 1.0, 3.0]))
    q = torch.randn(b, hkv * group, nq, hd, generator=gen) * mag
    k = torch.randn(b, hkv, t, hd, generator=gen) * mag
    density = draw(st.sampled_from([0.2, 0.7, 1.0]))
    valid = torch.rand(b, t, generator=gen) < density
    mode = draw(st.sampled_from(["random", "first_row_empty", "prefix_empty"]))
    if mode == "first_row_empty":
        valid[0] = False
    elif mode == "prefix_empty":  # the first key block(s) fully masked, later ones not
        valid[:, : t // 2] = False
        valid[:, -1] = True
    scale = hd**-0.5 * draw(st.sampled_from([0.5, 1.0, 2.0]))
    return q.to(dtype), k.to(dtype), valid, scale


@contextmanager
def small_blocks():
    """Force 16-wide key blocks so small shapes span several blocks."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pa, "_TILE", 16 * 16)
        yield


def naive_probs(q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """Float64 loops over (b, h, p): softmax over the valid keys, zeros elsewhere."""
    b, h, p, _ = q.shape
    hkv, t = k.shape[1], k.shape[2]
    out = torch.zeros(b, h, p, t, dtype=torch.float64)
    q64, k64 = q.double(), k.double()
    for bi in range(b):
        idx = valid[bi].nonzero().flatten().tolist()
        if not idx:
            continue
        for hi in range(h):
            kv = k64[bi, hi // (h // hkv), idx]
            for pi in range(p):
                s = [float(x) * scale for x in kv @ q64[bi, hi, pi]]
                m = max(s)
                e = [math.exp(x - m) for x in s]
                z = sum(e)
                out[bi, hi, pi, idx] = torch.tensor([x / z for x in e], dtype=torch.float64)
    return out


# ----------------------------------------------------------------------------- references


@FAST
@given(attention_problems(dtypes=(torch.float32,)))
def test_reference_proxy_matches_naive_and_is_a_masked_distribution(problem):
    q, k, valid, scale = problem
    probs = pa.reference_proxy_attention(q, k, valid, scale)
    assert probs.dtype == torch.float32 and probs.shape == (*q.shape[:3], k.shape[2])
    torch.testing.assert_close(probs.double(), naive_probs(q, k, valid, scale), rtol=1e-5, atol=1e-6)
    mask = valid[:, None, None, :].expand_as(probs)
    assert (probs[~mask] == 0).all()
    has_valid = valid.any(-1)[:, None, None].expand(probs.shape[:3])
    sums = probs.sum(-1)
    torch.testing.assert_close(sums[has_valid], torch.ones_like(sums[has_valid]), rtol=0, atol=1e-5)
    assert (probs.sum(-1)[~has_valid] == 0).all()


def test_argument_checks():
    q = torch.randn(1, 4, 2, 8)
    k = torch.randn(1, 2, 5, 8)
    valid = torch.ones(1, 5, dtype=torch.bool)
    with pytest.raises(ValueError):
        pa.reference_proxy_attention(q, torch.randn(1, 3, 5, 8), valid, 1.0)  # 4 % 3 != 0
    with pytest.raises(ValueError):
        pa.reference_proxy_attention(q, torch.randn(1, 2, 5, 6), valid, 1.0)  # hd mismatch
    with pytest.raises(ValueError):
        pa.reference_proxy_attention(q, k, valid.float(), 1.0)
    with pytest.raises(ValueError):
        pa.reference_proxy_attention(q, k, torch.ones(1, 4, dtype=torch.bool), 1.0)


def test_auto_backend_on_cpu_is_reference():
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 2, 3, 8, generator=gen), torch.randn(1, 1, 6, 8)
    valid = torch.tensor([[True, False, True, True, False, True]])
    assert torch.equal(pa.proxy_attention(q, k, valid, 0.3), pa.reference_proxy_attention(q, k, valid, 0.3))


# ----------------------------------------------------------------------------- triton vs reference


@needs_triton
@FAST
@given(problem=attention_problems())
def test_triton_proxy_matches_reference(kdev, problem):
    q, k, valid, scale = problem
    ref = pa.reference_proxy_attention(q, k, valid, scale)
    with small_blocks():
        out = pa.proxy_attention_triton(q.to(kdev), k.to(kdev), valid.to(kdev), scale).cpu()
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert rel_rms(out, ref) < TOL[q.dtype]
    assert (out[~valid[:, None, None, :].expand_as(out)] == 0).all()  # invalid keys: exactly 0
    rows = valid.any(-1)
    assert (out[~rows] == 0).all()  # no valid key: zeros, not NaN
    torch.testing.assert_close(out[rows].sum(-1), torch.ones_like(out[rows].sum(-1)), rtol=0, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_default_blocks_long_keys_and_strided_inputs(kdev, dtype):
    """Default block sizes, ``T`` spanning several blocks, a masked first block, strided views."""
    gen = torch.Generator().manual_seed(3)
    b, h, hkv, c, t, hd = 1, 2, 1, 70, 150, 64
    # [B, C, H, hd] layout transposed to [B, H, C, hd], as produced by a projection + view
    q = torch.randn(b, c, h, hd, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(b, t, hkv, 2 * hd, generator=gen).to(dtype).transpose(1, 2)[..., ::2]
    valid = (torch.rand(b, 2 * t, generator=gen) < 0.6)[:, ::2]
    valid[:, :70] = False
    scale = hd**-0.5
    qd, kd, md = (x.to(kdev) for x in (q, k, valid))
    ref = pa.reference_proxy_attention(q, k, valid, scale)
    out = pa.proxy_attention(qd, kd, md, scale, backend="triton").cpu()
    assert rel_rms(out, ref) < TOL[dtype]


@needs_triton
def test_triton_empty_sizes(kdev):
    q = torch.randn(1, 2, 3, 8, device=kdev)
    k = torch.randn(1, 1, 0, 8, device=kdev)
    valid = torch.zeros(1, 0, dtype=torch.bool, device=kdev)
    assert pa.proxy_attention_triton(q, k, valid, 1.0).shape == (1, 2, 3, 0)
    q0 = torch.randn(1, 2, 0, 8, device=kdev)
    k1 = torch.randn(1, 1, 4, 8, device=kdev)
    valid1 = torch.ones(1, 4, dtype=torch.bool, device=kdev)
    assert pa.proxy_attention_triton(q0, k1, valid1, 1.0).shape == (1, 2, 0, 4)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
def test_triton_corner_cases(kdev, dtype, group):
    """P = C = 1, odd T, GQA group 1 / 4, one batch row without any valid key."""
    gen = torch.Generator().manual_seed(group)
    q = torch.randn(2, group, 1, 12, generator=gen).to(dtype)
    k = torch.randn(2, 1, 37, 12, generator=gen).to(dtype)
    valid = torch.rand(2, 37, generator=gen) < 0.5
    valid[1] = False
    args = [x.to(kdev) for x in (q, k, valid)]
    probs = pa.proxy_attention_triton(*args, 0.3).cpu()
    assert rel_rms(probs, pa.reference_proxy_attention(q, k, valid, 0.3)) < TOL[dtype]
    assert (probs[1] == 0).all() and torch.isfinite(probs).all()


# ----------------------------------------------------------------------------- keys rotated as they are read


def key_rotation(b: int, t: int, hd: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and -sin ``[B, 1, T, hd]`` of random positions: the inverse of the keys' rotary embedding."""
    pos = torch.randint(0, 500, (b, t), generator=gen).float()
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    ang = torch.cat([pos[..., None] * inv] * 2, dim=-1)[:, None]
    return ang.cos(), -ang.sin()


def test_reference_rotation_equals_rotating_the_keys_first():
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 4, 3, 8, generator=gen), torch.randn(2, 2, 9, 8, generator=gen)
    valid = torch.rand(2, 9, generator=gen) < 0.7
    cos, sin = key_rotation(2, 9, 8, gen)
    unrotated = pa.rotate_keys(k, cos, sin)
    x1, x2 = k.chunk(2, dim=-1)  # rotate_half written out
    assert torch.equal(unrotated, k * cos + torch.cat((-x2, x1), dim=-1) * sin)
    expected = pa.reference_proxy_attention(q, unrotated, valid, 0.4)
    assert torch.equal(pa.reference_proxy_attention(q, k, valid, 0.4, cos, sin), expected)
    assert torch.equal(pa.proxy_attention(q, k, valid, 0.4, key_cos=cos, key_sin=sin), expected)  # one fused op
    with pytest.raises(ValueError, match="together"):
        pa.proxy_attention(q, k, valid, 0.4, key_cos=cos)
    with pytest.raises(ValueError, match="key_sin"):
        pa.proxy_attention(q, k, valid, 0.4, key_cos=cos, key_sin=sin[:, :, :4])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2])
def test_triton_rotates_keys_as_the_reference(kdev, dtype, group):
    gen = torch.Generator().manual_seed(group)
    b, t, hd = 2, 41, 16
    q = torch.randn(b, 2 * group, 3, hd, generator=gen).to(dtype)
    k = torch.randn(b, t, 2, hd, generator=gen).to(dtype).transpose(1, 2)  # strided, as the cache's view
    valid = torch.rand(b, t, generator=gen) < 0.6
    cos, sin = key_rotation(b, t, hd, gen)
    ref = pa.reference_proxy_attention(q, k, valid, 0.25, cos, sin)
    with small_blocks():
        out = pa.proxy_attention_triton(*(x.to(kdev) for x in (q, k, valid)), 0.25, cos.to(kdev),
                                        sin.to(kdev)).cpu()
    assert rel_rms(out, ref) < TOL[dtype]
    assert (out[~valid[:, None, None, :].expand_as(out)] == 0).all()
