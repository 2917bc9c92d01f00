"""The factor rule's two variants (Fast-dLLM's paper and its released code) and KLASS's commit, each against a
plain-Python reference of the rule and on hand-made cases where the variants part."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polestar.config import GenerationConfig
from polestar.policies.commit_adaptive import KLASSCommit, KLASSState
from polestar.policies.commit_basic import FactorCommit
from polestar.state import DecodeState, Prediction, StepClock, StepPhase


def _state(bl: int) -> DecodeState:
    x = torch.full((1, 8 + 4 * bl), 39)
    return DecodeState(x=x, active=torch.ones(1, dtype=torch.bool), config=GenerationConfig(4 * bl, bl),
                       mask_id=39, eos_id=38, prompt_len=8, logit_shift=0, n_layers=2,
                       generator=torch.Generator().manual_seed(0), clock=StepClock.at(8, "cpu"))


def _factor(conf, masked, factor=1.0, rule="paper") -> list[bool]:
    conf = torch.tensor([conf], dtype=torch.float64)
    masked = torch.tensor([masked])
    pred = Prediction(torch.zeros_like(masked, dtype=torch.long), conf, torch.zeros(*masked.shape, 4))
    chosen = FactorCommit(FactorCommit.Config(factor=factor, rule=rule)).select(pred, masked, _state(masked.shape[1]))
    return chosen.commit[0].tolist()


def _reference_count(sorted_conf: list[float], factor: float, rule: str) -> int:
    """How many of the sorted confidences a step commits, written as the rules read in prose."""
    n_masked = len(sorted_conf)
    if rule == "paper":  # longest prefix with (n + 1)(1 - c_n) < factor, the first always
        n = 1
        while n < n_masked and (n + 2) * (1 - sorted_conf[n]) < factor:
            n += 1
        return n
    # the released code: walk the ranks against 1 - factor / (n + 1) (rank 1 exempt); the first failure stops
    # the walk; stopping at the first or the last rank (or never failing) commits one more
    bounds = [-1.0] + [1 - factor / (n + 1) for n in range(2, n_masked + 1)]
    stop = n_masked - 1
    for i, (c, b) in enumerate(zip(sorted_conf, bounds)):
        if c < b:
            stop = i
            break
    return stop + 1 if stop in (0, n_masked - 1) else stop


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=10), st.lists(st.booleans(), min_size=10, max_size=10),
       st.floats(0.05, 5.0), st.sampled_from(["code", "paper"]))
def test_factor_rule_equals_the_prose_reference(conf, masked, factor, rule):
    masked = masked[: len(conf)]
    if not any(masked):
        return
    commit = _factor(conf, masked, factor, rule)
    ranked = sorted(((c, i) for i, (c, m) in enumerate(zip(conf, masked)) if m), key=lambda t: -t[0])
    count = _reference_count([c for c, _ in ranked], factor, rule)
    assert sum(commit) == count
    assert not any(c and not m for c, m in zip(commit, masked))  # masked positions only
    chosen = [conf[i] for i, c in enumerate(commit) if c]
    rest = [c for (c, i) in ranked if not commit[i]]
    assert not rest or min(chosen) >= max(rest)  # the most confident ones


def test_the_variants_part_where_the_last_masked_token_fails():
    # two masked left, the second below 1 - 1/3: the code commits it anyway, the paper's bound does not
    assert _factor([0.99, 0.4], [True, True], rule="code") == [True, True]
    assert _factor([0.99, 0.4], [True, True], rule="paper") == [True, False]
    # the failure before the last rank: both stop there
    for rule in ("code", "paper"):
        assert _factor([0.99, 0.9, 0.7, 0.2], [True] * 4, rule=rule) == [True, True, False, False]
        assert _factor([0.99, 0.98, 0.97], [True] * 3, rule=rule) == [True] * 3  # every rank passes: all


def test_the_paper_bound_is_strict_and_the_code_bound_is_not():
    # factor 1.5, rank 2: code needs c >= 0.5, the paper 3 (1 - c) < 1.5, i.e. c > 0.5
    assert _factor([0.9, 0.5, 0.1, 0.1], [True] * 4, factor=1.5, rule="code") == [True, True, False, False]
    assert _factor([0.9, 0.5, 0.1, 0.1], [True] * 4, factor=1.5, rule="paper") == [True, False, False, False]


def test_factor_rule_option():
    assert FactorCommit.Config().rule == "paper"
    with pytest.raises(ValueError, match="rule"):
        FactorCommit.Config(rule="fast-dllm")
    assert FactorCommit(FactorCommit.Config(rule="code")).floor().exempt == 2
    assert FactorCommit(FactorCommit.Config(rule="paper")).floor().exempt == 1
    assert math.isclose(FactorCommit(FactorCommit.Config(factor=1.5)).floor().probability, 0.5)


def _klass_step(conf, prev_logp_shift, streak, masked=None, commit_phase=True, **cfg):
    """One KLASS select over ``len(conf)`` block columns of a 4-token vocabulary: each column's distribution puts
    ``conf`` on token 0; the previous step's distribution equals it except where ``prev_logp_shift`` is nonzero
    (then token 0's log-probability was that much lower, a KL well above 0.01)."""
    bl = len(conf)
    probs = torch.tensor([[[c, (1 - c) / 3, (1 - c) / 3, (1 - c) / 3] for c in conf]], dtype=torch.float64)
    logp = probs.log()
    prev = logp.clone().float()
    prev[0, :, 0] -= torch.tensor(prev_logp_shift, dtype=torch.float32)
    local = KLASSState(prev, torch.tensor([streak]))
    state = _state(bl)
    state.phase = StepPhase(commit=commit_phase)
    pred = Prediction(torch.zeros(1, bl, dtype=torch.long), torch.tensor([conf], dtype=torch.float64),
                      logp.float(), logp)
    masked = torch.ones(1, bl, dtype=torch.bool) if masked is None else torch.tensor([masked])
    return KLASSCommit(KLASSCommit.Config(**cfg)).select(pred, masked, state, local).commit[0].tolist(), local


def test_klass_commits_the_stable_set_alone():
    # column 0 is the most confident but moved; columns 1 and 2 are stable for two steps, 3 stable but unconfident
    commit, local = _klass_step([0.95, 0.8, 0.6, 0.3], [2.0, 0.0, 0.0, 0.0], [5, 1, 1, 1])
    assert commit == [False, True, True, False]  # the top-1 is not added to a non-empty stable set
    assert local.streak.tolist() == [[0, 2, 2, 2]]


def test_klass_falls_back_to_the_most_confident_when_nothing_is_stable():
    commit, _ = _klass_step([0.95, 0.8, 0.6], [2.0, 0.0, 0.0], [5, 0, 0])  # streaks of 1 < stable_steps 2
    assert commit == [True, False, False]
    commit, _ = _klass_step([0.95, 0.8, 0.6], [0.0, 0.0, 0.0], [5, 5, 5], commit_phase=False)  # block start
    assert commit == [True, False, False]


def test_klass_confidence_must_exceed_the_floor():
    commit, _ = _klass_step([0.9, 0.5], [2.0, 0.0], [0, 1], min_confidence=0.5)
    assert commit == [True, False]  # 0.5 is not above 0.5: nothing stable, the most confident alone
    commit, _ = _klass_step([0.9, 0.5], [2.0, 0.0], [0, 1], min_confidence=0.49)
    assert commit == [False, True]


def test_klass_ignores_committed_columns():
    commit, _ = _klass_step([0.95, 0.8, 0.7], [0.0, 0.0, 0.0], [1, 1, 1], masked=[False, True, True])
    assert commit == [False, True, True]
