"""Commit rules: invariants of the loop and of each rule, and equivalences between rules."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import polestar
from polestar.bench.harness import load_problems
from polestar.config import GenerationConfig
from polestar.policies.commit_adaptive import PolestarCommit, PolestarCommitState
from polestar.policies.commit_basic import ThresholdCommit
from polestar.state import DecodeState, Prediction, StepClock, StepPhase, UpdatePacket
from polestar.tasks import get_task
from tests.conftest import make_model

PROMPTS = [[5, 7, 1, 3, 9, 2, 4], [3, 4, 6]]


def _state(batch=2, bl=8, shift=0, length=40):
    x = torch.full((batch, length), 39)
    return DecodeState(x=x, active=torch.ones(batch, dtype=torch.bool), config=GenerationConfig(4 * bl, bl),
                       mask_id=39, eos_id=38, prompt_len=8, logit_shift=shift, n_layers=2,
                       generator=torch.Generator().manual_seed(0), clock=StepClock.at(8, "cpu"))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=6, max_size=6), st.lists(st.booleans(), min_size=6, max_size=6),
       st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_higher_threshold_commits_a_subset(conf, masked, t1, t2):
    lo, hi = sorted((t1, t2))
    masked = torch.tensor([masked])
    if not masked.any():
        return
    pred = Prediction(torch.zeros(1, 6, dtype=torch.long), torch.tensor([conf], dtype=torch.float64),
                      torch.zeros(1, 6, 4))
    state = _state(batch=1, bl=6)
    for rule in (ThresholdCommit, PolestarCommit):
        extra = {} if rule is ThresholdCommit else {"min_confidence": 0.0}
        a = rule(rule.Config(threshold=lo, **extra)).select(pred, masked, state, PolestarCommitState()).commit
        b = rule(rule.Config(threshold=hi, **extra)).select(pred, masked, state, PolestarCommitState()).commit
        assert (a | ~b).all()


def test_drift_delta_rule_with_infinite_alpha_equals_threshold(family):
    m = make_model(family, seed=8)
    kw = dict(gen_length=32, block_length=8, threshold=0.3, stop_at_eos=False)
    a = polestar.generate(m, PROMPTS, policy="polestar-commit", alpha=float("inf"), **kw)
    b = polestar.generate(m, PROMPTS, policy="fast-dllm", **kw)
    assert a.tokens.tolist() == b.tokens.tolist()
    c = polestar.generate(m, PROMPTS, policy="polestar", alpha=float("inf"), suffix_commit=False, **kw)
    d = polestar.generate(m, PROMPTS, policy="polestar-cache", **kw)
    assert c.tokens.tolist() == d.tokens.tolist()


def test_early_commit_needs_a_sharp_delta():
    rule = PolestarCommit(PolestarCommit.Config())
    state = _state(batch=1, bl=4)
    state.phase = StepPhase(commit=True)  # past the block's first step: a drift delta exists
    conf = torch.tensor([[0.95, 0.85, 0.8, 0.5]], dtype=torch.float64)
    pred = Prediction(torch.zeros(1, 4, dtype=torch.long), conf, torch.zeros(1, 4, 4))
    masked = torch.ones(1, 4, dtype=torch.bool)
    local = PolestarCommitState(delta=torch.tensor([[0.0, 0.03, 0.01, 5.0]]))
    # 0.85: gate 10*0.05^2=0.025 <= 0.03 -> early; 0.8: gate 0.1 > 0.01 -> no; 0.5: below the confidence band
    chosen = rule.select(pred, masked, state, local)
    assert chosen.commit.tolist() == [[True, True, False, False]]
    assert chosen.early.tolist() == [[False, True, False, False]]  # the typed origin of the early commit
    assert chosen.gate_candidates.tolist() == [[False, True, True, False]]
    local = PolestarCommitState(delta=torch.tensor([[0.0, 3.0, 0.01, 5.0]]))
    assert rule.select(pred, masked, state, local).commit.tolist() == [[True, False, False, False]]  # above the cap


@pytest.mark.parametrize("shift", [0, 1])
def test_suffix_commit_only_at_or_above_threshold_and_after_the_block(shift):
    rule = PolestarCommit(PolestarCommit.Config(threshold=0.9))
    state = _state(batch=1, bl=8, shift=shift)
    V = 40
    positions = torch.tensor([[4, 5, 16, 17, 18, 19]])  # two prefix columns, four after the block [8, 16)
    logits = torch.zeros(1, 6, V)
    logits[0, :, 7] = torch.tensor([20.0, 20.0, 20.0, 1.0, 20.0, 20.0])  # column 17 is unconfident
    valid = torch.tensor([[True, True, True, True, True, False]])
    packet = UpdatePacket(positions, valid, logits)
    positions_out, tokens, conf, commit = rule.suffix(state, rule.init_state(state), packet)
    targets = positions_out[commit].tolist()
    assert (conf[commit] >= 0.9).all() and not (conf[~commit & valid] >= 0.9)[2:].any()
    assert targets == [p + shift for p in (16, 18)]
    assert (tokens[commit] == 7).all()


@pytest.fixture(scope="module", params=["tiny-llada", "tiny-dream"])
def shipped(request):
    return polestar.load(request.param)


def _suffix_commits(m, prompts, policy: str, **kw) -> list[float]:
    """Decode with ``policy``; the confidences of its suffix-block commits, checked to lie after the block and to
    be written into the tokens."""
    records = []
    polestar.generate(m, prompts, policy=policy, on_step=records.append, gen_length=64, block_length=16, **kw)
    confs = []
    for r in records:
        suffix = r.origins.suffix
        if suffix is not None:
            assert (suffix.positions[suffix.commit] >= r.block_end).all()  # only after the block
            assert r.committed.gather(1, suffix.positions)[suffix.commit].all()  # and written
            confs += suffix.confidence[suffix.commit].tolist()
    return confs


def test_suffix_commits_happen_in_decoding_and_are_at_or_above_threshold(shipped):
    tau = 0.9
    task = get_task("arith")
    prompts = [task.format_prompt(p.input) for p in load_problems("arith", 4)]
    confs = _suffix_commits(shipped, prompts, "polestar", threshold=tau)
    assert len(confs) > 0
    assert min(confs) >= tau
    assert _suffix_commits(shipped, prompts, "polestar", threshold=tau, suffix_commit=False) == []


def test_entropy_bound_extremes(model):
    kw = dict(gen_length=16, block_length=8, stop_at_eos=False)
    one = polestar.generate(model, PROMPTS, policy="eb", gamma=0.0, **kw)
    assert one.stats.nfe == 16
    everything = polestar.generate(model, PROMPTS, policy="eb", gamma=1e9, **kw)
    assert everything.stats.nfe == 2


def test_klass_with_zero_bound_commits_one_per_step(model):
    out = polestar.generate(model, PROMPTS, policy="klass", kl_bound=0.0, gen_length=16, block_length=8,
                            stop_at_eos=False)
    assert out.stats.nfe == 16


@pytest.mark.parametrize("policy", polestar.policy_names())
def test_batch_equals_single(family, policy):
    m = make_model(family, seed=10)
    kw = dict(gen_length=16, block_length=8, threshold=0.3)
    batch = polestar.generate(m, PROMPTS, policy=policy, **kw)
    for i, p in enumerate(PROMPTS):
        single = polestar.generate(m, [p], policy=policy, **kw)
        assert batch.generations[i].tolist() == single.generations[0].tolist()
