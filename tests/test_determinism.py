"""Determinism and batch invariance of every registered policy.

* the same seed gives the same tokens, greedy and sampled (temperature > 0);
* a sequence decodes to the same tokens alone or in a batch with others (greedy, fp32), with prompts of
  different lengths so that left padding is exercised.

Parametrized from ``polestar.policy_names()``: a new policy is covered without editing this file. The checks are
:mod:`polestar.testing`'s (``check_stage`` runs them on an outside stage).
"""

import pytest

import polestar
from polestar.testing import PROMPTS, check_batch_invariance, check_determinism
from tests.conftest import make_model

# PROMPTS: two prompts of different lengths (token ids below the tiny vocabulary's special ids 38/39): the shorter
# one is left-padded in the batch
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
    check_determinism(llada, policy, temperature=temperature, prompts=PROMPTS, **DECODING)


#: options that make a policy's decisions independent of rounding noise: dLLM-Cache ranks value cosines exactly as
#: its released code does, and on the random Dream model the unchanged rows' cosines lie within a few ulps of each
#: other, which left padding moves; compared on a 2^-16 grid they pick the same rows alone and in a batch
BATCH_OPTIONS = {"dllm-cache": {"refresh.similarity_grid": 2.0**-16}}


@pytest.mark.parametrize("policy", polestar.policy_names())
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_batch_invariance(request, family, policy):
    check_batch_invariance(request.getfixturevalue(family), policy, BATCH_OPTIONS.get(policy), prompts=PROMPTS,
                           **BATCH_DECODING)
