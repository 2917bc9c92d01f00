"""The layer regions: each layer's model work is compiled once per shape and called at every layer, so what a
compiler builds does not grow with depth; compiled by inductor they compute what they compute eagerly."""

import functools

import pytest
import torch

import polestar
from polestar.models.layer_regions import PLAIN, CachedOutputs, LayerCache, LayerShape, LayerWeights
from polestar.models.layers import RopeTable
from polestar.testing import tiny_model

PROMPTS = [[5, 17, 3, 8], [9, 1, 22, 30, 4, 11]]
POLICIES = ["fast-dllm", "polestar", "elastic-cache", "dllm-cache"]


def _captured(policy: str, layers: int) -> list[torch.fx.GraphModule]:
    """The region graphs of one decode, captured by dynamo (no code generated)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model = tiny_model("llada", seed=3, n_layers=layers)
    polestar.generate(model, PROMPTS, policy=policy, compile=backend, gen_length=16, block_length=8)
    return graphs


@pytest.mark.parametrize("policy", [pytest.param(p, marks=[] if p in ("fast-dllm", "polestar") else pytest.mark.slow)
                                    for p in POLICIES])
def test_compiled_regions_do_not_depend_on_depth(policy):
    """From 3 layers on (a first layer, a middle one, a last one), more layers change nothing a compiler sees: the
    same region graphs, node for node (every layer calls the ones compiled for the first)."""
    graphs3 = sorted(len(gm.graph.nodes) for gm in _captured(policy, 3))
    graphs5 = sorted(len(gm.graph.nodes) for gm in _captured(policy, 5))
    assert graphs3 == graphs5 and graphs3


@pytest.mark.slow
def test_regions_compiled_by_inductor_equal_their_eager_results():
    # a two-layer loop of the regions around the K/V writes, as the backbone runs them; a region that returned a
    # view of its projection had its values overwritten by inductor's generated code
    g = torch.Generator().manual_seed(0)
    B, T, d, H, hd, L, X = 2, 12, 32, 4, 8, 2, 5

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    weights = [dict(norm=rand(d).abs(), qkv=rand(3 * d, d, scale=0.1), o=rand(d, d, scale=0.1), mlp_norm=rand(d).abs(),
                    gate_up=rand(4 * d, d, scale=0.1), down=rand(d, 2 * d, scale=0.1)) for _ in range(L)]
    valid = torch.ones(B, T + 1, dtype=torch.bool)
    valid[:, -1] = False
    h, rope = rand(B, X, d), RopeTable(rand(B, X, 2, hd))
    index = torch.arange(3, 3 + X).expand(B, X)
    shape = LayerShape(H, H, 1e-5)

    def layers(h, keys, values):
        for w, k_cache, v_cache in zip(weights, keys, values):
            record = LayerWeights(w["norm"], None, w["qkv"], None, w["o"], None, w["mlp_norm"], None, w["gate_up"],
                                  None, w["down"], None)
            qk, qkv = PLAIN.qkv_rows(h, rope, record, shape)
            slot = index[:, None, :, None].expand(-1, H, -1, hd)
            k_cache.scatter_(2, slot, qk[:, :, H:].transpose(1, 2))
            v_cache.scatter_(2, slot, qkv[:, :, 2 * H :].transpose(1, 2))
            h = PLAIN.attend_mlp(qk[:, :, :H].transpose(1, 2), h, LayerCache(k_cache, v_cache, valid), record, shape)
        return h

    def caches():
        return [torch.zeros(B, H, T + 1, hd) for _ in range(L)], [torch.zeros(B, H, T + 1, hd) for _ in range(L)]

    k0, v0 = caches()
    eager = layers(h, k0, v0)
    k1, v1 = caches()
    compiled = torch.compile(layers, backend="inductor", fullgraph=True)(h, k1, v1)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    for a, b in zip(k1 + v1, k0 + v0):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _layer_inputs(seed: int = 0):
    """Two layers' weights and caches, plan rows, their slots and rotary factors, at a tiny width."""
    g = torch.Generator().manual_seed(seed)
    B, T, d, H, hd, X = 2, 12, 32, 4, 8, 5

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    weights = [LayerWeights(rand(d).abs(), None, rand(3 * d, d, scale=0.1), None, rand(d, d, scale=0.1), None,
                            rand(d).abs(), None, rand(4 * d, d, scale=0.1), None, rand(d, 2 * d, scale=0.1), None)
               for _ in range(2)]
    valid = torch.ones(B, T + 1, dtype=torch.bool)
    valid[:, -1] = False
    buffers = [tuple(rand(*shape) for shape in ((B, H, T + 1, hd),) * 2 + ((B, X, d),) * 2) for _ in range(2)]
    rows = torch.tensor([[0, 3], [4, 1]])
    return weights, buffers, rand(B, X, d), torch.arange(3, 3 + X).expand(B, X), RopeTable(rand(B, X, 2, hd)), \
        valid, rows, H


def _by_hand(weights, buffers, h, index, rope, valid, rows, H):
    """Layer 0 without a hook, then layer 1 with feature caching at ``rows``, written out with the plain pieces and
    in-place K/V writes (what the whole-layer passes must equal)."""
    from polestar.models.layer_regions import attend_mlp, cached_rows, qkv_rows

    shape = LayerShape(H, H, 1e-5)
    hd = rope.factors.shape[-1]
    w0, (k0, v0, _, _) = weights[0], buffers[0]
    qk, qkv = qkv_rows(h, rope, w0, shape)
    slot = index[:, None, :, None].expand(-1, H, -1, hd)
    k0.scatter_(2, slot, qk[:, :, H:].transpose(1, 2))
    v0.scatter_(2, slot, qkv[:, :, 2 * H :].transpose(1, 2))
    h = attend_mlp(qk[:, :, :H].transpose(1, 2), h, LayerCache(k0, v0, valid), w0, shape)
    w1, (k1, v1, attn, mlp) = weights[1], buffers[1]
    pick = rows[:, :, None, None].expand(-1, -1, 2, hd)
    picked = h.gather(1, rows[..., None].expand(-1, -1, h.shape[-1]))
    qk, qkv = qkv_rows(picked, RopeTable(rope.factors.gather(1, pick)), w1, shape)
    slot = index.gather(1, rows)[:, None, :, None].expand(-1, H, -1, hd)
    k1.scatter_(2, slot, qk[:, :, H:].transpose(1, 2))
    v1.scatter_(2, slot, qkv[:, :, 2 * H :].transpose(1, 2))
    (new_attn, new_mlp), out = cached_rows(h, rows, qk[:, :, :H].transpose(1, 2), LayerCache(k1, v1, valid),
                                           CachedOutputs(attn, mlp), w1, shape)
    attn.copy_(new_attn)
    mlp.copy_(new_mlp)
    return out


def _passes(regions, weights, buffers, h, index, rope, valid, rows, H):
    (k0, v0, _, _), (k1, v1, attn, mlp) = buffers
    shape = LayerShape(H, H, 1e-5)
    h = regions.passes.decoder_layer(h, index, rope, LayerCache(k0, v0, valid), weights[0], shape)
    return regions.passes.feature_layer(h, rows, index, rope, LayerCache(k1, v1, valid), CachedOutputs(attn, mlp),
                                        weights[1], shape)


@pytest.mark.parametrize("form", ["plain", pytest.param("pieces compiled on their own", marks=pytest.mark.slow)])
def test_whole_layer_passes_equal_the_pieces_and_write_their_buffers_in_place(form):
    from polestar.models import layer_regions

    expected_inputs = _layer_inputs()
    expected = _by_hand(*expected_inputs)
    weights, buffers, *rest = _layer_inputs()
    addresses = [t.data_ptr() for b in buffers for t in b]
    if form == "plain":
        out = _passes(layer_regions.PLAIN, weights, buffers, *rest)
    else:
        regions = layer_regions.compiled_with(functools.partial(torch.compile, backend="aot_eager", fullgraph=True,
                                                                dynamic=False))
        out = _passes(regions, weights, buffers, *rest)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for got, want in zip((t for b in buffers for t in b), (t for b in expected_inputs[1] for t in b)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert [t.data_ptr() for b in buffers for t in b] == addresses  # written where they are


def _regions_compiled_by(backend_graphs: list, layers: int, policy: str) -> torch.Tensor:
    """Decode eagerly with every layer region compiled on its own by a recording backend; the tokens."""
    from polestar.models import layer_regions

    def backend(gm, example_inputs):
        backend_graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model = tiny_model("llada", seed=3, n_layers=layers)
    with torch._dynamo.config.patch(recompile_limit=64, automatic_dynamic_shapes=False), \
            layer_regions.using(layer_regions.compiled_with(functools.partial(torch.compile, backend=backend,
                                                                              fullgraph=True, dynamic=False))):
        return polestar.generate(model, PROMPTS, policy=policy, gen_length=16, block_length=8).tokens


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fast-dllm", "polestar"])
def test_regions_compiled_on_their_own_compile_once_whatever_the_depth(policy):
    """Each region is compiled once per shape it meets, the same at 2 layers and at 4, and the
    decode gives the eager tokens."""
    shallow, deep = [], []
    tokens2 = _regions_compiled_by(shallow, 2, policy)
    tokens4 = _regions_compiled_by(deep, 4, policy)
    assert 0 < len(shallow) == len(deep)
    for layers, tokens in ((2, tokens2), (4, tokens4)):
        eager = polestar.generate(tiny_model("llada", seed=3, n_layers=layers), PROMPTS, policy=policy,
                                  gen_length=16, block_length=8)
        assert torch.equal(tokens, eager.tokens)


@pytest.mark.slow
def test_inductor_regions_equal_eager_and_are_reused_at_another_depth():
    out2 = polestar.generate(tiny_model("llada", seed=3, n_layers=2), PROMPTS, policy="polestar", compile=True,
                             gen_length=16, block_length=8)
    model8 = tiny_model("llada", seed=3, n_layers=8)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    out8 = polestar.generate(model8, PROMPTS, policy="polestar", compile=True, gen_length=16, block_length=8)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # the 2-layer decode compiled them all
    eager8 = polestar.generate(model8, PROMPTS, policy="polestar", gen_length=16, block_length=8)
    assert out2.stats.compiled_steps == out2.stats.nfe and out8.stats.compiled_steps == out8.stats.nfe
    assert torch.equal(out8.tokens, eager8.tokens)


def test_a_norm_inside_a_compiled_region_is_bit_for_bit_the_eager_one():
    """A compiler's own reduction order changes the norm's last bits (and a decode's near-tie decisions with them):
    inside ``torch.compile`` the norm is one opaque operator running the eager code, and a compiled layer region
    equals the plain one exactly."""
    from polestar.models import layer_regions
    from polestar.models.layers import rms_norm

    g = torch.Generator().manual_seed(0)
    B, X, d, H, hd = 1, 40, 64, 4, 16
    rows, norm = torch.randn(B, X, d, generator=g), torch.rand(d, generator=g) + 0.5
    qkv = torch.randn(3 * d, d, generator=g) * 0.1
    rope = RopeTable(torch.rand(B, X, 2, hd, generator=g))
    compiled_norm = torch.compile(lambda x: rms_norm(x, norm, None, 1e-5), backend="inductor", fullgraph=True)
    assert torch.equal(compiled_norm(rows), rms_norm(rows, norm, None, 1e-5))
    weights = LayerWeights(norm, None, qkv, None, *([None] * 8))
    args = (rows, rope, weights, LayerShape(H, H, 1e-5))
    compiled = torch.compile(layer_regions.qkv_rows, backend="inductor", fullgraph=True, dynamic=False)(*args)
    for got, want in zip(compiled, layer_regions.qkv_rows(*args)):
        assert torch.equal(got, want)


def test_plain_steps_run_the_plain_functions_and_a_compiled_runner_its_regions():
    """Outside a compiled run the passes are the plain functions (the K/V written in place); a runner with
    ``compile`` holds its compiled regions for its run of steps, and nothing else changes them."""
    from polestar.models import layer_regions
    from polestar.policy import assemble
    from polestar.step import StepRunner

    assert layer_regions.active() is layer_regions.PLAIN
    runner = StepRunner("eager", "cpu", assemble("fast-dllm"))
    with runner.running():
        assert layer_regions.active() is runner.regions is not layer_regions.PLAIN
    assert layer_regions.active() is layer_regions.PLAIN
    with StepRunner(False, "cpu", assemble("fast-dllm")).running():
        assert layer_regions.active() is layer_regions.PLAIN
