"""Tests for the ``torch.library`` registration of the Triton kernels (``torch.ops.polestar.*``).

The ops are ``torch.library.custom_op`` + ``register_fake`` (see ``polestar.kernels._library``
for why not ``triton_op``: under ``TRITON_INTERPRET=1`` its derived fake implementation runs the
interpreter on FakeTensors).  Checked here, under the interpreter on CPU:

* every kernel is registered under its expected name and callable through ``torch.ops``;
* ``torch.library.opcheck`` (schema, autograd registration, fake tensor, AOT dispatch with
  dynamic shapes) passes for each op;
* ``torch.compile(fullgraph=True)`` traces the ``backend="triton"`` dispatchers without graph
  breaks, with the ops as single graph nodes, and gives the eager results.  The ``aot_eager``
  backend is used (it runs the fake implementations and functionalization); Inductor also works
  on CPU but costs several seconds of C++ compilation, too slow for this suite.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch._dynamo.utils import counters

from polestar.kernels import _library
from polestar.kernels import drift as dr
from polestar.kernels import kmeans as km
from polestar.kernels import proxy_attention as pa
from polestar.kernels import quant as qt

needs_triton = pytest.mark.skipif(not dr.HAS_TRITON, reason="triton not importable")

OP_NAMES = [
    "kl_drift",
    "js_drift",
    "cosine_drift",
    "entropy",
    "kmeans_assign",
    "nvfp4_quantize",
    "nvfp4_dequantize",
    "proxy_attention",
]


def _inputs(device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    t = {
        "p": torch.softmax(torch.randn(3, 2, 7, generator=gen), -1),
        "q": torch.softmax(torch.randn(3, 2, 7, generator=gen), -1),
        "x": torch.randn(2, 6, 3, generator=gen),
        "c": torch.randn(2, 2, 3, generator=gen),
        "xvalid": torch.rand(2, 6, generator=gen) > 0.2,
        "xq": torch.randn(3, 20, generator=gen),
        "qa": torch.randn(1, 4, 2, 8, generator=gen),
        "k": torch.randn(1, 2, 9, 8, generator=gen),
        "valid": torch.rand(1, 9, generator=gen) > 0.3,
    }
    return {name: x.to(device) for name, x in t.items()}


def _op_args(name: str, t: dict[str, torch.Tensor]) -> tuple:
    if name in ("kl_drift", "js_drift"):
        return (t["p"], t["q"], 1e-10)
    if name == "cosine_drift":
        return (t["p"], t["q"])
    if name == "entropy":
        return (t["p"],)
    if name == "kmeans_assign":
        return (t["x"], t["c"], t["xvalid"])
    if name == "nvfp4_quantize":
        return (t["xq"],)
    if name == "nvfp4_dequantize":
        nv = qt.reference_nvfp4_quantize(t["xq"])
        return (nv.packed, nv.block_scale.view(torch.uint8), nv.global_scale, 20, torch.bfloat16)
    return (t["qa"], t["k"], t["valid"], 0.3)  # proxy_attention


@needs_triton
def test_every_kernel_is_registered():
    for name in OP_NAMES:
        assert _library.is_registered(name)
        assert isinstance(getattr(torch.ops.polestar, name).default, torch._ops.OpOverload)


@needs_triton
@pytest.mark.parametrize("name", OP_NAMES)
def test_opcheck(kdev, name):
    args = _op_args(name, _inputs(kdev))
    torch.library.opcheck(getattr(torch.ops.polestar, name).default, args)


@needs_triton
def test_ops_match_references(kdev):
    t = _inputs(kdev)
    ops = torch.ops.polestar
    torch.testing.assert_close(ops.kl_drift(t["p"], t["q"], 1e-10), dr.reference_kl_drift(t["p"], t["q"]))
    torch.testing.assert_close(ops.entropy(t["p"]), dr.reference_entropy(t["p"]))
    labels = km.reference_kmeans_assign(t["x"], t["c"], t["xvalid"])
    assert torch.equal(ops.kmeans_assign(t["x"], t["c"], t["xvalid"]), labels)
    packed, scale, g = ops.nvfp4_quantize(t["xq"])
    ref = qt.reference_nvfp4_quantize(t["xq"])
    assert torch.equal(packed, ref.packed) and torch.equal(
        scale.view(torch.uint8), ref.block_scale.view(torch.uint8)
    )
    assert torch.equal(g, ref.global_scale)
    deq = ops.nvfp4_dequantize(*_op_args("nvfp4_dequantize", t))
    assert torch.equal(deq, qt.reference_nvfp4_dequantize(ref._replace(dtype=torch.bfloat16)))
    probs = ops.proxy_attention(t["qa"], t["k"], t["valid"], 0.3)
    torch.testing.assert_close(probs, pa.reference_proxy_attention(t["qa"], t["k"], t["valid"], 0.3))


@needs_triton
def test_compile_fullgraph_kl_drift_is_one_opaque_node(kdev):
    torch._dynamo.reset()
    counters.clear()
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(p, q):
        return dr.kl_drift(p * 1.0, q, backend="triton").mean(-1)

    t = _inputs(kdev)
    out = torch.compile(f, fullgraph=True, backend=record)(t["p"], t["q"])
    torch.testing.assert_close(out, f(t["p"], t["q"]))
    assert dict(counters["graph_break"]) == {}
    assert len(graphs) == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    kl_op = torch.ops.polestar.kl_drift
    assert sum(tgt in (kl_op, kl_op.default) for tgt in targets) == 1


@needs_triton
def test_compile_fullgraph_all_ops_aot_eager(kdev):
    torch._dynamo.reset()
    counters.clear()

    def f(p, q, x, c, xvalid, xq, qa, k, valid):
        nv = qt.nvfp4_quantize(xq, backend="triton")
        return (
            dr.kl_drift(p, q, backend="triton"),
            dr.js_drift(p, q, backend="triton"),
            dr.cosine_drift(p, q, backend="triton"),
            dr.entropy(p, backend="triton"),
            km.kmeans_assign(x, c, xvalid, backend="triton"),
            nv.packed,
            qt.nvfp4_dequantize(nv, backend="triton"),
            pa.proxy_attention(qa, k, valid, 0.3, backend="triton"),
        )

    args = list(_inputs(kdev).values())
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    eager = f(*args)
    assert dict(counters["graph_break"]) == {}
    for a, b in zip(compiled, eager):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a, b)


@needs_triton
def test_reregistration_on_reload_is_a_noop(kdev):
    op = torch.ops.polestar.proxy_attention.default
    importlib.reload(pa)  # registers polestar::proxy_attention again: must not raise
    assert torch.ops.polestar.proxy_attention.default is op
    t = _inputs(kdev)
    probs = pa.proxy_attention_triton(t["qa"], t["k"], t["valid"], 0.3)
    torch.testing.assert_close(probs, pa.reference_proxy_attention(t["qa"], t["k"], t["valid"], 0.3))


# ----------------------------------------------------------------------------- fused operations of a step


def fused_tables() -> dict[str, dict]:
    """Every dispatch table of :mod:`polestar.kernels` that has a ``fused`` entry, by its op's qualified name."""
    from polestar.bench.kernel_aot import kernel_modules

    return {table["fused"].default.name(): table for module in kernel_modules() for table in vars(module).values()
            if isinstance(table, dict) and "fused" in table}


@needs_triton
def test_every_fused_operation_a_decode_counts_as_one_is_one_triton_launch_on_cuda():
    """An operation counted as one (``torch.ops.polestar_fused.*``) is one kernel where a GPU runs it: each has a
    Triton twin in its table and a CUDA kernel registered; and every fused operation a Polestar decode dispatches,
    plain and NVFP4 stores alike, is one of them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import polestar
    from polestar.testing import tiny_model

    tables = fused_tables()
    for name, table in tables.items():
        assert "triton" in table and "reference" in table, name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA"), f"{name} has no CUDA kernel"

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == _library.FUSED_NAMESPACE:
                self.names.add(func.name().split(".")[0])
            return func(*args, **(kwargs or {}))

    model = tiny_model("llada", seed=0, n_layers=3)
    with Seen() as seen:
        for quant in ("none", "nvfp4"):
            polestar.generate(model, [[5, 17, 3, 8], [9, 1, 22]], policy="polestar", gen_length=32, block_length=8,
                              quant=quant, stop_at_eos=False)
    assert seen.names and seen.names <= set(tables), seen.names - set(tables)
    assert {"polestar_fused::packet_write", "polestar_fused::member_rows", "polestar_fused::drift_keep"} <= seen.names
