""":class:`polestar.graph_rules.GraphProbe` on small functions whose answers are known: a mutated input without a
static address is reported (directly and through a view), a static one is not, an int input is reported, the
outputs of a call are poisoned once the next call ran (inputs handed back are not), and AOT autograd's analysis
pass alone gives the reports its full route gives, on those functions and on a real decoding step."""

import itertools
import types

import pytest
import torch

import polestar
from polestar import graph_rules
from polestar.config import GenerationConfig
from polestar.engine import decode
from polestar.graph_rules import GraphProbe, aot_input_metadata
from polestar.policy import assemble
from polestar.step import StepRunner
from tests.conftest import make_model

_COUNT = itertools.count()

ROUTES = pytest.mark.parametrize("aot_graph", [False, True], ids=["analysis-pass", "full-aot"])


def _fresh(fn):
    """``fn`` with a code object of its own: dynamo keeps its graphs per code object, so every probe here compiles
    anew."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_COUNT)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _compiled(fn, probe):
    return torch.compile(_fresh(fn), backend=probe, fullgraph=True)


def _add_one_in_place(x, y):
    x.add_(1)
    return y * 2


def _scale_first_row_in_place(x):
    x[0].mul_(2)
    return x.sum()


def _twice(x):
    return x * 2, x


def _repeat(x, n: int):
    return x.repeat(n)


@ROUTES
def test_a_mutated_input_without_a_static_address_is_reported(aot_graph):
    probe = GraphProbe(aot_graph=aot_graph)
    x, y = torch.zeros(3), torch.ones(3)
    out = _compiled(_add_one_in_place, probe)(x, y)
    assert x.tolist() == [1.0, 1.0, 1.0] and out.tolist() == [2.0, 2.0, 2.0]  # the graph ran
    (report,) = probe.graphs
    assert report.mutated == ("L['x']",) and report.mutated_not_static == ("L['x']",)
    assert probe.problems() == ["graph 0: mutates inputs without a static address: L['x']"]


@ROUTES
def test_a_static_address_makes_the_mutation_replayable(aot_graph):
    probe = GraphProbe(aot_graph=aot_graph)
    x, y = torch.zeros(3), torch.ones(3)
    torch._dynamo.mark_static_address(x, guard=False)
    _compiled(_add_one_in_place, probe)(x, y)
    (report,) = probe.graphs
    assert report.mutated == ("L['x']",) and "L['x']" in report.static
    assert probe.problems() == []


@ROUTES
def test_a_mutation_through_a_view_is_the_inputs(aot_graph):
    probe = GraphProbe(aot_graph=aot_graph)
    x = torch.ones(2, 3)
    assert _compiled(_scale_first_row_in_place, probe)(x).item() == 9.0
    assert probe.graphs[0].mutated_not_static == ("L['x']",)


@ROUTES
def test_an_int_input_is_reported(aot_graph):
    probe = GraphProbe(aot_graph=aot_graph)
    fn = _compiled(_repeat, probe)
    x = torch.arange(2.0)
    with torch._dynamo.config.patch(automatic_dynamic_shapes=True, assume_static_by_default=True):
        fn(x, 2)
        assert fn(x, 3).tolist() == [0.0, 1.0] * 3  # a second value recompiles with the int as a graph input
    first, second = probe.graphs
    assert first.int_inputs == () and len(second.int_inputs) == 1
    assert probe.problems() == [f"graph 1: int inputs (one CUDA graph per value): {second.int_inputs[0]}"]


@ROUTES
def test_outputs_are_poisoned_once_the_next_call_ran_and_inputs_handed_back_are_not(aot_graph):
    probe = GraphProbe(poison=True, aot_graph=aot_graph)
    fn = _compiled(_twice, probe)
    x = torch.ones(2)
    first, same = fn(x)
    assert first.tolist() == [2.0, 2.0] and same is x
    fn(x)
    assert first.isnan().all() and x.tolist() == [1.0, 1.0]  # overwritten as a replay would; the input kept
    assert probe.calls == 2


def test_the_analysis_pass_is_taken_on_this_torch():
    """The reports of the other tests come from the analysis pass alone (not from the full route it falls back to
    on a torch whose AOT internals differ)."""
    seen = []

    def backend(gm, example_inputs):
        seen.append(aot_input_metadata(gm, example_inputs))
        return gm.forward

    _compiled(_add_one_in_place, backend)(torch.zeros(3), torch.ones(3))
    (meta,) = seen
    assert meta is not None and [info.mutates_data for info in meta.input_info] == [True, False]


def test_a_torch_with_other_aot_internals_gets_the_full_route(monkeypatch):
    def older_prepare(mod, args):  # another signature than the one called
        raise AssertionError("not reached")

    monkeypatch.setattr(graph_rules, "_aot_internals", lambda: (older_prepare, None, object))
    probe = GraphProbe()
    x = torch.zeros(3)
    _compiled(_add_one_in_place, probe)(x, torch.ones(3))
    assert x.tolist() == [1.0, 1.0, 1.0] and probe.graphs[0].mutated_not_static == ("L['x']",)


def test_both_routes_report_a_decoding_step_alike():
    model = make_model("llada", seed=11, n_layers=1, d_model=32)
    ids, mask = polestar.api.encode_prompts(model, [[5, 7, 1, 3], [3, 4]])
    config = GenerationConfig(gen_length=8, block_length=4, stop_at_eos=False)
    runs = []
    for aot_graph in (False, True):
        torch._dynamo.reset()  # each route compiles the same regions from the same (static) start
        pipeline = assemble("fast-dllm", {"threshold": 0.3})
        probe = GraphProbe(aot_graph=aot_graph)
        runner = StepRunner(probe, ids.device, pipeline)
        tokens, _ = decode(model, ids, mask, pipeline, config, runner=runner)
        # what the rules read (torch 2.11's two routes list different static inputs of graphs that mutate none)
        runs.append((tokens.tolist(), [(g.inputs, g.mutated, g.mutated_not_static, g.int_inputs, g.aliased)
                                       for g in probe.graphs]))
    assert runs[0] == runs[1] and runs[0][1] and not any(mutated for _, mutated, *_ in runs[0][1])


def test_inputs_that_share_memory_are_reported():
    probe = GraphProbe()
    base = torch.zeros(6)
    _compiled(lambda a, b: a + b, probe)(base[:3], base[3:])
    (report,) = probe.graphs
    assert len(report.aliased) == 1 and "share memory" in report.problems()[0]
    probe = GraphProbe()
    _compiled(lambda a, b: a + b, probe)(torch.zeros(3), torch.zeros(3))
    assert probe.graphs[0].aliased == () and probe.problems() == []
