"""Engine invariants for every registered policy and every registered stage swapped into a policy.

Cases come from the registries (``polestar.policy_names()``, ``polestar.registry.names(kind)`` for every kind), so
a newly registered policy or stage is covered without editing this file. Each case decodes random prompts
(hypothesis: lengths, tokens, block sizes, thresholds, seeds, EOS stop) on the small random models of
``tests/conftest.py`` and checks every step through the engine's typed ``on_step`` records.
"""

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import polestar
from polestar.policy import get_policy
from polestar.registry import KINDS, names
from tests.conftest import TINY, make_model


def _host_policy(kind: str) -> str:
    """The policy a stage of ``kind`` is swapped into: ``fast-dllm`` when it has that kind, else the first
    registered policy that has one."""
    if kind in get_policy("fast-dllm").stages:
        return "fast-dllm"
    return next(p for p in polestar.policy_names() if kind in get_policy(p).stages)


CASES = [(policy, {}) for policy in polestar.policy_names()] + [
    (_host_policy(kind), {kind: name}) for kind in KINDS for name in names(kind)
]


@functools.cache
def _model(family: str):
    return make_model(family, seed=31)


prompts = st.lists(st.lists(st.integers(0, TINY["mask_id"] - 1), min_size=1, max_size=6), min_size=1, max_size=3)


def check_step(record, mask_id: int) -> None:
    """The invariants of one step (see the module docstring)."""
    before, after, active = record.tokens_before, record.tokens_after, record.active
    T = before.shape[1]
    # committed tokens never change; frozen rows do not change at all
    fixed = before != mask_id
    assert (after[fixed] == before[fixed]).all()
    assert (after[~active] == before[~active]).all()
    # at least one commit per step in every row that decoded, inside its block
    in_block = record.committed[:, record.block_start : record.block_end]
    assert in_block[active].any(dim=1).all()
    # the typed origins account for every commit in the block; anything else is the EOS fill of a finished row
    origin = record.origins.block
    assert (in_block | ~origin).all()
    assert (after[:, record.block_start : record.block_end][in_block & ~origin] == TINY["eos_id"]).all()
    # the plan names only real positions, and only in rows that decode
    plan = record.plan
    valid = plan.valid.reshape(-1, *plan.valid.shape[-2:])
    index = plan.index.reshape(-1, *plan.index.shape[-2:])
    assert ((index[valid] >= 0) & (index[valid] < T)).all()
    assert not valid[:, ~active].any()


@pytest.mark.parametrize("policy,swap", CASES, ids=[f"{p}-{','.join(f'{k}={v}' for k, v in s.items())}" for p, s in CASES])
@settings(max_examples=3, deadline=None)
@given(family=st.sampled_from(["llada", "dream"]), batch=prompts, block=st.sampled_from([4, 8]),
       n_blocks=st.integers(1, 3), threshold=st.floats(0.05, 0.95), seed=st.integers(0, 3), stop_at_eos=st.booleans())
def test_engine_invariants(policy, swap, family, batch, block, n_blocks, threshold, seed, stop_at_eos):
    model = _model(family)
    gen = block * n_blocks
    records = []
    out = polestar.generate(model, batch, policy=policy, gen_length=gen, block_length=block, seed=seed,
                            threshold=threshold, stop_at_eos=stop_at_eos, on_step=records.append, **swap)
    mask_id = model.spec.mask_id
    for record in records:
        check_step(record, mask_id)
    # each sequence terminates within gen_length forward passes, and every generated position is decided
    assert out.stats.nfe == len(records) <= gen
    for i, seq in enumerate(out.stats.sequences):
        assert seq.nfe == sum(int(r.active[i]) for r in records) <= gen
        assert seq.error is None
    # finished rows had everything after their EOS filled, the others decoded every block
    assert (out.generations != mask_id).all()
    assert torch.equal(out.tokens, records[-1].tokens_after)
