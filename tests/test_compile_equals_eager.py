"""``--compile`` changes nothing a user can see: on the shipped checkpoints every registered policy, compiled with
inductor (what ``compile=True`` means), decodes the same tokens with the same counters as without compile, item by
item, at batch 1 and at batch 4 (a smaller version of ``polestar bench --compile`` against ``polestar bench``)."""

import pytest
import torch

import polestar
from polestar.bench.harness import load_problems
from polestar.policy import policy_names
from polestar.tasks import get_task

N_PROBLEMS = 4
COUNTERS = ("nfe", "token_layer_evals", "proxy_query_evals", "weight_bytes", "kv_bytes")

_MODELS: dict = {}


def _model(name: str):
    if name not in _MODELS:
        _MODELS[name] = polestar.load(name, dtype=torch.float32, device="cpu")
    return _MODELS[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream-noisy"])
@pytest.mark.parametrize("policy", policy_names())
def test_compiled_decoding_equals_eager_item_by_item(name, policy):
    model = _model(name)
    task = get_task("arith")
    prompts = [task.format_prompt(p.input) for p in load_problems("arith", N_PROBLEMS)]
    for batch in (1, 4):
        for start in range(0, N_PROBLEMS, batch):
            chunk = prompts[start:start + batch]
            eager = polestar.generate(model, chunk, policy=policy)
            compiled = polestar.generate(model, chunk, policy=policy, compile=True)
            assert compiled.tokens.tolist() == eager.tokens.tolist(), (batch, start)
            assert compiled.stats.sequences == eager.stats.sequences, (batch, start)
            assert [getattr(compiled.stats, c) for c in COUNTERS] == [getattr(eager.stats, c) for c in COUNTERS]
            assert compiled.stats.compiled_steps == compiled.stats.nfe


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["polestar", "dllm-cache"])
def test_eight_layers_compiled_with_inductor_equal_eager(policy):
    """The depth where the removed whole-step compile aborted or changed tokens: a tiny-width LLaDA of 8 layers, one
    prompt of 64 ids, 128 tokens in blocks of 32, two tokens per step, every block decoded."""
    from polestar.bench.step_ops import PAPER
    from polestar.testing import tiny_model

    model = tiny_model("llada", seed=3, n_layers=8)
    kw = PAPER.generate_kwargs(policy=policy)
    eager = polestar.generate(model, PAPER.prompts, **kw)
    compiled = polestar.generate(model, PAPER.prompts, compile=True, **kw)
    assert compiled.tokens.tolist() == eager.tokens.tolist()
    assert [getattr(compiled.stats, c) for c in COUNTERS] == [getattr(eager.stats, c) for c in COUNTERS]
    assert compiled.stats.compiled_steps == compiled.stats.nfe == eager.stats.nfe


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["polestar", "dllm-cache"])
def test_bfloat16_compiled_equals_eager(policy):
    """In bf16 inductor would keep a fused kernel's intermediates in fp32 (other last bits than eager, which rounds
    after each operation): the regions are compiled with ``emulate_precision_casts``, and tokens stay eager's."""
    model = polestar.load("tiny-llada", dtype=torch.bfloat16, device="cpu")
    task = get_task("arith")
    prompts = [task.format_prompt(p.input) for p in load_problems("arith", N_PROBLEMS)]
    for prompt in prompts:
        eager = polestar.generate(model, [prompt], policy=policy)
        compiled = polestar.generate(model, [prompt], policy=policy, compile=True)
        assert compiled.tokens.tolist() == eager.tokens.tolist()
        assert [getattr(compiled.stats, c) for c in COUNTERS] == [getattr(eager.stats, c) for c in COUNTERS]
