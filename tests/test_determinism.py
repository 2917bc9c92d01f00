"""Determinism and batch invariance of every registered policy.

* the same seed gives the same tokens, greedy and sampled (temperature > 0);
* a sequence decodes to the same tokens alone or in a batch with others (greedy, fp32), with prompts of
  different lengths so that left padding is exercised.

Parametrized from ``polestar.policy_names()``: a new policy is covered without editing this file.
"""

import pytest
import torch

import polestar
from tests.conftest import make_model

# prompts of different lengths (token ids below the tiny vocabulary's special ids 38/39): the shorter one is
# left-padded in the batch
PROMPTS = [[5, 17, 3], [9, 1, 22, 30, 4, 11, 2]]
DECODING = dict(gen_length=16, block_length=8)
# blocks of 16 with Polestar's 2-block prefix window: the window of the first blocks reaches past the start of the
# shorter prompt, into its left padding in the batch and before column 0 alone
BATCH_DECODING = dict(gen_length=32, block_length=16)


@pytest.fixture(scope="module")
def llada():
    return make_model("llada", seed=1)


@pytest.fixture(scope="module")
def dream():
    return make_model("dream", seed=1)


@pytest.mark.parametrize("policy", polestar.policy_names())
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_same_seed_same_tokens(llada, policy, temperature):
    runs = [polestar.generate(llada, PROMPTS, policy=policy, temperature=temperature, seed=7, **DECODING)
            for _ in range(2)]
    assert torch.equal(runs[0].tokens, runs[1].tokens)
    assert [s.nfe for s in runs[0].stats.sequences] == [s.nfe for s in runs[1].stats.sequences]


@pytest.mark.parametrize("policy", polestar.policy_names())
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_batch_invariance(request, family, policy):
    tiny = request.getfixturevalue(family)
    batch = polestar.generate(tiny, PROMPTS, policy=policy, **BATCH_DECODING).generations
    for i, prompt in enumerate(PROMPTS):
        alone = polestar.generate(tiny, [prompt], policy=policy, **BATCH_DECODING).generations[0]
        assert torch.equal(batch[i], alone), f"{policy}: prompt {i} decodes differently alone and in the batch"
