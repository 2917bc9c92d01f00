"""torch.compile of the decoding step: same tokens as eager, no graph breaks, a bounded number of graphs."""

import pytest
import torch
from torch._dynamo.utils import counters

import polestar
from tests.conftest import make_model

PROMPTS = [[5, 7, 1, 3, 9, 2, 4], [3, 4]]


@pytest.fixture(scope="module")
def small_model():
    torch._dynamo.reset()
    return make_model("llada", seed=11, n_layers=2, d_model=32)


def test_compiled_generation_matches_eager_without_graph_breaks(small_model):
    counters.clear()
    kw = dict(gen_length=24, block_length=8, threshold=0.3, stop_at_eos=False)
    for policy in ("fast-dllm", "baseline", "polestar"):
        eager = polestar.generate(small_model, PROMPTS, policy=policy, **kw)
        compiled = polestar.generate(small_model, PROMPTS, policy=policy, compile=True, **kw)
        assert compiled.tokens.tolist() == eager.tokens.tolist(), policy
    assert dict(counters["graph_break"]) == {}
    # full plan (with and without Polestar's block-start capture hook), block plan, block plan with the
    # sparse-update hook, Polestar's block-start store + proxy scoring (+ at most one dynamic-shape recompile each)
    assert 1 <= counters["stats"]["unique_graphs"] <= 12
    # a second generation reuses the graphs
    before = counters["stats"]["unique_graphs"]
    polestar.generate(small_model, PROMPTS, policy="polestar", compile=True, **kw)
    assert counters["stats"]["unique_graphs"] == before
