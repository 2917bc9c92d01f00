"""Revokable commits as an engine capability (``CommitSelection.revoke``): what the engine does with a commit
rule's revocations, checked with rules of this file that revoke far more than any real rule would.

* a revoked position holds the mask token after its step, and is committed again later;
* ``tokens`` / TPF count the final tokens only; the revocations are counted beside them (``revoked``), and every
  step's commits minus its revocations add up to the final tokens;
* a block never ends while a position is masked, and the guard (:data:`polestar.state.REVOKE_STEPS_PER_POSITION`)
  ends a rule that revokes every step: the decode finishes with no mask token left;
* batch invariance (tokens and per-sequence counters) and the trace's record of revoked columns;
* revocations of masked positions, of positions committed in the same step and of prompt columns are ignored;
* a rule that never revokes (every built-in but WINO) decodes as before: ``revoke=None`` and an all-False
  ``revoke`` give the same tokens and counters.
"""

from __future__ import annotations

import attrs
import pytest
import torch

import polestar
from polestar.config import GenerationConfig
from polestar.policies.commit_basic import threshold_transfer
from polestar.stages import CommitRule
from polestar.state import REVOKE_STEPS_PER_POSITION, CommitSelection, DecodeState, StepClock, revocations
from polestar.tracing.record import TraceRecorder
from tests.conftest import make_model

PROMPTS = [[5, 7, 1, 3, 9, 2, 4], [3, 4, 6]]
KW = dict(gen_length=24, block_length=8, stop_at_eos=False)


def _register_rules():
    @polestar.register("commit", "revoke-all")
    class RevokeAll(CommitRule):
        """Top-1 commit, and every committed token of the block taken back at every step (a worst case: without
        the guard the block would never end). Shapes ``[B, bl]``."""

        def select(self, pred, masked, state, local=None):
            held = state.x.gather(1, state.region) != state.mask_id
            return CommitSelection(threshold_transfer(pred.confidence, masked, 2.0), revoke=held)

    @polestar.register("commit", "revoke-odd")
    class RevokeOdd(CommitRule):
        """Threshold commit; at odd block steps the committed tokens whose proposal changed are taken back."""

        @attrs.frozen
        class Config:
            threshold: float = 0.2
            revoke: bool = True

        def select(self, pred, masked, state, local=None):
            commit = threshold_transfer(pred.confidence, masked, self.config.threshold)
            held = state.x.gather(1, state.region)
            changed = (held != state.mask_id) & (pred.tokens != held) & (state.clock.step % 2 == 1)
            return CommitSelection(commit, revoke=changed & self.config.revoke)


@pytest.fixture
def rules(isolated_registry):
    _register_rules()


def _decode(model, prompts, commit, on_step=None, **over):
    return polestar.generate(model, prompts, policy="parallel", commit=commit, on_step=on_step, **KW, **over)


@pytest.mark.parametrize("commit", ["revoke-all", "revoke-odd"])
def test_revoked_positions_are_masked_after_their_step_and_counted_beside_final_tokens(family, rules, commit):
    m = make_model(family, seed=4)
    mask_id = m.spec.mask_id
    records = []
    out = _decode(m, PROMPTS, commit, on_step=records.append)
    gen = out.tokens[:, -KW["gen_length"]:]
    assert not (gen == mask_id).any()  # the decode finished
    revoked = torch.zeros(len(PROMPTS), dtype=torch.long)
    committed = torch.zeros(len(PROMPTS), dtype=torch.long)
    for r in records:
        rev = r.origins.revoked
        cols = r.region
        after = r.tokens_after.gather(1, cols)
        before = r.tokens_before.gather(1, cols)
        assert (after[rev] == mask_id).all() and (before[rev] != mask_id).all()
        revoked += rev.sum(dim=1)
        committed += r.committed.sum(dim=1)
    assert revoked.sum() > 0
    assert [s.revoked for s in out.stats.sequences] == revoked.tolist() and out.stats.revoked == revoked.sum()
    assert (committed - revoked).tolist() == [KW["gen_length"]] * len(PROMPTS)
    assert [s.tokens for s in out.stats.sequences] == [KW["gen_length"]] * len(PROMPTS)
    assert out.stats.tpf == out.stats.tokens / sum(s.nfe for s in out.stats.sequences)


def test_the_guard_ends_a_rule_that_revokes_every_step(rules):
    m = make_model("llada", seed=4)
    bl = KW["block_length"]
    steps = {}
    out = _decode(m, [PROMPTS[0]], "revoke-all",
                  on_step=lambda r: steps.__setitem__(r.block_index, r.block_step + 1))
    guard = REVOKE_STEPS_PER_POSITION * bl
    # revoke-all keeps one token per step until the guard, then the top-1 commit fills the rest of the block
    assert all(n == guard + bl - 1 for n in steps.values()), steps
    assert out.stats.nfe == sum(steps.values())
    assert not (out.tokens == m.spec.mask_id).any()


@pytest.mark.parametrize("commit", ["revoke-all", "revoke-odd"])
def test_batch_invariance(family, rules, commit):
    m = make_model(family, seed=5)
    batch = _decode(m, PROMPTS, commit)
    for i, prompt in enumerate(PROMPTS):
        alone = _decode(m, [prompt], commit)
        assert alone.tokens[0, -KW["gen_length"]:].tolist() == batch.tokens[i, -KW["gen_length"]:].tolist()
        assert alone.stats.sequences[0] == batch.stats.sequences[i]


def test_an_all_false_revoke_decodes_like_no_revoke(family, rules):
    m = make_model(family, seed=6)
    a = _decode(m, PROMPTS, "revoke-odd", revoke=False)
    b = _decode(m, PROMPTS, "threshold", threshold=0.2)
    assert a.tokens.tolist() == b.tokens.tolist()
    assert a.stats.sequences == b.stats.sequences and a.stats.revoked == 0


def test_only_committed_region_tokens_not_committed_this_step_are_revoked():
    x = torch.full((1, 12), 9)
    x[0, :4] = torch.tensor([1, 2, 3, 4])  # prompt
    x[0, 4:8] = torch.tensor([5, 9, 6, 7])  # block: column 5 masked
    state = DecodeState(x=x, active=torch.ones(1, dtype=torch.bool), config=GenerationConfig(8, 4), mask_id=9,
                        eos_id=8, prompt_len=4, logit_shift=0, n_layers=1, generator=torch.Generator(),
                        clock=StepClock.at(4, "cpu", step=1))
    state.region.copy_(torch.arange(4, 8)[None])
    masked = state.x.gather(1, state.region) == 9
    transfer = torch.tensor([[False, True, False, False]])
    want = torch.tensor([[True, True, True, False]])
    assert revocations(want, masked, transfer, state).tolist() == [[True, False, True, False]]
    state.active.fill_(False)
    assert not revocations(want, masked, transfer, state).any()
    state.active.fill_(True)
    state.clock.step.fill_(REVOKE_STEPS_PER_POSITION * 4)  # past the guard: ignored
    assert not revocations(want, masked, transfer, state).any()
    state.clock.step.fill_(1)
    state.region.copy_(torch.arange(0, 4)[None])  # prompt columns are never revoked
    assert not revocations(want, state.x.gather(1, state.region) == 9, transfer, state).any()
    assert revocations(None, masked, transfer, state) is None


def test_the_trace_records_revoked_columns(rules):
    m = make_model("llada", seed=4)
    recorder = TraceRecorder(None, m.spec.n_layers)
    records = []

    def both(r):
        records.append(r)
        recorder(r)

    _decode(m, [PROMPTS[0]], "revoke-odd", on_step=both)
    got = [s.revoked for s in recorder.steps]
    want = [tuple(sorted(r.region[0][r.origins.revoked[0]].tolist())) for r in records]
    assert got == want and any(got)


def test_wino_runs_the_engine_path(family):
    """The built-in revoking rule: the decode finishes and its counters add up."""
    m = make_model(family, seed=4)
    out = polestar.generate(m, PROMPTS, policy="wino", wide_in_thres=0.0, narrow_out_thres=0.99, **KW)
    assert not (out.tokens[:, -KW["gen_length"]:] == m.spec.mask_id).any()
    assert out.stats.revoked > 0
