"""Commit rules decide on the distribution the engine draws tokens from (the mask token excluded), and no rule
commits a position below its stated confidence floor (:meth:`CommitRule.floor`) more often than it says."""

import math

import pytest
import torch

import polestar
from polestar import registry
from polestar.bench.harness import load_problems
from polestar.config import GenerationConfig
from polestar.policies.commit_adaptive import token_entropy
from polestar.policy import get_policy, policy_names
from polestar.state import DecodeState, StepClock, StepPhase, StepPosition, propose, token_log_probs
from polestar.step import forced_commits, predict
from polestar.tasks import get_task

V, MASK, BL = 40, 39, 16
RULES = registry.names("commit")


def _policy_for(rule: str) -> tuple[str, dict]:
    """A registered policy whose commit stage is ``rule``, else ``fast-dllm`` with its commit swapped."""
    for name in policy_names():
        if get_policy(name).stages["commit"] == rule:
            return name, {}
    return "fast-dllm", {"commit": rule}


def _state(batch: int) -> DecodeState:
    x = torch.full((batch, 8 + BL), MASK)
    return DecodeState(x=x, active=torch.ones(batch, dtype=torch.bool), config=GenerationConfig(BL, BL),
                       mask_id=MASK, eos_id=38, prompt_len=8, logit_shift=0, n_layers=2,
                       generator=torch.Generator().manual_seed(0), clock=StepClock.at(8, "cpu"), n_heads=2,
                       vocab_size=V)


def test_token_distribution_excludes_the_mask_token():
    logits = torch.randn(3, 5, V, dtype=torch.float64)
    logits[..., MASK] = 8.0  # most of the full softmax's mass sits on the mask token
    logp = token_log_probs(logits, MASK)
    assert torch.isneginf(logp[..., MASK]).all()
    assert torch.allclose(logp.exp().sum(-1), torch.ones(3, 5, dtype=torch.float64))
    reference = torch.log_softmax(logits[..., :MASK], -1)  # the mask token is the last id here
    assert torch.allclose(logp[..., :MASK], reference)
    tokens, conf = propose(logits, MASK)
    assert (tokens != MASK).all()
    assert torch.allclose(conf, reference.exp().max(-1).values)


def test_entropy_ignores_mass_on_the_mask_token():
    """Where the full softmax puts 99.99% on the mask token and spreads the rest evenly, the full entropy is near
    zero; the distribution tokens are drawn from is uniform over the other 39 ids."""
    logits = torch.zeros(1, 1, V, dtype=torch.float64)
    logits[..., MASK] = 20.0
    full = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    assert float(full) < 0.01
    assert math.isclose(float(token_entropy(logits, MASK)), math.log(V - 1), rel_tol=1e-9)


def _random_prediction(gen: torch.Generator, batch: int):
    """Block logits mixing sharp and flat positions, some with most of their mass on the mask token."""
    row = torch.empty(batch, 1, 1).uniform_(-2.0, 3.5, generator=gen)  # flat rows to sharp rows
    sharp = torch.exp(row + torch.empty(batch, BL, 1).uniform_(-1.0, 1.0, generator=gen))
    logits = torch.randn(batch, BL, V, generator=gen, dtype=torch.float64) * sharp
    on_mask = torch.rand(batch, BL, generator=gen) < 0.3
    logits[..., MASK] = torch.where(on_mask, logits.max(-1).values + 6.0, logits[..., MASK])
    masked = torch.rand(batch, BL, generator=gen) < 0.8
    masked[:, 0] = True
    return predict(logits, masked, 0.0, None, MASK), masked


@pytest.mark.parametrize("rule_name", RULES)
def test_no_commit_below_the_stated_floor(rule_name):
    """Every registered commit rule, fed random blocks over several steps (attention probes for rules that read
    them): per row and step, at most ``floor().exempt`` commits (the engine's forced one included) have a
    confidence below ``floor().probability``; a rule with no floor says so in its docstring."""
    policy, swap = _policy_for(rule_name)
    rule = polestar.assemble(policy, swap).commit
    floor = rule.floor()
    if floor.probability == 0.0:
        assert "no confidence floor" in " ".join(type(rule).__doc__.split())
        return
    gen = torch.Generator().manual_seed(7)
    batch = 6
    state = _state(batch)
    state.num_transfer = torch.full((batch, 8), 2)
    local = rule.init_state(state)
    rule.begin_block(local, state)
    below_seen = 0
    for step in range(8):
        state.clock.step.fill_(step)
        position = StepPosition(0, 8, 8 + BL, step, step)
        state.phase = StepPhase(commit=rule.phase(position, state, local))
        pred, masked = _random_prediction(gen, batch)
        probe = torch.softmax(torch.randn(batch, 2, BL, state.length + 1, generator=gen), -1)
        rule.observe_probe(state, probe, local)
        transfer = rule.select(pred, masked, state, local).commit & masked
        block = transfer | forced_commits(transfer, masked, pred.confidence)
        below = (block & (pred.confidence < floor.probability)).sum(dim=1)
        assert (below <= floor.exempt).all(), (step, below.tolist(), floor)
        below_seen += int(below.sum())
    assert below_seen > 0  # the random blocks do reach below the floor: the bound is exercised


@pytest.fixture(scope="module")
def arith_prompts():
    task = get_task("arith")
    return [task.format_prompt(p.input) for p in load_problems("arith", 12)]


@pytest.mark.parametrize("rule_name", RULES)
def test_decoding_respects_the_floor(shipped_models, arith_prompts, rule_name):
    """The same bound through the engine, on the shipped tiny-llada (block and suffix commits together)."""
    policy, swap = _policy_for(rule_name)
    pipeline = polestar.assemble(policy, swap)
    floor = pipeline.commit.floor()
    worst = []

    def on_step(rec):
        below = rec.origins.block & (rec.confidence < floor.probability)
        count = below.sum(dim=1)
        suffix = rec.origins.suffix
        if suffix is not None:
            count = count + (suffix.commit & (suffix.confidence < floor.probability)).sum(dim=1)
        worst.append(int(count.max()))

    polestar.generate(shipped_models["tiny-llada"], arith_prompts, policy=pipeline, gen_length=32, block_length=16,
                      on_step=on_step)
    assert worst and max(worst) <= (floor.exempt if floor.probability > 0 else BL)
