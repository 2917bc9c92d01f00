"""The phase table: after a phase's first compiled step, a step is its recorded graph called on the recorded tensors
(no dynamo frame). Every registered policy is checked this way against eager decoding in tests/test_step_capture.py
(the second compiled generation runs every step by key); here: what may be recorded, and that a replaced tensor
(a buffer, a weight assigned by hand) is never read from a stale recording."""

import pytest
import torch

import polestar
from polestar.engine import decode
from polestar.phase_table import CompiledPhase, PhaseTable, RecordingBackend, bind_phase, recording
from polestar.policy import assemble
from polestar.step import StepRunner
from tests.conftest import make_model

PROMPTS = [[5, 7, 1, 3, 9, 2, 4], [3, 4, 8]]
KW = dict(gen_length=16, block_length=4, threshold=0.3, stop_at_eos=False)


@pytest.fixture(scope="module")
def model():
    return make_model("llada", seed=5, n_layers=2, d_model=32)


def _run(model, policy, compile="eager", on_step=None):
    pipeline = assemble(policy, {"threshold?": 0.3})
    ids, mask = polestar.api.encode_prompts(model, PROMPTS)
    runner = StepRunner(compile, ids.device, pipeline)
    config = polestar.config.GenerationConfig(**{k: v for k, v in KW.items() if k != "threshold"})
    tokens, stats = decode(model, ids, mask, pipeline, config, runner=runner, on_step=on_step)
    return tokens, stats, runner


@pytest.mark.parametrize("policy", ["fast-dllm", pytest.param("polestar", marks=pytest.mark.slow)])
def test_steps_after_each_phases_first_are_called_by_key_and_equal_eager(model, policy):
    eager, eager_stats, _ = _run(model, policy, compile=False)
    tokens, stats, runner = _run(model, policy)
    assert tokens.tolist() == eager.tolist() and stats.sequences == eager_stats.sequences
    assert 0 < runner.keyed_steps < stats.nfe  # each phase's first step went through dynamo and was recorded
    tokens, stats, runner = _run(model, policy)  # the pooled generation keeps its table
    assert tokens.tolist() == eager.tolist() and stats.sequences == eager_stats.sequences
    assert runner.keyed_steps == runner.compiled_steps == stats.nfe


def test_an_observed_step_goes_through_dynamo(model):
    _run(model, "fast-dllm")
    records = []
    _, stats, runner = _run(model, "fast-dllm", on_step=records.append)
    assert len(records) == stats.nfe and runner.compiled_steps == stats.nfe and runner.keyed_steps == 0


def test_a_weight_assigned_by_hand_is_read_by_the_next_generation(model):
    _run(model, "fast-dllm")
    _run(model, "fast-dllm")  # every step by key
    o = model.layer_parts(1).o
    old = o.weight
    o.weight = torch.nn.Parameter(old.detach() * -3.0)  # a new tensor object: recordings that read the old one go
    try:
        eager, eager_stats, _ = _run(model, "fast-dllm", compile=False)
        tokens, stats, runner = _run(model, "fast-dllm")
        assert tokens.tolist() == eager.tolist() and stats.sequences == eager_stats.sequences
        assert runner.keyed_steps < stats.nfe  # the stale recordings were dropped and made again
    finally:
        o.weight = old


def test_a_buffer_replaced_between_generations_drops_the_recordings_that_read_it(model):
    _, first, _ = _run(model, "fast-dllm")
    gen = next(g for free in polestar.engine._POOLS[model].values() for g in free
               if g.pipeline.describe() == assemble("fast-dllm", {"threshold?": 0.3}).describe())
    assert gen.phases.entries
    gen.totals.nfe = gen.totals.nfe.clone()  # a new object: the step's counter is now this one
    _, stats, runner = _run(model, "fast-dllm")
    assert [s.nfe for s in stats.sequences] == [s.nfe for s in first.sequences]  # counted into the new buffer
    assert runner.keyed_steps < stats.nfe


def _graph(*args):
    return (args[0] + 1,)


def test_bind_phase_takes_one_call_whose_only_output_is_the_flags():
    x = torch.zeros(3)
    out = _graph(x)
    phase = bind_phase([(_graph, (x,), out)], out[0], cost="cost")
    assert isinstance(phase, CompiledPhase) and phase.cost == "cost"
    assert torch.equal(phase(), torch.ones(3))
    assert bind_phase([], out[0], None) is None
    assert bind_phase([(_graph, (x,), out)] * 2, out[0], None) is None  # two graphs in one step
    assert bind_phase([(_graph, (x,), (out[0], x))], out[0], None) is None  # a tensor dynamo would store elsewhere
    assert bind_phase([(_graph, (x,), out)], x, None) is None  # the flags are not the graph's output
    assert bind_phase([(_graph, (x, 3), out)], out[0], None) is None  # an int input


def test_recording_backend_hands_calls_to_recording_only_inside_it():
    backend = RecordingBackend(lambda gm, inputs: gm.forward, name="eager")
    fn = torch.compile(lambda t: t * 2, backend=backend, fullgraph=True)
    x = torch.ones(2)
    fn(x)
    with recording() as calls:
        fn(x)
    fn(x)
    assert len(calls) == 1 and calls[0][1][0] is x and backend.compiler_name == "eager"


def test_keep_valid_drops_entries_reading_a_tensor_no_longer_held():
    a, b = torch.zeros(1), torch.zeros(1)
    table = PhaseTable()
    table.record("p", CompiledPhase(_graph, (a,), None))
    table.record("q", CompiledPhase(_graph, (b,), None))
    table.record("r", None)
    assert not table.wants("p") and not table.wants("r") and table.wants("s")
    assert table.keep_valid([a]) == 1 and set(table.entries) == {"p"}


def test_recording_collects_only_this_threads_calls():
    import threading

    backend = RecordingBackend(lambda gm, inputs: gm.forward, name="eager")
    fn = torch.compile(lambda t: t + 1, backend=backend, fullgraph=True)
    x = torch.ones(2)
    fn(x)
    other = threading.Thread(target=fn, args=(x,))
    with recording() as calls:
        other.start()
        other.join()
    assert calls == []
