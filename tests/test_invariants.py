"""Engine invariants for every registered policy and every registered stage swapped into a policy.

Cases come from the registries (``polestar.policy_names()``, ``polestar.registry.names(kind)`` for every kind), so
a newly registered policy or stage is covered without editing this file. Each case decodes random prompts
(hypothesis: lengths, tokens, block sizes, thresholds, seeds, EOS stop) on the small random models of
:mod:`polestar.testing` and checks every step through the engine's typed ``on_step`` records, with every stage
output checked against its contract (:func:`polestar.testing.check_decode_invariants`, the checks a researcher runs
on an outside stage with ``check_stage``).
"""

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import polestar
from polestar.registry import KINDS, names
from polestar.testing import TINY, check_decode_invariants, host_policy, tiny_model

CASES = [(policy, {}) for policy in polestar.policy_names()] + [
    (host_policy(kind), {kind: name}) for kind in KINDS for name in names(kind)
]


@functools.cache
def _model(family: str):
    return tiny_model(family, seed=31)


prompts = st.lists(st.lists(st.integers(0, TINY["mask_id"] - 1), min_size=1, max_size=6), min_size=1, max_size=3)


@pytest.mark.parametrize("policy,swap", CASES,
                         ids=[f"{p}-{','.join(f'{k}={v}' for k, v in s.items())}" for p, s in CASES])
@settings(max_examples=3, deadline=None)
@given(family=st.sampled_from(["llada", "dream"]), batch=prompts, block=st.sampled_from([4, 8]),
       n_blocks=st.integers(1, 3), threshold=st.floats(0.05, 0.95), seed=st.integers(0, 3), stop_at_eos=st.booleans())
def test_engine_invariants(policy, swap, family, batch, block, n_blocks, threshold, seed, stop_at_eos):
    check_decode_invariants(_model(family), policy, batch, swap, gen_length=block * n_blocks, block_length=block,
                            seed=seed, threshold=threshold, stop_at_eos=stop_at_eos)
