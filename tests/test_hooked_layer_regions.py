"""The sparse refreshes' hooked layers as regions of their own in a whole-step compile: Polestar's block-start and
sparse-update layers (``polestar.policies.polestar_update``), Elastic-Cache's layers and dLLM-Cache's value-pick
layers pass the CUDA-graph rules of ``tests/test_step_capture.py`` at four layers (dynamo and AOT autograd's
analysis). Polestar's also give the eager hook path's tokens and counters on every route through them (lossless
and lossy stores, un-rotated and rotated proxies, layers clustered together or one by one, both families; dynamo's
graphs run as they are). That a step graph does not grow with depth at all (its runs of layers are scans) is
``tests/test_layer_regions.py``'s. Each check is a whole-step compile, so the full suite runs them."""

import pytest
import torch

import polestar
from polestar.testing import tiny_model
from tests.test_step_capture import _check_against_eager, _model

PROMPTS = [[5, 17, 3, 8, 9, 1, 2], [9, 1, 22, 30, 4, 11, 2]]
DECODE = dict(policy="polestar", gen_length=24, block_length=8)  # block starts, updates with and without a suffix


def _decode(family: str, layers: int, compile, **overrides):
    torch._dynamo.reset()
    model = tiny_model(family, seed=3, n_layers=layers)
    return polestar.generate(model, PROMPTS, compile=compile, **DECODE, **overrides)


def _counters(out):
    s = out.stats
    return (s.nfe, s.tokens, s.token_layer_evals, s.weight_bytes, s.kv_bytes, s.proxy_query_evals,
            [(q.nfe, q.tokens, q.token_layer_evals) for q in s.sequences])


#: LLaDA with the default stages is checked under the CUDA-graph rules too, by tests/test_step_capture.py
ROUTES = [
    pytest.param("dream", {"quant": "nvfp4"}, id="dream-lossy-store", marks=pytest.mark.slow),
    # the block start's hook path (clustered layer by layer, rotated centroid queries) beside the update region
    pytest.param("llada", {"refresh.proxy_rope": True, "refresh.cluster_layers_together": False},
                 id="rotated-proxies-clustered-per-layer", marks=pytest.mark.slow),
]


@pytest.mark.slow
@pytest.mark.parametrize("family,overrides", ROUTES)
def test_a_whole_step_compile_with_the_layer_regions_equals_the_eager_hook_path(family, overrides):
    eager = _decode(family, 4, False, **overrides)
    compiled = _decode(family, 4, "eager", **overrides)
    assert compiled.stats.compiled_steps > 0
    assert torch.equal(eager.tokens, compiled.tokens)
    assert _counters(eager) == _counters(compiled)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["polestar", "elastic-cache", "dllm-cache"])
def test_hooked_layers_run_as_regions_are_replayable_graphs(policy):
    """With four layers a compiled step runs the sparse refreshes' middle layers as regions of their own (Polestar's
    update and block-start layers, Elastic-Cache's tracked and checked layers, dLLM-Cache's value-pick layers),
    their rewritten buffers copied back: still graphs a CUDA graph can replay (static addresses written, nothing
    read after the next step), through dynamo and AOT autograd's analysis, with the eager tokens and counters."""
    _check_against_eager(_model("llada", 4), policy, 1, None)


@pytest.mark.slow
def test_without_scans_every_layer_runs_as_a_region_and_equals_eager(monkeypatch):
    """Where a torch has no usable scan (``layer_scan.available()`` False), a whole-step compile runs every hooked
    layer as a region of its own (the update, block-start and finish regions one layer at a time): the eager
    tokens and counters still."""
    from polestar.models import layer_scan

    eager = _decode("dream", 4, False, quant="nvfp4")
    monkeypatch.setattr(layer_scan, "available", lambda: False)
    compiled = _decode("dream", 4, "eager", quant="nvfp4")
    assert compiled.stats.compiled_steps > 0
    assert torch.equal(eager.tokens, compiled.tokens)
    assert _counters(eager) == _counters(compiled)
