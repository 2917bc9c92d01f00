"""The ``dllm-cache`` policy against the naive restatement of dLLM-Cache's released code
(``tests/reference.py::dllm_cache_generate``): the same tokens, forwards and rows on the shipped LLaDA checkpoints,
alone and in a mixed-length batch, in settings that reach every per-layer case (both refreshes, the response
refresh, the prompt refresh with the value pick, the value pick alone, ratio 0 and 1); its reduction to no-cache
decoding on both model families; and the value pick itself (a changed value is picked, unchanged ones are not).
"""

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import polestar
from polestar.api import encode_prompts
from polestar.config import GenerationConfig
from polestar.engine import decode, release_generation, start_generation
from polestar.models.cost import CostMeter
from polestar.models.layer_ops import LayerOps
from polestar.policy import assemble
from polestar.state import StepPhase
from tests.conftest import make_model
from tests.reference import dllm_cache_generate

GEN, BLOCK = 24, 8
PROMPTS = ("arith:7-7-7-5*5*0=", "arith:4+6=", "arith:9*3-8=")
#: (prompt interval, response interval, ratio): the released LLaDA script's values; 5 / 3 reaches every case within
#: 24 forwards (both refreshes at 0 and 15, the prompt refresh alone at 5, 10 and 20, the response refresh alone at
#: multiples of 3, the value pick alone elsewhere); ratio 0 (no pick) and 1 (every response row picked)
SETTINGS = [(50, 7, 0.25), (5, 3, 0.25), (5, 3, 0.0), (5, 3, 1.0)]


@pytest.fixture(scope="module")
def checkpoints():
    return {name: polestar.load(name, dtype=torch.float32) for name in ("tiny-llada", "tiny-llada-noisy")}


def _policy(prompt_interval, response_interval, ratio):
    return assemble("dllm-cache", {"refresh.prompt_interval": prompt_interval,
                                   "refresh.response_interval": response_interval, "refresh.ratio": ratio})


def _reference(model, ids, mask, prompt_interval, response_interval, ratio):
    with torch.no_grad():
        return dllm_cache_generate(model, ids, attention_mask=mask, gen_length=GEN, steps=GEN, block_length=BLOCK,
                                   prompt_interval=prompt_interval, gen_interval=response_interval, ratio=ratio)


CONFIG = GenerationConfig(gen_length=GEN, block_length=BLOCK, steps=GEN, stop_at_eos=False)


@pytest.mark.parametrize("name", ["tiny-llada", "tiny-llada-noisy"])
@pytest.mark.parametrize("setting", SETTINGS, ids=[f"p{p}-r{r}-ratio{q}" for p, r, q in SETTINGS])
def test_batch_one_equals_the_reference_tokens_forwards_and_rows(checkpoints, name, setting):
    model = checkpoints[name]
    for text in PROMPTS:
        ids, mask = encode_prompts(model, [text])
        tokens, stats = decode(model, ids, mask, _policy(*setting), CONFIG)
        want, ref = _reference(model, ids, None, *setting)
        assert tokens.tolist() == want.tolist(), text
        assert stats.nfe == ref[0]["nfe"] == GEN
        assert stats.token_layer_evals == stats.sequences[0].token_layer_evals == ref[0]["rows"]
        # every response row's value is projected for a pick (the reference, as the official count, leaves out
        # the picked rows, which go on through the layer)
        n_pick = int(GEN * setting[2])
        if n_pick < GEN:
            assert stats.proxy_query_evals * (GEN - n_pick) == ref[0]["probe_rows"] * GEN


@pytest.mark.parametrize("setting", SETTINGS[:2], ids=["p50-r7", "p5-r3"])
def test_mixed_length_batch_rows_equal_the_reference_alone(checkpoints, setting):
    """Each row of a left-padded batch decodes as the reference decodes it alone. Left padding moves a row's keys in
    the cache, which changes attention's summation order (logits differ by about 3e-5 from the row alone, for the
    no-cache baseline too); the value pick ranks cosines, so on other prompts such a difference can swap two
    near-tied rows. These two prompts of different lengths keep every pick."""
    model = checkpoints["tiny-llada"]
    prompts = PROMPTS[:2]
    ids, mask = encode_prompts(model, list(prompts))
    tokens, stats = decode(model, ids, mask, _policy(*setting), CONFIG)
    want, ref = _reference(model, ids, mask, *setting)
    for b in range(len(prompts)):
        assert tokens[b, -GEN:].tolist() == want[b, -GEN:].tolist(), prompts[b]
        assert stats.sequences[b].token_layer_evals == ref[b]["rows"]


@pytest.mark.parametrize("name", ["tiny-dream", "tiny-dream-noisy"])
def test_dream_equals_the_reference_hook_inside_llada_loop(name):
    """On Dream (shifted logits, grouped K/V, q/k/v biases) the policy runs LLaDA's blocked loop; the reference's
    Dream forward (whole key rows written for the picked rows) inside the same loop gives the same tokens and rows."""
    model = polestar.load(name, dtype=torch.float32)
    setting = (5, 3, 0.25)
    for text in PROMPTS[:2]:
        ids, mask = encode_prompts(model, [text])
        tokens, stats = decode(model, ids, mask, _policy(*setting), CONFIG)
        with torch.no_grad():
            want, ref = dllm_cache_generate(model, ids, gen_length=GEN, steps=GEN, block_length=BLOCK,
                                            prompt_interval=5, gen_interval=3, ratio=0.25, dream_k_cols=None,
                                            loop="llada")
        assert tokens.tolist() == want.tolist(), text
        assert stats.token_layer_evals == ref[0]["rows"]


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_refreshing_every_row_every_forward_is_no_cache_decoding(family):
    """Prompt and response refreshed at every forward: every layer recomputes every row, as the baseline does."""
    model = make_model(family)
    ids, mask = encode_prompts(model, [[5, 7, 1, 3, 9, 2, 4], [3, 4]])
    config = GenerationConfig(gen_length=16, block_length=4, stop_at_eos=False)
    tokens, stats = decode(model, ids, mask, _policy(1, 1, 0.25), config)
    base, base_stats = decode(model, ids, mask, assemble("baseline", {"commit.mask_in_softmax": True}), config)
    assert tokens.tolist() == base.tolist()
    assert stats.token_layer_evals == base_stats.token_layer_evals
    assert stats.sequences == base_stats.sequences


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), ratio=st.sampled_from([0.125, 0.25, 0.5]))
def test_the_value_pick_takes_the_changed_values_and_no_unchanged_one(seed, ratio):
    """Between refreshes a layer recomputes the ``int(G * ratio)`` response rows whose fresh values differ most from
    the cached ones: with exactly that many cached values changed, the pick is those rows; afterwards every
    response row's cached value is the fresh one."""
    model = make_model("llada")
    pipeline = _policy(50, 7, ratio)
    ids, mask = encode_prompts(model, [[5, 7, 1, 3], [2, 9]])
    gen = start_generation(model, ids, mask, pipeline, GenerationConfig(gen_length=16, block_length=4))
    try:
        state, cache = gen.state, gen.cache
        state.phase = StepPhase((False, False), None)  # neither refresh is due: the pick alone
        plan = pipeline.refresh.plan(state, cache, gen.refresh_local)
        hook = pipeline.refresh.hook(state, plan, cache, model, gen.refresh_local)
        g = torch.Generator().manual_seed(seed)
        B, P, T, G = state.batch_size, state.prompt_len, state.length, 16
        h = torch.randn(B, T, model.spec.d_model, generator=g)
        layer = 1
        fresh = LayerOps(model).project_values(layer, h[:, P:], CostMeter())
        n_pick = int(G * ratio)
        changed = torch.stack([torch.randperm(G, generator=g)[:n_pick] for _ in range(B)])  # [B, n_pick]
        cached = fresh.clone()
        for b in range(B):
            cached[b, :, changed[b]] += torch.randn(cached[b, :, changed[b]].shape, generator=g)
        cache.v[layer][:, :, P:T] = cached
        rows = hook.features(layer, h, CostMeter()).rows
        assert [sorted(r) for r in (rows - P).tolist()] == [sorted(c) for c in changed.tolist()]
        assert torch.equal(cache.v[layer][:, :, P:T], fresh)
    finally:
        release_generation(gen)


@pytest.mark.slow
@pytest.mark.parametrize("family,overrides", [("dream", {}), ("llada", {"refresh.prompt_interval": 3})],
                         ids=["dream", "prompt-refreshes"])  # LLaDA's defaults: tests/test_step_capture.py
def test_a_whole_step_compile_runs_the_value_pick_layers_as_one_region_each_and_equals_eager(family, overrides):
    """In a whole-step graph a layer with the value pick is one region (``refresh_dllm.pick_layer``: values
    projected, pick, value replacement and the feature-cached pass, buffers written back): the same tokens and
    counters as the eager hook path, with and without prompt refreshes among those layers."""
    outs = []
    for compile in (False, "eager"):
        torch._dynamo.reset()
        model = make_model(family, seed=3, n_layers=4)
        outs.append(polestar.generate(model, [[5, 17, 3, 8, 9, 1, 2], [9, 1, 22, 30, 4, 11, 2]], policy="dllm-cache",
                                      compile=compile, gen_length=32, block_length=8, **overrides))
    eager, compiled = outs
    assert compiled.stats.compiled_steps > 0
    assert torch.equal(eager.tokens, compiled.tokens)
    untimed = dict(wall_s=0.0, compile_s=0.0, compiled_steps=0)
    assert attrs.evolve(eager.stats, **untimed) == attrs.evolve(compiled.stats, **untimed)
