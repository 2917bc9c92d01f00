"""``RowStore``: row writes touch only their rows, for every registered quant × offload stage.

Parametrized from ``polestar.registry.names(kind)``, so a new quant or offload stage is covered without editing this
file (a quant format states its error bound in ``tests/test_fuzz_stages.QUANT_BOUNDS``).

* after ``write`` of random rows with a random valid mask, every leaf's bytes of every row not written are unchanged,
  and ``read(rows)`` equals ``read_all()`` gathered at ``rows``;
* written rows decode within the format's bound of the value written (of the residual to the anchor when anchored);
  lossless quantizers are exact;
* every offloader gives the same bytes and values as ``none``;
* ``read`` + ``write`` with ``offload=none`` trace under ``torch.compile(fullgraph=True)`` and equal eager.

NVFP4 per-row Triton vs reference bit-exactness is in ``tests/kernels/test_kernel_quant.py`` (where the Triton
interpreter is set up).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polestar import registry
from polestar.policies.row_store import RowStore
from tests.test_fuzz_stages import QUANT_BOUNDS

QUANTS = registry.names("quant")
OFFLOADS = registry.names("offload")
FAST = settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def make_store(quant: str, offload: str, n_layers=2, batch=2, n_rows=5, dim=20, dtype=torch.float32) -> RowStore:
    return RowStore(registry.build("quant", quant), registry.build("offload", offload), n_layers, batch, n_rows, dim,
                    "cpu", dtype)


def encoded_bytes(store: RowStore, layer: int) -> list[torch.Tensor]:
    """Every leaf of ``layer`` (trash row included) as bytes ``[B, n_rows + 1, bytes per row]`` on the CPU."""
    every = torch.arange(store.n_rows + 1).expand(store.batch, -1)
    leaves = store.offload.read_rows(store.stored[layer], every, "cpu")
    return [t.contiguous().view(torch.uint8).reshape(*t.shape[:2], -1).clone() for t in leaves]


@st.composite
def scenarios(draw):
    """A filled store's contents and one row write: sizes, dtype, anchor, rows (distinct among valid slots)."""
    b, n, d = draw(st.integers(1, 2)), draw(st.integers(1, 6)), draw(st.integers(1, 40))
    m = draw(st.integers(1, n))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([1e-3, 1.0, 100.0]))
    values = torch.randn(b, n, d, generator=gen) * scale * torch.rand(b, n, 1, generator=gen)
    anchor = torch.randn(b, n, d, generator=gen) * scale if draw(st.booleans()) else None
    rows = torch.stack([torch.randperm(n, generator=gen)[:m] for _ in range(b)])
    valid = torch.rand(b, m, generator=gen) < 0.7
    rows = torch.where(valid, rows, torch.randint(0, n + 1, (b, m), generator=gen))  # invalid slots point anywhere
    new = torch.randn(b, m, d, generator=gen) * scale
    if draw(st.booleans()):
        new[0, 0] = 0.0  # an all-zero row
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return dict(values=values, anchor=anchor, rows=rows, valid=valid, new=new, dtype=dtype)


@pytest.mark.parametrize("offload", OFFLOADS)
@pytest.mark.parametrize("quant", QUANTS)
@FAST
@given(sc=scenarios())
def test_write_touches_only_written_rows_and_read_gathers(quant, offload, sc):
    b, n, d = sc["values"].shape
    store = make_store(quant, offload, batch=b, n_rows=n, dim=d, dtype=sc["dtype"])
    store.write_all(1, sc["values"], sc["anchor"])
    before_bytes, before = encoded_bytes(store, 1), store.read_all(1)
    store.write(1, sc["rows"], sc["valid"], sc["new"])
    after_bytes, after = encoded_bytes(store, 1), store.read_all(1)
    written = torch.zeros(b, n + 1, dtype=torch.bool)
    written[torch.arange(b)[:, None].expand_as(sc["rows"])[sc["valid"]], sc["rows"][sc["valid"]]] = True
    kept = ~written
    kept[:, n] = False  # the trash row absorbs invalid slots
    for old, cur in zip(before_bytes, after_bytes):
        assert torch.equal(old[kept], cur[kept])
    assert torch.equal(before[kept[:, :n]], after[kept[:, :n]])
    assert after.shape == (b, n, d) and after.dtype == sc["dtype"]
    rows = torch.cat([sc["rows"].clamp_max(n - 1), torch.randint(0, n, (b, 3))], 1)
    assert torch.equal(store.read(1, rows), after[torch.arange(b)[:, None], rows])
    assert torch.equal(store.read_all(0), make_store(quant, offload, batch=b, n_rows=n, dim=d,
                                                     dtype=sc["dtype"]).read_all(0))  # other layers untouched


@pytest.mark.parametrize("offload", OFFLOADS)
@pytest.mark.parametrize("quant", QUANTS)
@FAST
@given(sc=scenarios())
def test_written_rows_decode_within_the_format_bound(quant, offload, sc):
    """fp32 store: ``|read − value| ≤ bound(value − anchor)`` row by row (plus fp32 rounding of the residual and of
    adding the anchor back); lossless quantizers store the values exactly."""
    b, n, d = sc["values"].shape
    store = make_store(quant, offload, batch=b, n_rows=n, dim=d)
    store.write_all(0, sc["values"], sc["anchor"])
    store.write(0, sc["rows"], sc["valid"], sc["new"])
    got = store.read_all(0)
    expect = sc["values"].clone()
    bi = torch.arange(b)[:, None].expand_as(sc["rows"])
    expect[bi[sc["valid"]], sc["rows"][sc["valid"]]] = sc["new"][sc["valid"]]
    lossless = store.quant.lossless
    if lossless:
        assert torch.equal(got, expect)
        return
    anchor = sc["anchor"] if sc["anchor"] is not None else torch.zeros_like(expect)
    payload = expect - anchor
    bound = QUANT_BOUNDS[quant](payload.reshape(b * n, 1, d)).reshape(b, n, d)  # each row on its own
    slack = 2.0**-22 * (expect.abs() + anchor.abs() + bound)
    err = (got - expect).abs()
    assert (err <= bound * (1 + 1e-5) + slack + 1e-30).all(), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("offload", [o for o in OFFLOADS if o != "none"])
@pytest.mark.parametrize("quant", QUANTS)
def test_every_offload_equals_none(quant, offload):
    gen = torch.Generator().manual_seed(7)
    stores = [make_store(quant, o, n_layers=2, batch=2, n_rows=6, dim=24, dtype=torch.bfloat16)
              for o in ("none", offload)]
    values, anchor = torch.randn(2, 6, 24, generator=gen), torch.randn(2, 6, 24, generator=gen)
    ops = []
    for step in range(4):
        rows = torch.stack([torch.randperm(6, generator=gen)[:3] for _ in range(2)])
        ops.append((step % 2, rows, torch.rand(2, 3, generator=gen) < 0.6, torch.randn(2, 3, 24, generator=gen)))
    for s in stores:
        s.write_all(0, values, anchor)
        s.write_all(1, values)
    for layer, rows, valid, new in ops:
        reads = [s.read(layer, rows) for s in stores]
        assert torch.equal(reads[0], reads[1])
        for s in stores:
            s.write(layer, rows, valid, new)
    for layer in (0, 1):
        assert torch.equal(stores[0].read_all(layer), stores[1].read_all(layer))
        for a, c in zip(encoded_bytes(stores[0], layer), encoded_bytes(stores[1], layer)):
            assert torch.equal(a, c)


@pytest.mark.parametrize("quant", [q for q in QUANTS if registry.lookup("quant", q).lossless])
def test_lossless_ignores_anchor_and_is_exact(quant):
    store = make_store(quant, "none", dtype=torch.bfloat16)
    v = torch.randn(2, 5, 20).bfloat16()
    store.write_all(0, v, anchor=torch.randn(2, 5, 20))
    assert torch.equal(store.read_all(0), v)
    new = torch.randn(2, 2, 20).bfloat16()
    store.write(0, torch.tensor([[4, 0], [1, 1]]), torch.tensor([[True, True], [True, False]]), new)
    v[0, 4], v[0, 0], v[1, 1] = new[0, 0], new[0, 1], new[1, 0]
    assert torch.equal(store.read_all(0), v)


@pytest.mark.slow
def test_compiled_read_write_equals_eager():
    """offload ``none``: ``write`` then ``read`` (anchored NVFP4 residuals) traced with ``fullgraph=True``."""
    assert registry.lookup("offload", "none").compilable and not registry.lookup("offload", "cpu").compilable
    gen = torch.Generator().manual_seed(3)
    values, anchor = torch.randn(2, 6, 40, generator=gen), torch.randn(2, 6, 40, generator=gen)
    eager, comp = (make_store("nvfp4", "none", batch=2, n_rows=6, dim=40) for _ in range(2))
    for s in (eager, comp):
        s.write_all(1, values, anchor)

    def step(store, rows, valid, new):
        store.write(1, rows, valid, new)
        return store.read(1, rows.flip(-1))

    compiled = torch.compile(lambda *a: step(comp, *a), fullgraph=True)
    for _ in range(2):
        rows = torch.stack([torch.randperm(6, generator=gen)[:4] for _ in range(2)])
        valid, new = torch.rand(2, 4, generator=gen) < 0.7, torch.randn(2, 4, 40, generator=gen)
        assert torch.equal(compiled(rows, valid, new), step(eager, rows, valid, new))
    assert torch.equal(comp.read_all(1), eager.read_all(1))
    for a, c in zip(encoded_bytes(eager, 1), encoded_bytes(comp, 1)):
        assert torch.equal(a, c)
