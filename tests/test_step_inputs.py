"""The step's explicit inputs: a compiled step is ``run_step(model, pipeline, inputs)``, guarded on its inputs and
its stages' options only (filtered by the kind of each guard's source, not by names), and a new pipeline object or
generation of the same composition reuses its graphs."""

import pytest
import torch
from torch._dynamo.utils import counters

import polestar
import polestar.step as step_module
from polestar import engine
from polestar.step import StepInputs, decode_step, persistent_tensors, run_step
from tests.conftest import make_model

KW = dict(gen_length=16, block_length=8, threshold=0.3, stop_at_eos=False)


@pytest.fixture(scope="module")
def model():
    return make_model("llada", seed=5, n_layers=2, d_model=32)


def _kept_guard_names(monkeypatch) -> list[str]:
    kept: list[str] = []
    filter_fn = step_module.step_guards

    def recording(entries):
        keep = filter_fn(entries)
        kept.extend(e.name for e, k in zip(entries, keep) if k)
        return keep

    monkeypatch.setattr(step_module, "step_guards", recording)
    return kept


@pytest.mark.parametrize("policy", ["fast-dllm", pytest.param("polestar-cache", marks=pytest.mark.slow)])
def test_a_compiled_steps_guards_are_on_its_inputs_and_stage_options_only(policy, model, monkeypatch):
    torch._dynamo.reset()
    kept = _kept_guard_names(monkeypatch)
    polestar.generate(model, [[5, 7, 1, 3], [3, 4]], policy=policy, compile="eager", **KW)
    assert kept
    # nothing on the model (the binding fixes it) and no module global; the step's own inputs are guarded
    assert not [name for name in kept if "model" in name or "G['" in name]
    assert any(name.startswith("inputs.state") for name in kept)
    assert any(name.startswith("pipeline.stages['commit']") for name in kept)  # the stages' types and options


@pytest.mark.slow  # compiles polestar-cache's five step graphs
def test_new_pipelines_and_generations_of_one_composition_reuse_the_graphs():
    """``polestar-cache`` keeps its quantizer and offloader in a per-generation row store: the guards on them are
    on their types and options, so a second pipeline object (every ``generate`` call assembles one) with a new
    generation of the same shape passes them."""
    model = make_model("llada", seed=6, n_layers=2, d_model=32)  # its own: no pooled generation, no bound graph
    counters.clear()
    polestar.generate(model, [[5, 7, 1, 3], [3, 4]], policy="polestar-cache", compile="eager", **KW)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 2
    engine._POOLS[model].clear()  # the next generate call gets new buffers and stage state, not the pooled ones
    again = polestar.generate(model, [[9, 2, 6, 1], [8, 8]], policy="polestar-cache", compile="eager", **KW)
    assert counters["stats"]["unique_graphs"] == graphs
    assert dict(counters["recompiles"]) == {}
    eager = polestar.generate(model, [[9, 2, 6, 1], [8, 8]], policy="polestar-cache", **KW)
    assert again.tokens.tolist() == eager.tokens.tolist()


def test_the_inputs_hold_every_persistent_buffer_and_run_step_is_decode_step(model):
    """``Generation.inputs`` is the step's whole input besides the model and the stages: its tensors are the
    generation's persistent buffers, and ``run_step`` on them is the generation's step."""
    gen, twin = _first_step_of(model), _first_step_of(model)
    inputs = gen.inputs
    assert isinstance(inputs, StepInputs)
    assert (inputs.state, inputs.cache, inputs.totals, inputs.config) == (gen.state, gen.cache, gen.totals, gen.config)
    ids = {id(t) for t in persistent_tensors(gen)}
    assert {id(gen.state.x), id(gen.totals.nfe), id(gen.stops)} <= ids
    with torch.no_grad():
        a, b = decode_step(gen), run_step(twin.model, twin.pipeline, twin.inputs)
    assert torch.equal(a.work, b.work) and a.cost == b.cost
    assert torch.equal(gen.state.x, twin.state.x) and torch.equal(gen.totals.evals, twin.totals.evals)


def _first_step_of(model):
    """A fresh ``polestar`` generation of one prompt, at its first block's first step."""
    from polestar.api import encode_prompts
    from polestar.config import GenerationConfig
    from polestar.engine import _position, begin_block, start_generation, step_phase
    from polestar.policy import assemble

    ids, mask = encode_prompts(model, [[5, 7, 1, 3]])
    config = GenerationConfig(gen_length=16, block_length=8, stop_at_eos=False)
    with torch.no_grad():
        gen = start_generation(model, ids, mask, assemble("polestar"), config)
        begin_block(gen, 0)
    gen.draw()
    gen.state.phase = step_phase(gen, _position(gen, 0, 0, 0))
    return gen
