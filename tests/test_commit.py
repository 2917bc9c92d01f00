"""Commit rules: invariants of the loop and of each rule, and equivalences between rules."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import polestar
from polestar.config import GenerationConfig
from polestar.policies.commit_adaptive import PolestarCommit
from polestar.policies.commit_basic import ThresholdCommit
from polestar.state import DecodeState, Prediction
from tests.conftest import make_model

PROMPTS = [[5, 7, 1, 3, 9, 2, 4], [3, 4, 6]]
ALL = ["baseline", "parallel", "fast-dllm-prefix", "fast-dllm", "polestar-cache", "elastic-cache", "dllm-cache",
       "polestar", "polestar-commit", "eb", "klass"]


def _state(batch=2, bl=8, shift=0, length=40):
    x = torch.full((batch, length), 39)
    return DecodeState(x=x, active=torch.ones(batch, dtype=torch.bool), config=GenerationConfig(32, 8),
                       mask_id=39, eos_id=38, prompt_len=8, logit_shift=shift, n_layers=2,
                       generator=torch.Generator().manual_seed(0), block_start=8, block_end=8 + bl)


@pytest.mark.parametrize("policy", ALL)
def test_committed_tokens_never_change_and_each_step_commits(family, policy, monkeypatch):
    m = make_model(family, seed=7)
    from polestar import engine

    orig_decode_x = []
    pipeline = polestar.assemble(policy, {"threshold?": 0.5})
    commit = pipeline.commit
    real_select = commit.select

    def recording_select(pred, masked, state):
        orig_decode_x.append((state.x.clone(), masked.clone(), state.block_start, state.block_end))
        return real_select(pred, masked, state)

    monkeypatch.setattr(commit, "select", recording_select)
    cfg = GenerationConfig(24, 8, stop_at_eos=False)
    ids, mask = polestar.encode_prompts(m, PROMPTS)
    tokens, stats = engine.decode(m, ids, mask, pipeline, cfg)
    assert (tokens[:, ids.shape[1]:] != m.spec.mask_id).all()
    for (before, masked, s, e), (after, _, _, _) in zip(orig_decode_x, orig_decode_x[1:] + [(tokens, None, 0, 0)]):
        if after.shape != before.shape:
            continue
        committed = before != m.spec.mask_id
        assert (after[committed] == before[committed]).all()
        rows_active = masked.any(dim=1)
        newly = ((before[:, s:e] == m.spec.mask_id) & (after[:, s:e] != m.spec.mask_id)).sum(1)
        assert (newly[rows_active] >= 1).all()
    assert stats.nfe <= 24


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=6, max_size=6), st.lists(st.booleans(), min_size=6, max_size=6),
       st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_higher_threshold_commits_a_subset(conf, masked, t1, t2):
    lo, hi = sorted((t1, t2))
    masked = torch.tensor([masked])
    if not masked.any():
        return
    pred = Prediction(torch.zeros(1, 6, dtype=torch.long), torch.tensor([conf], dtype=torch.float64), torch.zeros(1, 6, 4))
    state = _state(batch=1, bl=6)
    for rule in (ThresholdCommit, PolestarCommit):
        a = rule(rule.Config(threshold=lo)).select(pred, masked, state) if rule is ThresholdCommit else \
            rule(rule.Config(threshold=lo, min_confidence=0.0)).select(pred, masked, state)
        b = rule(rule.Config(threshold=hi)).select(pred, masked, state) if rule is ThresholdCommit else \
            rule(rule.Config(threshold=hi, min_confidence=0.0)).select(pred, masked, state)
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
    conf = torch.tensor([[0.95, 0.85, 0.8, 0.5]], dtype=torch.float64)
    pred = Prediction(torch.zeros(1, 4, dtype=torch.long), conf, torch.zeros(1, 4, 4))
    masked = torch.ones(1, 4, dtype=torch.bool)
    state.extras["polestar_commit"] = {"delta": torch.tensor([[0.0, 0.03, 0.01, 5.0]])}
    # 0.85: gate 10*0.05^2=0.025 <= 0.03 -> early; 0.8: gate 0.1 > 0.01 -> no; 0.5: below the confidence band
    assert rule.select(pred, masked, state).tolist() == [[True, True, False, False]]
    state.extras["polestar_commit"] = {"delta": torch.tensor([[0.0, 3.0, 0.01, 5.0]])}
    assert rule.select(pred, masked, state).tolist() == [[True, False, False, False]]  # above the delta cap


@pytest.mark.parametrize("shift", [0, 1])
def test_suffix_commit_only_at_or_above_threshold_and_after_the_block(shift):
    rule = PolestarCommit(PolestarCommit.Config(threshold=0.9))
    state = _state(batch=1, bl=8, shift=shift)
    V = 40
    positions = torch.tensor([4, 5, 16, 17, 18, 19])  # two prefix columns, four after the block [8, 16)
    logits = torch.zeros(1, 6, V)
    logits[0, :, 7] = torch.tensor([20.0, 20.0, 20.0, 1.0, 20.0, 20.0])  # column 17 is unconfident
    valid = torch.tensor([[True, True, True, True, True, False]])
    state.extras["packet"] = {"positions": positions, "valid": valid, "logits": logits}
    positions_out, tokens, commit = rule.suffix(state)
    targets = positions_out[commit].tolist()
    assert targets == [p + shift for p in (16, 18)]
    assert (tokens[commit] == 7).all()


def test_suffix_commit_fills_future_blocks_in_decoding(family):
    m = make_model(family, seed=9)
    with torch.no_grad():
        head = m.model.transformer["ff_out"] if family == "llada" else m.lm_head
        head.bias = torch.nn.Parameter(torch.zeros(40))
        head.bias[7] = 3.0
    kw = dict(gen_length=32, block_length=8, stop_at_eos=False, threshold=0.2)
    out = polestar.generate(m, PROMPTS[:1], policy="polestar", tau_upd=0, topk=8, topk_last=8, **kw)
    assert (out.generations != m.spec.mask_id).all()


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


@pytest.mark.parametrize("policy", ["polestar", "polestar-cache", "elastic-cache", "dllm-cache", "eb", "klass"])
def test_batch_equals_single(family, policy):
    m = make_model(family, seed=10)
    kw = dict(gen_length=16, block_length=8, threshold=0.3)
    batch = polestar.generate(m, PROMPTS, policy=policy, **kw)
    for i, p in enumerate(PROMPTS):
        single = polestar.generate(m, [p], policy=policy, **kw)
        assert batch.generations[i].tolist() == single.generations[0].tolist()
