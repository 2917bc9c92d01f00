"""Every registered policy decodes with one host read per step, eagerly and compiled, and every compiled step runs
through one captured graph (no eager step, no graph break), with the same tokens and counters as eager.

The capture checks use the ``eager`` backend of ``torch.compile``: dynamo traces each step whole
(``fullgraph=True`` raises at the first graph break) without inductor's code generation, so every policy is
checked in seconds; ``tests/test_compile.py`` compiles a few policies with inductor. The LLaDA shape runs every
registered policy; the Dream shape runs one policy per registered refresh and commit stage."""

import pytest
import torch

import polestar
from polestar.config import GenerationConfig
from polestar.engine import decode
from polestar.policy import assemble, policy_names
from polestar.step import StepRunner
from tests.conftest import make_model
from tests.host_reads import count_host_reads

PROMPTS = [[5, 7, 1, 3, 9, 2, 4], [3, 4]]
CONFIG = GenerationConfig(gen_length=24, block_length=8, stop_at_eos=True)
COUNTERS = ("token_layer_evals", "proxy_query_evals", "weight_bytes", "kv_bytes", "nfe", "tokens")


@pytest.fixture(scope="module", params=["llada", "dream"])
def small_model(request):
    # two LLaDA layers cover the packet handed from one layer to the next; one Dream layer covers the shifted
    # logits and grouped K/V at half the tracing time
    return make_model(request.param, seed=11, n_layers=2 if request.param == "llada" else 1, d_model=32)


def _one_policy_per_stage() -> list[str]:
    """From the registry: for every refresh and commit stage some policy uses, the first policy that uses it (the
    Dream shape runs these; the LLaDA shape runs every policy)."""
    chosen: list[str] = []
    seen: set[tuple[str, str]] = set()
    for name in policy_names():
        stages = {(kind, stage.name) for kind, stage in assemble(name, {}).stages.items()}
        if not stages <= seen:
            chosen.append(name)
            seen |= stages
    return chosen


def _decode(model, policy: str, compile, overrides=None):
    pipeline = assemble(policy, {"threshold?": 0.3, **(overrides or {})})
    ids, mask = polestar.api.encode_prompts(model, PROMPTS)
    runner = StepRunner(compile, ids.device, pipeline)
    with count_host_reads() as reads:
        tokens, stats = decode(model, ids, mask, pipeline, CONFIG, runner=runner)
    return tokens, stats, runner, reads


CAPTURE_CASES = [("llada", p, {}) for p in policy_names()] + [("dream", p, {}) for p in _one_policy_per_stage()]
# Polestar's block start clusters every layer in one call after the forward on a CPU (the default there); the
# route a GPU takes by default, each layer clustered inside its pass, is captured too
CAPTURE_CASES += [(f, "polestar", {"cluster_layers_together": False}) for f in ("llada", "dream")]


@pytest.fixture(scope="module")
def models():
    return {}


@pytest.mark.parametrize("family, policy, overrides", CAPTURE_CASES,
                         ids=[f"{f}-{p}" + "".join(f"-{k}={v}" for k, v in o.items()) for f, p, o in CAPTURE_CASES])
def test_one_host_read_per_step_and_every_step_captured(models, family, policy, overrides):
    if family not in models:  # built once per module, as the small_model fixture does
        models[family] = make_model(family, seed=11, n_layers=2 if family == "llada" else 1, d_model=32)
    small_model = models[family]
    eager_tokens, eager_stats, eager_runner, eager_reads = _decode(small_model, policy, False, overrides)
    # one read per step (which blocks have work left), one before the first step, one for the final counters
    assert len(eager_reads) == eager_stats.nfe + 2, eager_reads
    assert eager_runner.eager_steps == eager_stats.nfe and eager_runner.compiled_steps == 0
    _decode(small_model, policy, "eager", overrides)  # trace every step variant once
    tokens, stats, runner, reads = _decode(small_model, policy, "eager", overrides)
    assert runner.eager_steps == 0 and runner.compiled_steps == stats.nfe > 0
    assert stats.compiled_steps == stats.nfe and eager_stats.compiled_steps == 0
    assert len(reads) == stats.nfe + 2, reads
    assert tokens.tolist() == eager_tokens.tolist()
    assert [getattr(stats, c) for c in COUNTERS] == [getattr(eager_stats, c) for c in COUNTERS]
    assert stats.sequences == eager_stats.sequences


def test_a_stage_that_cannot_be_compiled_runs_every_step_eagerly(small_model):
    pipeline = assemble("polestar", {"offload": "cpu"})
    runner = StepRunner(True, torch.device("cpu"), pipeline)
    ids, mask = polestar.api.encode_prompts(small_model, PROMPTS)
    _, stats = decode(small_model, ids, mask, pipeline, CONFIG, runner=runner)
    assert not runner.compile and runner.eager_steps == stats.nfe and runner.compiled_steps == 0
