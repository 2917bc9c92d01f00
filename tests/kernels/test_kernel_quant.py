"""Tests for ``polestar.kernels.quant``: NVFP4 vs a naive per-element restatement, Triton bit-exactness,
round trips, SQNR, FP8 and the quantizer registry."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from polestar.kernels import quant as qt

FAST = settings(
    max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
needs_triton = pytest.mark.skipif(not qt.HAS_TRITON, reason="triton not importable")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# ----------------------------------------------------------------------------- naive restatement


def f32(v: float) -> float:
    """Round a Python float to fp32 (one IEEE op in double then this rounding = the fp32 op)."""
    return struct.unpack("f", struct.pack("f", v))[0]


def e4m3_table() -> list[tuple[float, int]]:
    """All finite non-negative float8_e4m3fn values with their bytes."""
    out = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            val = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
            out.append((val, e << 3 | m))
    return out


E4M3 = e4m3_table()


def nearest_even(v: float, table: list[tuple[float, int]], mantissa_bit) -> tuple[float, int]:
    """Nearest entry of ``table`` to ``v``; on a tie the one whose mantissa bit is 0."""
    best = min(abs(v - t[0]) for t in table)
    ties = [t for t in table if abs(v - t[0]) == best]
    return min(ties, key=lambda t: (mantissa_bit(t[1]), t[0]))


def naive_e4m3(v: float) -> tuple[float, int]:
    return nearest_even(v, E4M3, lambda b: b & 1)


def naive_fp4_code(v: float) -> int:
    mag = min(abs(v), 6.0)
    _, idx = nearest_even(mag, [(g, i) for i, g in enumerate(GRID)], lambda i: i & 1)
    return idx | (8 if v < 0 else 0)


def naive_nvfp4(x: torch.Tensor) -> tuple[list[int], list[int], float]:
    """Codes (one per element, padded), scale bytes and global scale, element by element."""
    rows = x.float().reshape(-1, x.shape[-1]).tolist()
    amax = max((abs(v) for r in rows for v in r), default=0.0)
    g = f32(amax / 2688.0) if amax > 0 else 1.0
    g = g if g > 0 else 1.0
    codes, scales = [], []
    for r in rows:
        r = r + [0.0] * (-len(r) % 16)
        for b in range(0, len(r), 16):
            blk = r[b : b + 16]
            s = f32(f32(max(abs(v) for v in blk) / 6.0) / g)
            s_val, s_byte = naive_e4m3(min(max(s, 2.0**-6), 448.0))
            total = f32(g * s_val)
            scales.append(s_byte)
            codes.extend(naive_fp4_code(f32(v / total)) for v in blk)
    return codes, scales, g


def naive_dequant(codes: list[int], scales: list[int], g: float) -> list[float]:
    values = {b: v for v, b in E4M3}
    out = []
    for i, c in enumerate(codes):
        mag = GRID[c & 7]
        out.append(f32((-mag if c & 8 else mag) * f32(g * values[scales[i // 16]])))
    return out


def scale_bytes(t: qt.NVFP4Tensor) -> torch.Tensor:
    return t.block_scale.view(torch.uint8)


class CudaScalarDivision(TorchDispatchMode):
    """Divides the way CUDA's eager kernels do, on any device: ``tensor / number`` becomes ``tensor * (1 / number)``
    with the reciprocal rounded to the tensor's dtype (ATen's true-division kernel for a scalar divisor)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.div.Tensor and isinstance(args[1], (int, float)) and not kwargs:
            return torch.ops.aten.mul.Tensor(args[0], 1.0 / args[1])
        return func(*args, **(kwargs or {}))


# ----------------------------------------------------------------------------- strategies


@st.composite
def tensors(draw, max_d: int = 48):
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    d = draw(st.integers(1, max_d))
    dtype = draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(*lead, d, generator=gen) * 10.0 ** draw(st.integers(-3, 2))  # finite in fp16
    if draw(st.booleans()):  # wide dynamic range across blocks (exercises small block scales)
        x = x * torch.logspace(-5, 1, d)
    x = x.masked_fill(torch.rand(x.shape, generator=gen) < draw(st.sampled_from([0.0, 0.5])), 0.0)
    return x.to(dtype)


@st.composite
def on_grid_tensors(draw):
    """Values exactly representable: grid value * e4m3 block scale * power-of-two global scale."""
    rows = draw(st.integers(1, 3))
    nblk = draw(st.integers(1, 3))
    j = draw(st.integers(-20, 20))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    grid = torch.tensor(GRID)
    codes = torch.randint(0, 16, (rows, nblk, 16), generator=gen)
    vals = grid[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    vals[..., 0] = 6.0  # each block reaches 6 * s
    normals = torch.tensor([v for v, _ in E4M3 if 2.0**-6 <= v <= 448.0])
    scales = normals[torch.randint(0, len(normals), (rows, nblk), generator=gen)]
    scales[0, 0] = 448.0  # tensor amax = 6 * 448 * 2**j -> global scale 2**j
    return (vals * scales.unsqueeze(-1) * 2.0**j).reshape(rows, nblk * 16)


# ----------------------------------------------------------------------------- reference vs naive


@FAST
@given(tensors())
def test_reference_matches_naive(x):
    t = qt.reference_nvfp4_quantize(x)
    codes, scales, g = naive_nvfp4(x)
    assert t.global_scale.item() == g
    assert qt.unpack_fp4(t.packed).flatten().tolist() == codes
    assert scale_bytes(t).flatten().tolist() == scales
    dq = qt.reference_nvfp4_dequantize(t)
    assert dq.shape == x.shape and dq.dtype == x.dtype
    expected = torch.tensor(naive_dequant(codes, scales, g)).reshape(*x.shape[:-1], -1)[..., : x.shape[-1]]
    assert torch.equal(dq, expected.to(x.dtype))


@pytest.mark.parametrize(("per_row", "magnitude"), [(False, 3.0), (True, 1.0)])  # inputs where the rule bites
def test_reference_gives_the_same_bits_under_cuda_division(per_row, magnitude):
    """The reference's bits do not depend on how the device divides by a Python number (on an H200 the Triton
    kernel and a reference dividing by ``6.0`` disagreed on bf16 rows: CUDA multiplies by the reciprocal)."""
    x = (torch.randn(64, 4096, generator=torch.Generator().manual_seed(0)) * magnitude).bfloat16()
    expected = qt.reference_nvfp4_quantize(x, per_row=per_row)
    with CudaScalarDivision():
        got = qt.reference_nvfp4_quantize(x, per_row=per_row)
    assert torch.equal(got.packed, expected.packed)
    assert torch.equal(scale_bytes(got), scale_bytes(expected))
    assert torch.equal(got.global_scale, expected.global_scale)
    # the rule has teeth on this input: a block scale computed as amax / 6.0 under it rounds differently
    amax = x.float().unflatten(-1, (-1, 16)).abs().amax(-1)
    with CudaScalarDivision():
        naive = (amax / qt.FP4_E2M1_MAX / expected.global_scale).clamp(qt.E4M3_MIN_NORMAL, qt.FP8_E4M3_MAX)
    naive = naive.to(torch.float8_e4m3fn)
    assert (naive.view(torch.uint8) != scale_bytes(expected)).any()


def test_fp4_encode_ties_round_to_even():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -0.25, -0.75, -5.0, -0.0, 0.26])
    expected = [0, 2, 2, 4, 4, 6, 6, 7, 7, 8, 10, 14, 0, 1]
    assert qt.fp4_encode(v).tolist() == expected
    assert [naive_fp4_code(a) for a in v.tolist()] == expected
    all_codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(
        qt.fp4_encode(qt.fp4_decode(all_codes))[[i for i in range(16) if i != 8]],
        all_codes[[i for i in range(16) if i != 8]],
    )  # -0 encodes as +0


def test_e4m3_cast_is_round_to_nearest_even():
    """The reference relies on torch's fp32 -> e4m3fn cast; check it against the table."""
    normals = sorted(v for v, _ in E4M3 if v >= 2.0**-6)
    mids = [(a + b) / 2 for a, b in zip(normals, normals[1:])]
    gen = torch.Generator().manual_seed(0)
    rand = (2.0 ** (torch.rand(500, generator=gen) * 14.8 - 6)).tolist()
    vals = torch.tensor([v for v in normals + mids + rand if v <= 448.0])
    got = vals.to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    assert got == [naive_e4m3(v)[1] for v in vals.tolist()]


# ----------------------------------------------------------------------------- properties


TIE_PATTERN = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.0]
TIE_CODES = [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 0]  # round half to even


def tie_tensor(x: torch.Tensor) -> torch.Tensor:
    """Same block scales as an on-grid ``x``, elements exactly half-way between grid points."""
    total = x.unflatten(-1, (-1, 16))[..., :1] / 6.0  # exact: element 0 of each block is 6 * total
    return (total * torch.tensor(TIE_PATTERN)).flatten(-2)


@FAST
@given(on_grid_tensors())
def test_on_grid_values_round_trip_exactly_and_ties(x):
    t = qt.reference_nvfp4_quantize(x)
    assert torch.equal(qt.reference_nvfp4_dequantize(t), x)
    ties = tie_tensor(x)
    codes = qt.unpack_fp4(qt.reference_nvfp4_quantize(ties).packed).unflatten(-1, (-1, 16))
    assert (codes == torch.tensor(TIE_CODES, dtype=torch.uint8)).all()
    assert codes.flatten().tolist() == naive_nvfp4(ties)[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 256), (3, 5, 128), (1000, 48)])
def test_sqnr_on_gaussian(dtype, shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)
    xh = qt.reference_nvfp4_dequantize(qt.reference_nvfp4_quantize(x))
    assert qt.sqnr_db(x, xh) >= 18.0


@FAST
@given(st.integers(1, 40), st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip(m, seed):
    codes = torch.randint(0, 16, (3, 2 * m), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    packed = qt.pack_fp4(codes)
    assert packed.shape == (3, m) and packed.dtype == torch.uint8
    assert torch.equal(qt.unpack_fp4(packed), codes)
    assert qt.pack_fp4(torch.tensor([1, 2], dtype=torch.uint8)).item() == 0x21  # even element low


@pytest.mark.parametrize("dtype", DTYPES)
def test_zeros_tensor(dtype):
    x = torch.zeros(4, 32, dtype=dtype)
    t = qt.reference_nvfp4_quantize(x)
    assert (t.packed == 0).all() and t.global_scale.item() == 1.0
    assert torch.isfinite(t.block_scale.float()).all()
    out = qt.reference_nvfp4_dequantize(t)
    assert out.dtype == dtype and (out == 0).all()


def test_shapes_and_padding():
    x = torch.randn(2, 3, 20)
    t = qt.reference_nvfp4_quantize(x)
    assert t.packed.shape == (2, 3, 16) and t.block_scale.shape == (2, 3, 2)
    assert t.block_scale.dtype == torch.float8_e4m3fn and t.global_scale.shape == ()
    assert t.shape == x.shape and t.dtype == x.dtype
    assert qt.reference_nvfp4_dequantize(t).shape == x.shape
    assert (qt.unpack_fp4(t.packed)[..., 20:] == 0).all()
    with pytest.raises(ValueError):
        qt.reference_nvfp4_quantize(torch.tensor(1.0))


@FAST
@given(tensors())
def test_fp8_matches_naive(x):
    t = qt.fp8_quantize(x)
    rows = x.float().reshape(-1, x.shape[-1]).tolist()
    scales, codes = [], []
    for r in rows:
        amax = max(abs(v) for v in r)
        s = f32(amax / 448.0) if amax > 0 else 1.0
        scales.append(s)
        for v in r:
            q = min(max(f32(v / s), -448.0), 448.0)
            byte = naive_e4m3(abs(q))[1]
            codes.append(byte | (0x80 if q < 0 else 0))  # the sign survives underflow (-0)
    assert t.scale.flatten().tolist() == scales
    assert t.data.view(torch.uint8).flatten().tolist() == codes
    values = {b: v for v, b in E4M3}
    expected = [
        values[c & 0x7F] * (-1 if c & 0x80 else 1) * scales[i // x.shape[-1]] for i, c in enumerate(codes)
    ]
    assert torch.equal(qt.fp8_dequantize(t), torch.tensor(expected).reshape(x.shape).to(x.dtype))


def test_fp8_and_identity_and_registry():
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    x[1] = 0
    f = qt.fp8_quantize(x)
    assert f.data.dtype == torch.float8_e4m3fn and f.scale.shape == (5, 1)
    y = qt.fp8_dequantize(f)
    assert y.dtype == x.dtype and y.shape == x.shape and (y[1] == 0).all()
    assert qt.sqnr_db(x, y) > 25
    amax = x.float().abs().amax(-1, keepdim=True)
    assert ((y.float() - x.float()).abs() <= amax / 16 + 1e-6).all()
    for quantize, dequantize in ((qt.nvfp4_quantize, qt.nvfp4_dequantize), (qt.fp8_quantize, qt.fp8_dequantize)):
        xh = dequantize(quantize(x))
        assert xh.shape == x.shape and xh.dtype == x.dtype and qt.sqnr_db(x, xh) > 18


def test_dispatch_auto_on_cpu_is_reference():
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    a, b = qt.nvfp4_quantize(x), qt.reference_nvfp4_quantize(x)
    assert torch.equal(a.packed, b.packed) and torch.equal(scale_bytes(a), scale_bytes(b))
    assert torch.equal(qt.nvfp4_dequantize(a), qt.reference_nvfp4_dequantize(b))
    with pytest.raises(ValueError):
        qt.nvfp4_quantize(x, backend="fast")


# ----------------------------------------------------------------------------- triton


def assert_same_nvfp4(a: qt.NVFP4Tensor, b: qt.NVFP4Tensor) -> None:
    assert torch.equal(a.packed.cpu(), b.packed.cpu())
    assert torch.equal(scale_bytes(a).cpu(), scale_bytes(b).cpu())
    assert torch.equal(a.global_scale.cpu(), b.global_scale.cpu())
    assert a.shape == b.shape and a.dtype == b.dtype


@needs_triton
@FAST
@given(tensors(max_d=80))
def test_triton_quantize_bit_exact(kdev, x):
    ref = qt.reference_nvfp4_quantize(x)
    out = qt.nvfp4_quantize_triton(x.to(kdev))
    assert_same_nvfp4(out, ref)
    dq = qt.nvfp4_dequantize_triton(out)
    assert dq.dtype == x.dtype and dq.shape == x.shape
    assert torch.equal(dq.cpu(), qt.reference_nvfp4_dequantize(ref))


@needs_triton
@FAST
@given(on_grid_tensors())
def test_triton_on_grid_and_ties(kdev, x):
    out = qt.nvfp4_quantize_triton(x.to(kdev))
    assert_same_nvfp4(out, qt.reference_nvfp4_quantize(x))
    assert torch.equal(qt.nvfp4_dequantize_triton(out).cpu(), x)
    ties = tie_tensor(x)
    assert_same_nvfp4(qt.nvfp4_quantize_triton(ties.to(kdev)), qt.reference_nvfp4_quantize(ties))


@needs_triton
def test_triton_e4m3_rounding_matches_torch(kdev):
    """Block scales sweeping every e4m3 normal, every midpoint and random values."""
    normals = sorted(v for v, _ in E4M3 if v >= 2.0**-6)
    mids = [(a + b) / 2 for a, b in zip(normals, normals[1:])]
    gen = torch.Generator().manual_seed(1)
    rand = (2.0 ** (torch.rand(300, generator=gen) * 14.8 - 6)).tolist()
    s = torch.tensor([v for v in normals + mids + rand if v <= 448.0])
    x = torch.zeros(s.numel() + 1, 16)
    x[:-1, 0] = s * 6.0  # block scale s (global scale is 1 since amax = 2688)
    x[-1, 0] = 2688.0
    ref = qt.reference_nvfp4_quantize(x)
    assert_same_nvfp4(qt.nvfp4_quantize_triton(x.to(kdev)), ref)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_zeros_large_and_dispatch(kdev, dtype):
    z = torch.zeros(3, 48, dtype=dtype, device=kdev)
    tz = qt.nvfp4_quantize(z, backend="triton")
    assert (tz.packed == 0).all() and (qt.nvfp4_dequantize(tz, backend="triton") == 0).all()
    x = torch.randn(33, 1024, generator=torch.Generator().manual_seed(2)).to(dtype)  # several programs
    ref = qt.reference_nvfp4_quantize(x)
    out = qt.nvfp4_quantize(x.to(kdev), backend="triton")
    assert_same_nvfp4(out, ref)
    assert torch.equal(qt.nvfp4_dequantize(out, backend="triton").cpu(), qt.reference_nvfp4_dequantize(ref))
    assert qt.nvfp4_quantize_triton(torch.zeros(0, 16, device=kdev)).packed.shape == (0, 8)


# ----------------------------------------------------------------------------- per-row global scales


def naive_nvfp4_rows(x: torch.Tensor) -> tuple[list[int], list[int], list[float]]:
    """Per-row NVFP4: the per-tensor restatement applied to each row ``x[..., i, :]`` on its own."""
    codes, scales, gs = [], [], []
    for row in x.reshape(-1, x.shape[-1]):
        c, s, g = naive_nvfp4(row[None])
        codes += c
        scales += s
        gs.append(g)
    return codes, scales, gs


def with_zero_row(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x.view(-1, x.shape[-1])[0] = 0
    return x


@FAST
@given(tensors())
def test_per_row_reference_matches_naive(x):
    x = with_zero_row(x)
    t = qt.reference_nvfp4_quantize(x, per_row=True)
    codes, scales, gs = naive_nvfp4_rows(x)
    assert t.global_scale.shape == (*x.shape[:-1], 1) and t.global_scale.dtype == torch.float32
    assert t.global_scale.flatten().tolist() == gs
    assert qt.unpack_fp4(t.packed).flatten().tolist() == codes
    assert scale_bytes(t).flatten().tolist() == scales
    rows = x.reshape(-1, x.shape[-1])
    expected = torch.stack([qt.reference_nvfp4_dequantize(qt.reference_nvfp4_quantize(r[None]))[0] for r in rows])
    assert torch.equal(qt.reference_nvfp4_dequantize(t), expected.reshape(x.shape))


@needs_triton
@FAST
@given(tensors(max_d=80))
def test_triton_per_row_bit_exact(kdev, x):
    x = with_zero_row(x)
    ref = qt.reference_nvfp4_quantize(x, per_row=True)
    out = qt.nvfp4_quantize(x.to(kdev), backend="triton", per_row=True)
    assert_same_nvfp4(out, ref)
    dq = qt.nvfp4_dequantize(out, backend="triton")
    assert dq.dtype == x.dtype and dq.shape == x.shape
    assert torch.equal(dq.cpu(), qt.reference_nvfp4_dequantize(ref))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_per_row_fixed_cases(kdev, dtype):
    """A row dim that is not a multiple of 16, an all-zero row, rows of very different magnitudes, several programs."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 70, 37, generator=gen) * torch.logspace(-6, 3, 70)[:, None]
    x[0, 5] = 0
    x = x.to(dtype)
    ref = qt.reference_nvfp4_quantize(x, per_row=True)
    assert ref.global_scale[0, 5].item() == 1.0 and (ref.packed[0, 5] == 0).all()
    out = qt.nvfp4_quantize_triton(x.to(kdev), per_row=True)
    assert_same_nvfp4(out, ref)
    assert torch.equal(qt.nvfp4_dequantize_triton(out).cpu(), qt.reference_nvfp4_dequantize(ref))
    one = qt.reference_nvfp4_quantize(x[1, 9], per_row=True)  # a single row: [1] scale, same bytes
    assert torch.equal(one.packed, ref.packed[1, 9]) and torch.equal(one.global_scale, ref.global_scale[1, 9])
    assert_same_nvfp4(qt.nvfp4_quantize_triton(x[1, 9].to(kdev), per_row=True), one)


@needs_triton
def test_per_row_opcheck(kdev):
    x = torch.randn(3, 4, 20, generator=torch.Generator().manual_seed(5), device=kdev)
    torch.library.opcheck(torch.ops.polestar.nvfp4_quantize.default, (x, True))
    nv = qt.reference_nvfp4_quantize(x.cpu(), per_row=True)
    args = (nv.packed, nv.block_scale.view(torch.uint8), nv.global_scale, 20, torch.bfloat16)
    torch.library.opcheck(torch.ops.polestar.nvfp4_dequantize.default, tuple(a.to(kdev) if torch.is_tensor(a) else a
                                                                           for a in args))
