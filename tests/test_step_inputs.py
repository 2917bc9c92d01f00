"""The step's explicit inputs: a step is ``run_step(model, pipeline, inputs)``, and a new pipeline object or
generation of the same composition reuses the compiled regions (nothing guards on a pipeline or generation
object)."""

import pytest
import torch
from torch._dynamo.utils import counters

import polestar
from polestar import engine
from polestar.step import StepInputs, decode_step, persistent_tensors, run_step
from tests.conftest import make_model

KW = dict(gen_length=16, block_length=8, threshold=0.3, stop_at_eos=False)


@pytest.fixture(scope="module")
def model():
    return make_model("llada", seed=5, n_layers=2, d_model=32)


def test_new_pipelines_and_generations_of_one_composition_reuse_the_regions():
    """A second pipeline object (every ``generate`` call assembles one) with a new generation of the same shape
    compiles nothing: the regions take tensors only."""
    model = make_model("llada", seed=6, n_layers=2, d_model=32)  # its own: no pooled generation
    torch._dynamo.reset()  # no cache entries of other tests' shapes on the regions' code
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
