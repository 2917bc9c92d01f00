"""Tests for ``polestar.kernels.member_rows``: the Triton kernels (under the interpreter on CPU) against the torch
references, the fused ops on CPU against the references and against the row-store composition they replace,
``opcheck`` and ``torch.compile`` of the fused ops, argument checks."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from polestar import registry
from polestar.kernels import member_rows as mr
from polestar.kernels.member_choice import centroid_shift, reference_centroid_shift
from polestar.policies.row_store import RowStore

needs_triton = pytest.mark.skipif(not mr.HAS_TRITON, reason="triton not importable")


# ----------------------------------------------------------------------------- inputs


def packet_case(b: int, k: int, nw: int, p: int, d: int, seed: int, store_dtype=torch.float32, cent_dtype=None,
                new_dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Packet-write inputs: a store ``[b, nw + 1, d]`` (row ``nw`` the trash row), ``k`` clusters, ``p ≤ nw``
    packet slots at distinct window rows, about 30% invalid (at the trash row); labels include -1, so some valid
    slots belong to no cluster."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(-1, k, (b, nw), generator=g) if k > 0 else torch.full((b, nw), -1)
    counts = torch.randint(0, 5, (b, k), generator=g)
    rows = torch.stack([torch.randperm(nw, generator=g)[:p] for _ in range(b)] or [torch.zeros(p, dtype=torch.long)])
    rows = rows[:b]
    valid = torch.rand(b, p, generator=g) < 0.7
    rows = torch.where(valid, rows, nw)
    new = torch.randn(b, p, d, generator=g).to(new_dtype)
    store = torch.randn(b, nw + 1, d, generator=g).to(store_dtype)
    centroids = torch.randn(b, k, d, generator=g).to(cent_dtype or store_dtype)
    return dict(store=store, centroids=centroids, labels=labels, counts=counts, rows=rows, valid=valid, new=new)


def member_rows_case(b: int, n_heads: int, hd: int, c: int, nw: int, m: int, p: int | None, d: int, seed: int,
                     qs_dtype=torch.float32, q_dtype=torch.float32, store_dtype=torch.float32,
                     h_dtype=torch.float32) -> dict:
    """Member-rows inputs: ``q_plan`` and ``q_packet`` non-contiguous slices of one ``[b, H, c + p + 3, hd]``
    query tensor; packet rows and members at distinct window rows (trash ``nw`` where invalid), about half the
    members also packet rows; ``p`` None: no packet. Needs ``p // 2 + m ≤ nw``."""
    g = torch.Generator().manual_seed(seed)
    n1 = nw + 1
    pp = 0 if p is None else p
    qstore = torch.randn(b, n1, n_heads * hd, generator=g).to(qs_dtype)
    store = torch.randn(b, n1, d, generator=g).to(store_dtype)
    q_big = torch.randn(b, n_heads, c + pp + 3, hd, generator=g).to(q_dtype)
    h = torch.randn(b, c, d, generator=g).to(h_dtype)
    perm = torch.stack([torch.randperm(nw, generator=g) for _ in range(b)]).reshape(b, nw)
    rows = perm[:, pp // 2: pp // 2 + m]
    mvalid = torch.rand(b, m, generator=g) < 0.75
    rows = torch.where(mvalid, rows, nw)
    row_slot = torch.randperm(4 * n1 + 7, generator=g)[:n1]
    packet_rows = q_packet = None
    if p is not None:
        pvalid = torch.rand(b, p, generator=g) < 0.75
        packet_rows = torch.where(pvalid, perm[:, :p], nw)
        q_packet = q_big[:, :, c + 3:]
    return dict(qstore=qstore, store=store, q_plan=q_big[:, :, :c], h=h, rows=rows, row_slot=row_slot,
                packet_rows=packet_rows, q_packet=q_packet, mvalid=mvalid)


def cloned(case: dict, device: str = "cpu") -> dict:
    """The case's tensors cloned onto ``device``, keeping the query slices' strides (a slice of a cloned buffer)."""
    return {name: None if t is None else t.clone().to(device) if t.is_contiguous() or t.dim() != 4
            else _strided_copy(t, device) for name, t in case.items()}


def _strided_copy(t: torch.Tensor, device: str) -> torch.Tensor:
    """``t`` ``[B, H, R, hd]`` as a non-contiguous slice of a larger buffer on ``device``."""
    big = torch.empty(t.shape[0], t.shape[1], t.shape[2] + 2, t.shape[3], dtype=t.dtype, device=device)
    out = big[:, :, 1:-1]
    out.copy_(t)
    return out


def packet_args(case: dict) -> tuple:
    return tuple(case[n] for n in ("store", "centroids", "labels", "counts", "rows", "valid", "new"))


def member_args(case: dict) -> tuple:
    return tuple(case[n] for n in ("qstore", "store", "q_plan", "h", "rows", "row_slot", "packet_rows", "q_packet"))


# ----------------------------------------------------------------------------- packet write (Triton)


def run_packet(kdev: str, case: dict) -> tuple[dict, dict]:
    """The reference and the Triton kernel on copies of ``case`` → both cases after the write."""
    ref, out = cloned(case), cloned(case, kdev)
    mr.reference_packet_write(*packet_args(ref))
    mr.packet_write_triton(*packet_args(out))
    return ref, {n: t.cpu() for n, t in out.items()}


def assert_store_equal(ref: dict, out: dict) -> None:
    nw = ref["labels"].shape[1]
    assert torch.equal(out["store"][:, :nw], ref["store"][:, :nw])  # every window row, the packet's included
    written = ref["rows"][ref["valid"]]
    assert written.numel() == 0 or torch.equal(out["store"][ref["valid"].nonzero()[:, 0], written],
                                               ref["new"][ref["valid"]].to(ref["store"].dtype))


@needs_triton
@pytest.mark.parametrize("b, k, nw, p, d, seed", [(1, 1, 1, 1, 1, 0), (3, 5, 20, 12, 40, 1), (2, 6, 33, 9, 200, 2),
                                                  (2, 4, 40, 40, 17, 3), (1, 3, 8, 0, 8, 4)])
def test_triton_packet_write_matches_reference_fp32(kdev, b, k, nw, p, d, seed):
    case = packet_case(b, k, nw, p, d, seed)
    ref, out = run_packet(kdev, case)
    assert_store_equal(ref, out)
    torch.testing.assert_close(out["centroids"], ref["centroids"], rtol=1e-5, atol=1e-6)


@needs_triton
def test_triton_packet_write_bf16_store(kdev):
    # bf16 store, fp32 centroids: the reference sums the bf16 changes in bf16; the kernel in fp32, as the exact sum
    case = packet_case(3, 5, 24, 16, 48, 6, store_dtype=torch.bfloat16, cent_dtype=torch.float32)
    ref, out = run_packet(kdev, case)
    assert_store_equal(ref, out)
    torch.testing.assert_close(out["centroids"], ref["centroids"], rtol=2e-2, atol=2e-2)
    old = case["store"].gather(1, case["rows"][..., None].expand(-1, -1, 48))
    exact = reference_centroid_shift(case["labels"], case["counts"], case["rows"], case["valid"],
                                     case["new"].to(torch.bfloat16).double(), old.double(), torch.float64)
    torch.testing.assert_close(out["centroids"], (case["centroids"].double() + exact).float(), rtol=1e-5, atol=1e-6)
    # bf16 centroids too: the shift cast to bf16, then added
    case = packet_case(2, 4, 20, 10, 24, 7, store_dtype=torch.bfloat16)
    ref, out = run_packet(kdev, case)
    assert_store_equal(ref, out)
    assert out["centroids"].dtype == torch.bfloat16
    torch.testing.assert_close(out["centroids"].float(), ref["centroids"].float(), rtol=2e-2, atol=2e-2)


@needs_triton
def test_triton_packet_write_strided(kdev):
    case = packet_case(2, 5, 16, 10, 24, 8)
    ref = cloned(case)
    mr.reference_packet_write(*packet_args(ref))
    # every tensor non-contiguous, the store and the centroids written through their strides
    store = torch.empty(2, 17, 48, device=kdev)[..., ::2]
    store.copy_(case["store"])
    centroids = case["centroids"].to(kdev).transpose(1, 2).contiguous().transpose(1, 2)
    labels = torch.empty(2, 32, dtype=torch.long, device=kdev)[:, ::2]
    labels.copy_(case["labels"])
    args = (store, centroids, labels, case["counts"].to(kdev).t().contiguous().t(),
            case["rows"].to(kdev).t().contiguous().t(), case["valid"].to(kdev).t().contiguous().t(),
            case["new"].half().to(kdev).transpose(1, 2).contiguous().transpose(1, 2))
    assert not any(t.is_contiguous() for t in args)
    half = cloned(case)
    half["new"] = case["new"].half()
    mr.reference_packet_write(*packet_args(half))
    mr.packet_write_triton(*args)
    assert torch.equal(store.cpu()[:, :16], half["store"][:, :16])
    torch.testing.assert_close(centroids.cpu(), half["centroids"], rtol=1e-5, atol=1e-6)
    assert not torch.equal(half["store"], ref["store"])  # the fp16 cast mattered


@needs_triton
def test_triton_packet_write_nothing_valid_and_empty(kdev):
    case = packet_case(2, 3, 10, 6, 8, 9)
    case["valid"].fill_(False)
    case["rows"].fill_(10)
    ref, out = run_packet(kdev, case)
    assert torch.equal(out["store"][:, :10], case["store"][:, :10])
    assert torch.equal(out["centroids"], case["centroids"])
    assert any(torch.equal(out["store"][0, 10], v) for v in case["new"][0])  # the trash row: one of the values
    run_packet(kdev, packet_case(0, 3, 10, 6, 8, 10))
    # no cluster (the reference's one-hot cannot take K = 0): the store is still written
    case = packet_case(2, 0, 9, 6, 5, 11)
    out = cloned(case, kdev)
    mr.packet_write_triton(*packet_args(out))
    expected = case["store"].clone()
    expected.scatter_(1, case["rows"][..., None].expand(-1, -1, 5), case["new"])
    assert torch.equal(out["store"].cpu()[:, :9], expected[:, :9])


# ----------------------------------------------------------------------------- member rows (Triton)


def run_member_rows(kdev: str, case: dict):
    ref, out = cloned(case), cloned(case, kdev)
    ref_res = mr.reference_member_rows(*member_args(ref))
    res = mr.member_rows_triton(*member_args(out))
    return ref, ref_res, {n: None if t is None else t.cpu() for n, t in out.items()}, [t.cpu() for t in res]


def assert_member_rows_equal(case: dict, ref: dict, ref_res, out: dict, res) -> None:
    q_att, resid, slots = res
    r_q, r_resid, r_slots = ref_res
    c = case["q_plan"].shape[2]
    mvalid = case["mvalid"]
    for a, r in zip(res, ref_res):
        assert a.shape == r.shape and a.dtype == r.dtype and a.is_contiguous()
    assert torch.equal(q_att[:, :, :c], r_q[:, :, :c])
    assert torch.equal(q_att[:, :, c:].transpose(1, 2)[mvalid], r_q[:, :, c:].transpose(1, 2)[mvalid])
    assert torch.equal(resid, r_resid)  # the store is not written: the trash row's input too
    assert torch.equal(slots, r_slots)
    nw = case["store"].shape[1] - 1
    assert torch.equal(out["qstore"][:, :nw], ref["qstore"][:, :nw])


MEMBER_CASES = [
    # b, H, hd, c, nw, m, p, d
    (1, 1, 1, 1, 1, 1, 1, 1),
    (2, 3, 4, 5, 12, 6, 4, 10),
    (3, 2, 8, 7, 20, 8, 6, 40),
    (2, 4, 16, 3, 30, 10, 8, 24),
    (2, 2, 4, 4, 10, 5, None, 6),
    (1, 2, 4, 0, 9, 4, 3, 8),
    (2, 2, 4, 3, 9, 0, 3, 8),
]


@needs_triton
@pytest.mark.parametrize("b, n_heads, hd, c, nw, m, p, d", MEMBER_CASES)
def test_triton_member_rows_matches_reference(kdev, b, n_heads, hd, c, nw, m, p, d):
    case = member_rows_case(b, n_heads, hd, c, nw, m, p, d, seed=b + 10 * nw + m)
    if p is not None and p > 1:
        assert not case["q_packet"].is_contiguous()
    assert not case["q_plan"].is_contiguous() or c <= 1
    assert_member_rows_equal(case, *run_member_rows(kdev, case))


@needs_triton
def test_triton_member_rows_dtypes_and_overlap(kdev):
    # bf16 query store with fp32 queries (the packet's queries round through bf16), fp16 store into bf16 residual
    case = member_rows_case(2, 2, 8, 4, 16, 8, 6, 12, 11, qs_dtype=torch.bfloat16, q_dtype=torch.float32,
                            store_dtype=torch.float16, h_dtype=torch.bfloat16)
    overlap = (case["rows"][..., None] == case["packet_rows"][:, None, :]).any(-1) & case["mvalid"]
    assert overlap.any() and (case["mvalid"] & ~overlap).any()  # members read from the packet and from the store
    ref, ref_res, out, res = run_member_rows(kdev, case)
    assert_member_rows_equal(case, ref, ref_res, out, res)
    assert res[0].dtype == torch.float32 and res[1].dtype == torch.bfloat16
    # a member that is a packet row gets the packet's query rounded through the store's dtype
    b, m = overlap.nonzero()[0].tolist()
    p = (case["packet_rows"][b] == case["rows"][b, m]).nonzero()[0, 0]
    expected = case["q_packet"][b, :, p].to(torch.bfloat16).float()
    assert torch.equal(res[0][b, :, 4 + m], expected)
    assert not torch.equal(expected, case["q_packet"][b, :, p])


@needs_triton
def test_triton_member_rows_strided_stores(kdev):
    case = member_rows_case(2, 2, 4, 3, 12, 5, 4, 6, 12)
    out = cloned(case, kdev)
    qstore = torch.empty(2, 13, 16, device=kdev)[..., ::2]
    qstore.copy_(case["qstore"])
    out["qstore"] = qstore
    out["store"] = case["store"].to(kdev).transpose(1, 2).contiguous().transpose(1, 2)
    out["h"] = case["h"].to(kdev).transpose(1, 2).contiguous().transpose(1, 2)
    out["rows"] = case["rows"].to(kdev).t().contiguous().t()
    out["packet_rows"] = case["packet_rows"].to(kdev).t().contiguous().t()
    out["row_slot"] = torch.empty(26, dtype=torch.long, device=kdev)[::2].copy_(case["row_slot"])
    ref = cloned(case)
    ref_res = mr.reference_member_rows(*member_args(ref))
    res = mr.member_rows_triton(*member_args(out))
    assert_member_rows_equal(case, ref, ref_res, {"qstore": qstore.cpu()}, [t.cpu() for t in res])


# ----------------------------------------------------------------------------- fused ops on CPU


def row_store(values: torch.Tensor) -> RowStore:
    """A one-layer ``RowStore`` with the lossless ``none`` quantizer and offloader, holding ``values [B, N1, w]``
    (its trash row too)."""
    b, n1, w = values.shape
    store = RowStore(registry.build("quant", "none"), registry.build("offload", "none"), 1, b, n1 - 1, w, "cpu",
                     values.dtype)
    store.stored[0][0].copy_(values)
    return store


@pytest.mark.parametrize("store_dtype, cent_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                     (torch.bfloat16, torch.bfloat16)])
def test_fused_packet_write_on_cpu(store_dtype, cent_dtype):
    case = packet_case(3, 6, 30, 12, 16, 20, store_dtype=store_dtype, cent_dtype=cent_dtype)
    ref, fused, op = cloned(case), cloned(case), cloned(case)
    mr.reference_packet_write(*packet_args(ref))
    assert mr.packet_write(*packet_args(fused)) is None
    torch.ops.polestar_fused.packet_write(*packet_args(op))
    # the composition it replaces: RowStore read + write, then the centroid shift
    rs = row_store(case["store"])
    centroids = case["centroids"].clone()
    old = rs.read(0, case["rows"])
    rs.write(0, case["rows"], None, case["new"])
    centroids.add_(centroid_shift(case["labels"], case["counts"], case["rows"], case["valid"], case["new"], old,
                                  centroids.dtype))
    for got in (fused, op):
        assert torch.equal(got["store"], ref["store"]) and torch.equal(got["centroids"], ref["centroids"])
    assert torch.equal(rs.stored[0][0], ref["store"]) and torch.equal(centroids, ref["centroids"])


@pytest.mark.parametrize("p", [None, 6])
def test_fused_member_rows_on_cpu(p):
    case = member_rows_case(2, 2, 8, 4, 16, 8, p, 12, 21, qs_dtype=torch.bfloat16, store_dtype=torch.float16,
                            h_dtype=torch.bfloat16)
    ref, fused, op = cloned(case), cloned(case), cloned(case)
    ref_res = mr.reference_member_rows(*member_args(ref))
    outs = [mr.member_rows(*member_args(fused)), torch.ops.polestar_fused.member_rows(*member_args(op))]
    # the composition it replaces: RowStore write of the packet's queries, reads, the layer step's concatenations
    qs, st = row_store(case["qstore"]), row_store(case["store"])
    q_plan, h, rows = case["q_plan"], case["h"], case["rows"]
    B, H, _, hd = q_plan.shape
    if p is not None:
        qs.write(0, case["packet_rows"], None, case["q_packet"].transpose(1, 2).reshape(B, -1, H * hd))
    q = qs.read(0, rows).view(B, -1, H, hd).transpose(1, 2)
    inputs = st.read(0, rows)
    composed = (torch.cat([q_plan, q.to(q_plan.dtype)], dim=2), torch.cat([h, inputs.to(h.dtype)], dim=1),
                case["row_slot"][rows])
    for res, got in zip(outs, (fused, op)):
        assert all(torch.equal(a, r) for a, r in zip(res, ref_res))
        assert torch.equal(got["qstore"], ref["qstore"])
    assert all(torch.equal(a, r) for a, r in zip(composed, ref_res))
    assert torch.equal(qs.stored[0][0], ref["qstore"])


def test_opcheck():
    case = packet_case(2, 4, 12, 6, 8, 30)
    torch.library.opcheck(torch.ops.polestar_fused.packet_write.default, packet_args(cloned(case)))
    for p in (None, 4):
        case = member_rows_case(2, 2, 4, 3, 12, 5, p, 6, 31)
        torch.library.opcheck(torch.ops.polestar_fused.member_rows.default, member_args(cloned(case)))


def test_compile_aot_eager_equals_eager():
    torch._dynamo.reset()
    counters.clear()
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    def step(store, centroids, labels, counts, rows, valid, new, qstore, q_plan, h, mrows, row_slot, q_packet):
        mr.packet_write(store, centroids, labels, counts, rows, valid, new * 1.0)
        q_att, resid, slots = mr.member_rows(qstore, store, q_plan, h, mrows, row_slot, rows, q_packet)
        return q_att * 2.0, resid + 1.0, slots

    pc = packet_case(2, 4, 12, 5, 6, 40)
    mc = member_rows_case(2, 2, 4, 3, 12, 4, 5, 6, 41)

    def args():
        p, m = cloned(pc), cloned(mc)
        return (*packet_args(p), m["qstore"], m["q_plan"], m["h"], m["rows"], m["row_slot"], m["q_packet"])

    eager_args, compiled_args = args(), args()
    eager = step(*eager_args)
    compiled = torch.compile(step, fullgraph=True, backend=record)(*compiled_args)
    assert dict(counters["graph_break"]) == {}
    for a, r in zip(compiled, eager):
        assert a.dtype == r.dtype and torch.equal(a, r)
    for a, r in zip(compiled_args, eager_args):  # the mutations: store, centroids, qstore
        assert torch.equal(a, r)
    assert not torch.equal(eager_args[0], pc["store"]) and not torch.equal(eager_args[7], mc["qstore"])
    # each fused operation is one node of the traced graph
    targets = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    for op in (torch.ops.polestar_fused.packet_write, torch.ops.polestar_fused.member_rows):
        assert sum(t in (op, op.default) for t in targets) == 1


def test_member_rows_none_packet_compiles():
    case = member_rows_case(2, 2, 4, 3, 12, 5, None, 6, 42)

    def f(qstore, store, q_plan, h, rows, row_slot):
        return mr.member_rows(qstore, store, q_plan, h, rows, row_slot)

    a, b = cloned(case), cloned(case)
    eager = f(*member_args(a)[:6])
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(*member_args(b)[:6])
    assert all(torch.equal(x, y) for x, y in zip(compiled, eager))


# ----------------------------------------------------------------------------- argument checks


def test_packet_write_args_checked():
    case = packet_case(2, 4, 10, 5, 8, 50)
    bad = [
        dict(store=case["store"][0]),
        dict(centroids=case["centroids"][:1]),
        dict(centroids=case["centroids"][..., :7]),
        dict(labels=case["labels"][:, :9]),
        dict(counts=case["counts"][:, :3]),
        dict(rows=case["rows"][:, :4]),
        dict(valid=case["valid"].long()),
        dict(new=case["new"][:, :4]),
        dict(new=case["new"][..., :7]),
    ]
    for change in bad:
        args = {**case, **change}
        for backend in ("reference", "auto"):
            with pytest.raises(ValueError):
                mr.packet_write(*packet_args(args), backend=backend)


def test_member_rows_args_checked():
    case = member_rows_case(2, 2, 4, 3, 12, 5, 4, 6, 51)
    case.pop("mvalid")
    bad = [
        dict(q_plan=case["q_plan"][0]),
        dict(store=case["store"][:1]),
        dict(qstore=case["qstore"][..., :7]),
        dict(qstore=case["qstore"][:, :12]),
        dict(h=case["h"][:, :2]),
        dict(h=case["h"][..., :5]),
        dict(rows=case["rows"][0]),
        dict(row_slot=case["row_slot"][:12]),
        dict(packet_rows=None),
        dict(q_packet=None),
        dict(packet_rows=case["packet_rows"][:, :3]),
        dict(q_packet=case["q_packet"][..., :3]),
    ]
    for change in bad:
        args = {**case, **change}
        with pytest.raises(ValueError):
            mr.member_rows(**args, backend="reference")
