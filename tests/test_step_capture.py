"""Every registered policy decodes with one host read per step, eagerly and on the route ``compile=True`` takes on
CUDA, and equals eager decoding token for token and counter for counter on it: every layer region compiled and
checked (:class:`polestar.graph_rules.GraphProbe`: dynamo with ``fullgraph=True``, so any graph break fails, and AOT
autograd's full route, the one inductor runs: no region mutates an input, has an int input or two inputs that alias
each other), and every step phase captured once and replayed with a CUDA graph's semantics
(:func:`polestar.step.taped_step_graphs`: recorded operations on recorded tensors, no Python). The captured steps
include the compiled regions, as on CUDA. ``tests/test_step_capture_batch3.py`` runs the LLaDA batch-3 cases of
:data:`CASES` and the check with the ``trace`` and ``anatomy`` observers. ``tests/test_compile.py`` compiles with
inductor.

The LLaDA shape runs every registered policy at batch 1 (five blocks, no stop at EOS: the window refresh of block
index 3 is reached); at batch 3 with mixed prompt lengths (stop at EOS), the LLaDA and Dream shapes run one policy
per registered stage (a step is made of its stages' code; the compositions are all met at batch 1).
"""

import pytest
import torch

import polestar
from polestar.config import GenerationConfig
from polestar.engine import decode
from polestar.graph_rules import GraphProbe
from polestar.policy import assemble, policy_names
from polestar.step import StepRunner, taped_step_graphs
from tests.conftest import make_model
from tests.host_reads import count_host_reads

PROMPTS = {1: [[5, 7, 1, 3, 9, 2, 4]], 3: [[5, 7, 1, 3, 9, 2, 4], [3, 4], [8, 8, 2, 6]]}
CONFIGS = {1: GenerationConfig(gen_length=20, block_length=4, stop_at_eos=False),
           3: GenerationConfig(gen_length=20, block_length=4, stop_at_eos=True)}
COUNTERS = ("token_layer_evals", "proxy_query_evals", "weight_bytes", "kv_bytes", "nfe", "tokens")

class PhaseRunner(StepRunner):
    """A :class:`StepRunner` that keeps the distinct step phases it ran."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.phases: set = set()

    def __call__(self, gen, phase):
        self.phases.add(phase)
        return super().__call__(gen, phase)


def _one_policy_per_stage() -> list[str]:
    """From the registry: for every stage some policy uses (of any kind), the first policy that uses it (batch 3
    runs these; batch 1 runs every policy)."""
    chosen: list[str] = []
    seen: set[tuple[str, str]] = set()
    for name in policy_names():
        stages = {(kind, stage.name) for kind, stage in assemble(name, {}).stages.items()}
        if not stages <= seen:
            chosen.append(name)
            seen |= stages
    return chosen


_MODELS: dict = {}


def _model(family: str, n_layers: int | None = None):
    key = (family, n_layers)
    if key not in _MODELS:  # two LLaDA layers cover the packet handed from one layer to the next; one Dream
        # layer covers the shifted logits and grouped K/V at half the tracing time
        layers = n_layers if n_layers is not None else 2 if family == "llada" else 1
        _MODELS[key] = make_model(family, seed=11, n_layers=layers, d_model=32)
    return _MODELS[key]


def _decode(model, policy: str, batch: int, compile, overrides=None, on_step=None, prompts=None, config=None,
            graphs=False):
    pipeline = assemble(policy, {"threshold?": 0.3, **(overrides or {})})
    ids, mask = polestar.api.encode_prompts(model, prompts or PROMPTS[batch])
    runner = PhaseRunner(compile, ids.device, pipeline, graphs=graphs)
    with count_host_reads() as reads:
        tokens, stats = decode(model, ids, mask, pipeline, config or CONFIGS[batch], runner=runner, on_step=on_step)
    return tokens, stats, runner, reads


def _check_against_eager(model, policy: str, batch: int, overrides=None, observer=None,
                         **shape) -> tuple[GraphProbe, PhaseRunner]:
    """Decode eagerly, then twice with the regions compiled through a :class:`GraphProbe` and the steps captured
    (:func:`~polestar.step.taped_step_graphs`; the first run compiles and captures, the second reuses both): the
    same tokens and counters, one host read per step, no region problem, nothing compiled again. ``observer``: a
    factory of ``(on_step, records)`` pairs; a fresh one watches the eager and the second compiled run, and the
    records it kept (read once the run ended) must be equal (an observed step is captured too, as a graph of its
    own: every step of the second run is a replay, observed or not)."""
    torch._dynamo.reset()  # each probe compiles the regions anew: no cache entries of other tests on their code
    observers = [observer() if observer else (None, list) for _ in range(3)]
    eager_tokens, eager_stats, eager_runner, eager_reads = _decode(model, policy, batch, False, overrides,
                                                                   on_step=observers[0][0], **shape)
    # one read per step (which blocks have work left), one before the first step, one for the final counters
    assert len(eager_reads) == eager_stats.nfe + 2, eager_reads
    assert eager_runner.eager_steps == eager_stats.nfe and eager_runner.compiled_steps == 0
    probe, graphs = GraphProbe(), taped_step_graphs()
    _decode(model, policy, batch, probe, overrides, on_step=observers[1][0], graphs=graphs, **shape)
    compiled, eager_phases = len(probe.graphs), graphs.eager
    tokens, stats, runner, reads = _decode(model, policy, batch, probe, overrides, on_step=observers[2][0],
                                           graphs=graphs, **shape)  # reuses the regions, the buffers and the graphs
    assert observers[2][1]() == observers[0][1]()
    assert len(probe.graphs) == compiled  # a second generation of the same shape compiles nothing
    assert runner.eager_steps == 0 and runner.compiled_steps == stats.nfe > 0
    # every step of the second run is a replay of a phase captured in the first, observed or not
    assert graphs.eager == eager_phases and graphs.captured <= len(runner.phases)
    assert stats.compiled_steps == stats.nfe and eager_stats.compiled_steps == 0
    assert len(reads) == stats.nfe + 2, reads
    assert tokens.tolist() == eager_tokens.tolist()
    assert [getattr(stats, c) for c in COUNTERS] == [getattr(eager_stats, c) for c in COUNTERS]
    assert stats.sequences == eager_stats.sequences
    # a region's sizes may be symbolic inputs (compiled once for every prompt length); a captured step fixes them, so
    # the rules are on what a region writes and on memory shared between its inputs
    assert [p for g in probe.graphs for p in g.problems() if "int inputs" not in p] == []
    assert not any(g.mutated or g.aliased for g in probe.graphs)
    return probe, runner


# a step's graph is made of its stages' code: every composition of stages is captured at batch 1, and at batch 3
# (rows of other lengths, rows that stop) one policy per registered stage: Dream's here, LLaDA's with the observers
# attached in tests/test_step_capture_batch3.py (under ``--dist loadfile`` a file runs on one worker, and the two
# halves of the capture work take a minute each)
CASES = [("llada", p, 1, {}) for p in policy_names()] + [("dream", p, 3, {}) for p in _one_policy_per_stage()]
# Polestar's block start clusters every layer in one call after the forward (the default); the other route, each
# layer clustered inside its pass, is captured too
CASES += [("llada", "polestar", 3, {"cluster_layers_together": False})]


def case_ids(cases) -> list[str]:
    return [f"{f}-{p}-b{b}" + "".join(f"-{k}={v}" for k, v in o.items()) for f, p, b, o in cases]


@pytest.mark.parametrize("family, policy, batch, overrides", CASES, ids=case_ids(CASES))
def test_every_step_is_a_replayable_graph_with_one_host_read(family, policy, batch, overrides):
    _check_against_eager(_model(family), policy, batch, overrides)


@pytest.mark.slow
def test_elastic_cache_recomputation_steps_are_replayable_graphs():
    """Elastic-Cache recomputes a forward whose tracked attention drifted from the layer above the trigger: at
    layer 0 decided at the end of the previous step (a step that recomputes from layer 1), above it in the next
    step (one graph per layer). On the four layers of the shipped noisy checkpoint, three arith prompts meet every
    step kind (a batch start, cached steps, a fire at layer 0 and a rerun from a layer above), captured like the
    others and decoded as eagerly."""
    model = polestar.load("tiny-llada-noisy", dtype=torch.float32)
    arith = ["arith:7-7-7-5*5*0=", "arith:4+6=", "arith:3+4*2-5="]
    config = GenerationConfig(gen_length=32, block_length=8, stop_at_eos=True)
    _, runner = _check_against_eager(model, "elastic-cache", 3, {"gamma": 0.95, "threshold": 0.9, "window_length": 8},
                                     prompts=arith, config=config)
    assert {p.refresh[0] for p in runner.phases} == {"first", "cached", "fire0", "rerun"}, runner.phases


def test_a_stage_that_cannot_be_captured_turns_the_capture_off_and_the_regions_still_compile():
    model = _model("llada")
    pipeline = assemble("polestar", {"offload": "cpu"})
    runner = StepRunner(True, torch.device("cpu"), pipeline, graphs=taped_step_graphs())
    ids, mask = polestar.api.encode_prompts(model, PROMPTS[3])
    tokens, stats = decode(model, ids, mask, pipeline, CONFIGS[3], runner=runner)
    assert runner.graphs is None and runner.regions is not None and runner.compiled_steps == stats.nfe
    eager, _ = decode(model, ids, mask, pipeline, CONFIGS[3])
    assert tokens.tolist() == eager.tolist()
