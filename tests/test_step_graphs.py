"""Uncompiled steps replayed as graphs: every registered policy, its steps recorded once per phase and replayed with
a CUDA graph's semantics on the CPU (:class:`polestar.step_graphs.ReplayTape`: the recorded operations on the
recorded tensors, no Python), gives eager decoding's tokens and counters, and every step after a phase's first two
is a replay."""

import pytest
import torch

from polestar.config import GenerationConfig
from polestar.engine import decode
from polestar.policy import assemble, policy_names
from polestar.step import StepRunner, taped_step_graphs
from polestar.step_graphs import ReplayTape
from tests.conftest import make_model

PROMPTS = [[5, 7, 1, 3, 9, 2, 4], [3, 4], [8, 8, 2, 6]]
CONFIG = GenerationConfig(gen_length=20, block_length=4, stop_at_eos=True)
COUNTERS = ("token_layer_evals", "proxy_query_evals", "weight_bytes", "kv_bytes", "nfe", "tokens")


def _inputs():
    ids = torch.zeros(len(PROMPTS), max(map(len, PROMPTS)), dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for row, p in enumerate(PROMPTS):
        ids[row, ids.shape[1] - len(p):] = torch.tensor(p)
        mask[row, ids.shape[1] - len(p):] = True
    return ids, mask


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("policy", policy_names())
def test_replayed_steps_equal_eager_decoding(policy, family):
    model = make_model(family, n_layers=2)
    ids, mask = _inputs()
    pipeline = assemble(policy)
    eager_tokens, eager_stats = decode(model, ids, mask, pipeline, CONFIG, runner=StepRunner(False, "cpu", pipeline))
    graphs = taped_step_graphs()
    runner = StepRunner(False, "cpu", pipeline, graphs=graphs)
    assert runner.graphs is graphs
    tokens, stats = decode(model, ids, mask, pipeline, CONFIG, runner=runner)
    assert torch.equal(tokens, eager_tokens)
    assert [getattr(stats, c) for c in COUNTERS] == [getattr(eager_stats, c) for c in COUNTERS]
    assert graphs.captured > 0 and graphs.replayed >= graphs.captured
    assert graphs.eager + graphs.replayed == eager_stats.nfe  # each step ran once: eagerly or as a replay
    again, _ = decode(model, ids, mask, pipeline, CONFIG, runner=runner)  # a pooled generation reuses its graphs
    assert torch.equal(again, eager_tokens)


def test_a_step_whose_python_changes_within_a_phase_is_caught_by_the_replay():
    # a "graph" recorded at one step replays that step's operations: a decision taken in Python from a value that
    # changes between steps of one phase is frozen at its captured value, as on a GPU
    x = torch.zeros(3)
    flag = {"value": 1.0}

    def step():
        x.add_(flag["value"])
        return x

    tape = ReplayTape([x])
    tape.capture(step)
    assert torch.equal(x, torch.zeros(3))  # capturing runs nothing (its effects are undone)
    flag["value"] = 5.0
    tape.replay()
    assert torch.equal(x, torch.ones(3))  # the captured 1.0, not 5.0


def test_a_host_read_inside_a_captured_step_is_refused():
    x = torch.ones(2)
    tape = ReplayTape([x])
    with pytest.raises(RuntimeError, match="read a tensor's value on the host"):
        tape.capture(lambda: x.add_(1.0) if bool(x.sum() > 0) else x)


def test_graphs_are_on_for_cuda_with_or_without_compile_and_off_on_a_cpu_by_default():
    pipeline = assemble("fast-dllm")
    assert StepRunner(False, "cpu", pipeline).graphs is None
    assert StepRunner(True, "cpu", pipeline).graphs is None
    for compile in (False, True):  # one route: compiled regions or not, a CUDA step is captured
        assert StepRunner(compile, "cuda", pipeline).graphs is not None  # made without touching CUDA (lazily)
        assert StepRunner(compile, "cuda", pipeline, graphs=False).graphs is None
    graphs = taped_step_graphs()
    assert StepRunner("eager", "cpu", pipeline, graphs=graphs).graphs is graphs


def test_a_weight_assigned_by_hand_is_read_by_the_next_generation_not_the_captured_one():
    model = make_model("llada", n_layers=2, seed=9)
    ids, mask = _inputs()
    pipeline = assemble("fast-dllm")
    graphs = taped_step_graphs()
    runner = StepRunner(False, "cpu", pipeline, graphs=graphs)
    decode(model, ids, mask, pipeline, CONFIG, runner=runner)  # captured: the graphs read this weight
    o = model.layer_parts(1).o
    old = o.weight
    o.weight = torch.nn.Parameter(old.detach() * -3.0)  # a new tensor: a replay of the old graphs would read `old`
    try:
        eager, _ = decode(model, ids, mask, pipeline, CONFIG, runner=StepRunner(False, "cpu", pipeline))
        captured = graphs.captured
        tokens, _ = decode(model, ids, mask, pipeline, CONFIG, runner=runner)
        assert torch.equal(tokens, eager)
        assert graphs.captured > captured  # the graphs that read the old weight were dropped and captured again
    finally:
        o.weight = old
