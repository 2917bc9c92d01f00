"""Invariants of every registered drift and quant stage, fuzzed with hypothesis.

The checks are :mod:`polestar.testing`'s (the ones ``check_stage`` runs on an outside stage), here on inputs drawn by
hypothesis. Parametrized from ``polestar.registry.names(kind)``, so a newly registered stage is covered without
editing this file (a quant format must add its error bound to ``QUANT_BOUNDS``; an unknown format fails loudly).

* drift: ``score(cur, prev) [B, R]`` is finite and ≥ 0; it is 0 when ``cur == prev`` — or, for a metric that
  ignores ``prev`` (the uncertainty ablation: entropy of ``cur``), 0 on one-hot distributions.
* quant: ``decode(encode(x))`` keeps the shape and dtype and its error is within the format's bound:

  - ``none``: exact;
  - ``nvfp4``: per 16-value block, ``|x − x̂| ≤ max(amax_block · (1 + 2⁻⁴) / 6, g · 2⁻⁶)`` with the stage's per-row
    scale ``g = amax(|row|) / (448 · 6)``: the FP4 e2m1 grid's widest gap is 2 (between 4 and 6), so rounding costs
    at most one block scale ``g · s``, and ``s`` is ``amax_block / 6 / g`` rounded to e4m3 (relative error
    ≤ 2⁻⁴) or clamped up to e4m3's smallest normal 2⁻⁶;
  - ``fp8``: per element, ``|x − x̂| ≤ max(|x| · 2⁻⁴, scale · 2⁻¹⁰)`` with the per-row ``scale = amax_row / 448``:
    e4m3 normals round with relative error ≤ 2⁻⁴, subnormals (below 2⁻⁶) with absolute error ≤ 2⁻¹⁰.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polestar import registry
from polestar.testing import attention_pair, check_drift_metric, check_quant_round_trip

FUZZ = settings(max_examples=30, deadline=None, derandomize=True)


def _nvfp4_bound(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    pad = (-d) % 16
    xp = torch.nn.functional.pad(x.abs().float(), (0, pad))
    amax_block = xp.unflatten(-1, (-1, 16)).amax(-1, keepdim=True)
    g = x.abs().float().amax(-1, keepdim=True).unsqueeze(-1) / (448 * 6)  # per row: [..., 1, 1]
    g = torch.where(g > 0, g, torch.ones_like(g))
    per_block = torch.maximum(amax_block * (1 + 2**-4) / 6, g * 2**-6)
    return per_block.expand(*per_block.shape[:-1], 16).flatten(-2)[..., :d]


def _fp8_bound(x: torch.Tensor) -> torch.Tensor:
    amax = x.abs().float().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    return torch.maximum(x.abs().float() * 2**-4, scale * 2**-10)


#: quant stage name → elementwise bound on |x − decode(encode(x))| (see the module docstring)
QUANT_BOUNDS = {"none": lambda x: torch.zeros_like(x, dtype=torch.float32), "nvfp4": _nvfp4_bound, "fp8": _fp8_bound}


@st.composite
def attention_pairs(draw):
    """Two attention tensors ``[B, H, R, T]`` (rows are probability distributions) with the same shape."""
    b, h, r, t = (draw(st.integers(1, n)) for n in (2, 3, 3, 24))
    seed = draw(st.integers(0, 2**31 - 1))
    sharp = draw(st.sampled_from([0.1, 1.0, 8.0]))  # near-uniform to near-one-hot rows
    return attention_pair(torch.Generator().manual_seed(seed), b, h, r, t, sharp)


@pytest.mark.parametrize("name", registry.names("drift"))
@FUZZ
@given(pair=attention_pairs())
def test_drift_is_non_negative_and_zero_on_equal_inputs(name, pair):
    check_drift_metric(registry.build("drift", name), *pair)


@st.composite
def residuals(draw):
    """Finite fp32 ``[N, D]`` values spanning magnitudes (D not always a multiple of 16), some rows all zero."""
    n, d = draw(st.integers(1, 4)), draw(st.integers(1, 48))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([1e-4, 1.0, 300.0]))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen) * scale * torch.rand(n, 1, generator=gen).pow(3)
    if draw(st.booleans()):
        x[0] = 0.0
    return x


def test_every_quant_stage_has_a_bound():
    assert set(registry.names("quant")) <= set(QUANT_BOUNDS), "state the error bound of the new quant format here"


@pytest.mark.parametrize("name", registry.names("quant"))
@FUZZ
@given(x=residuals())
def test_quant_round_trip_error_is_bounded(name, x):
    stage = registry.build("quant", name)
    check_quant_round_trip(stage, x)  # shape, dtype, exact when lossless, deterministic, leaves round trip
    y = stage.decode(stage.encode(x))
    err = (y.float() - x.float()).abs()
    bound = QUANT_BOUNDS[name](x)
    assert (err <= bound * (1 + 1e-5) + 1e-30).all(), f"{name}: max excess {(err - bound).max().item():.3g}"
