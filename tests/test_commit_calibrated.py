"""The calibrated commit rules (certainty prior, PC-Sampler) against references written from their formulas, the
stage laws, batch invariance, compositions with the caches, the token-frequency tables and the bad-input errors."""

import json
import math
import re

import pytest
import torch

import polestar
from polestar.bench.harness import load_problems
from polestar.config import GenerationConfig
from polestar.models.loading import resolve_checkpoint, shipped_checkpoints
from polestar.policies import commit_calibrated as cc
from polestar.policies.certainty import certainty_density, density_kernel
from polestar.policies.commit_calibrated import CertaintyPriorCommit, FrequencyTable, PCSamplerCommit
from polestar.policy import composition_refusal
from polestar.registry import names
from polestar.state import DecodeState, Prediction, StepClock
from polestar.tasks import get_task
from polestar.testing import check_batch_invariance, check_decode_invariants, check_stage
from tests.conftest import TINY, make_model

PROMPTS = [[5, 7, 1, 3, 9, 2, 4], [3, 4, 6]]


# ----------------------------------------------------------------------------------------------- references


def reference_density(decoded: torch.Tensor, sigma: float) -> torch.Tensor:
    """d2Cache's certainty density, written out position by position: ``decoded [B, G]`` bool → ``[B, G]``. The
    generation sits between G positions counted as decoded (the prompt side) and G positions counted as decoded
    only when the last generated one is; each position sums the Gaussian weights exp(-d²/2σ²) of the decoded
    canvas positions and divides by the kernel's sum over the distances -3G .. 3G-1."""
    B, G = decoded.shape
    norm = sum(math.exp(-d * d / (2 * sigma * sigma)) for d in range(-3 * G, 3 * G))
    out = torch.zeros(B, G, dtype=torch.float64)
    for b in range(B):
        canvas = [1.0] * G + decoded[b].double().tolist() + [float(decoded[b, -1])] * G
        for i in range(G):
            out[b, i] = sum(w * math.exp(-((i + G - c) ** 2) / (2 * sigma * sigma))
                            for c, w in enumerate(canvas) if w) / norm
    return out


def reference_topk(scores: torch.Tensor, masked: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The ``k[b]`` best-scored masked positions of each row (ties: leftmost) → bool ``[B, R]``."""
    out = torch.zeros_like(masked)
    for b in range(scores.shape[0]):
        cand = sorted((-float(scores[b, j]), j) for j in range(scores.shape[1]) if masked[b, j])
        for _, j in cand[: int(k[b])]:
            out[b, j] = True
    return out


def reference_threshold(scores: torch.Tensor, masked: torch.Tensor, threshold: float) -> torch.Tensor:
    out = masked & (scores >= threshold)
    for b in range(scores.shape[0]):
        if masked[b].any():
            best = max((float(scores[b, j]), -j) for j in range(scores.shape[1]) if masked[b, j])
            out[b, -best[1]] = True
    return out


def reference_pc_scores(conf, tokens, freq, alpha, lam, offset, debias=True):
    """PC-Sampler's score of the paper: min(-p log(f(x) + eps), alpha) exp(-lambda j)."""
    s = (-conf * torch.log(freq[tokens] + cc.FREQUENCY_EPS)).clamp_max(alpha) if debias else conf.clone()
    return s * torch.exp(-lam * offset.double())


def _state(x: torch.Tensor, prompt_len: int, block_start: int, bl: int, k: int) -> DecodeState:
    B, T = x.shape
    state = DecodeState(x=x, active=torch.ones(B, dtype=torch.bool), config=GenerationConfig(T - prompt_len, bl),
                        mask_id=TINY["mask_id"], eos_id=TINY["eos_id"], prompt_len=prompt_len, logit_shift=0,
                        n_layers=2, generator=torch.Generator().manual_seed(0), clock=StepClock.at(block_start, "cpu"),
                        vocab_size=TINY["vocab_size"])
    state.region.copy_(block_start + torch.arange(bl)[None, :].expand(B, -1))
    state.num_transfer = torch.full((B, 4), k, dtype=torch.long)
    return state


def _random_case(gen: torch.Generator, B=3, P=5, G=24, bl=8, block=1):
    """Tokens with blocks before ``block`` decoded and part of the block decoded, random proposals."""
    V, mask = TINY["vocab_size"], TINY["mask_id"]
    x = torch.randint(0, mask, (B, P + G), generator=gen)
    start = P + block * bl
    x[:, start:] = mask
    x[:, start:start + bl] = torch.where(torch.rand(B, bl, generator=gen) < 0.4,
                                         torch.randint(0, mask, (B, bl), generator=gen), mask)
    masked = x[:, start:start + bl] == mask
    logits = torch.randn(B, bl, V, generator=gen) * 3
    logp = torch.log_softmax(logits.double().index_fill(-1, torch.tensor([mask]), float("-inf")), -1)
    tokens = logp.argmax(-1)
    conf = logp.gather(-1, tokens[..., None]).squeeze(-1).exp().masked_fill(~masked, float("-inf"))
    return x, start, masked, Prediction(tokens, conf, logits, logp)


# ----------------------------------------------------------------------------------------------- certainty prior


@pytest.mark.parametrize("sigma", [0.5, 3.0, 10.0, 40.0])
def test_certainty_density_equals_the_formula(sigma):
    gen = torch.Generator().manual_seed(int(sigma * 10))
    decoded = torch.rand(4, 20, generator=gen) < 0.5
    decoded[0] = False
    decoded[1, -1] = True  # the right pad counts as decoded in this row only
    decoded[2, -1] = False
    ours = certainty_density(decoded, density_kernel(20, sigma, decoded.device))
    ref = reference_density(decoded, sigma)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-15)
    assert (ours <= 1 + 1e-12).all() and (ours >= 0).all()


@pytest.mark.parametrize("threshold", [None, 0.3])
@pytest.mark.parametrize("seed", range(4))
def test_certainty_prior_selects_by_confidence_times_density(seed, threshold):
    gen = torch.Generator().manual_seed(seed)
    x, start, masked, pred = _random_case(gen)
    P, bl, k = 5, 8, 1 + seed % 3
    state = _state(x, P, start, bl, k)
    rule = CertaintyPriorCommit(CertaintyPriorCommit.Config(sigma=4.0, threshold=threshold))
    chosen = rule.select(pred, masked, state, rule.init_state(state)).commit
    density = reference_density(x[:, P:] != TINY["mask_id"], 4.0)[:, start - P:start - P + bl]
    scores = (pred.confidence * density).masked_fill(~masked, float("-inf"))
    want = (reference_topk(scores, masked, torch.full((3,), k)) if threshold is None
            else reference_threshold(scores, masked, threshold))
    assert chosen.tolist() == want.tolist()


def test_certainty_prior_prefers_positions_next_to_decoded_ones():
    """Equal confidences: the position beside the decoded prefix is chosen first."""
    x = torch.full((1, 4 + 16), TINY["mask_id"])
    x[0, :4] = 3
    state = _state(x, 4, 4, 8, 1)
    conf = torch.full((1, 8), 0.5, dtype=torch.float64)
    pred = Prediction(torch.zeros(1, 8, dtype=torch.long), conf, torch.zeros(1, 8, TINY["vocab_size"]))
    rule = CertaintyPriorCommit(CertaintyPriorCommit.Config(sigma=2.0))
    chosen = rule.select(pred, torch.ones(1, 8, dtype=torch.bool), state, rule.init_state(state)).commit
    assert chosen.tolist() == [[True] + [False] * 7]


# ----------------------------------------------------------------------------------------------- PC-Sampler


def _table(tmp_path, vocab: int, seed: int = 0) -> str:
    gen = torch.Generator().manual_seed(seed)
    counts = {i: int(c) for i, c in enumerate(torch.randint(1, 500, (vocab - 3,), generator=gen))}
    path = tmp_path / f"freq{vocab}.json"
    path.write_text(json.dumps({"num_token": sum(counts.values()) + 7,
                                "p_baseline_dict": {str(i): c for i, c in counts.items()}}))
    return str(path)


@pytest.mark.parametrize("threshold", [None, 2.0])
@pytest.mark.parametrize("alpha,lam", [(10.0, 0.0), (2.5, 0.0), (10.0, 0.25), (3.0, 1.0)])
def test_pc_sampler_selects_by_the_calibrated_score(tmp_path, alpha, lam, threshold):
    path = _table(tmp_path, TINY["vocab_size"])
    freq = cc.read_table(path).frequencies(TINY["vocab_size"])
    rule = PCSamplerCommit(PCSamplerCommit.Config(clip_alpha=alpha, position_decay=lam, threshold=threshold,
                                                  frequency_table=path))
    for seed in range(4):
        x, start, masked, pred = _random_case(torch.Generator().manual_seed(seed))
        state = _state(x, 5, start, 8, 2)
        local = rule.init_state(state)
        rule.begin_generation(local, state, None, None)
        chosen = rule.select(pred, masked, state, local).commit
        scores = reference_pc_scores(pred.confidence, pred.tokens, freq, alpha, lam, torch.arange(8)[None, :])
        scores = scores.masked_fill(~masked, float("-inf"))
        want = (reference_topk(scores, masked, torch.full((3,), 2)) if threshold is None
                else reference_threshold(scores, masked, threshold))
        assert chosen.tolist() == want.tolist()


def test_pc_sampler_position_term_counts_from_the_region_start():
    """In a sliding window the offset is from the window's first column, as in a block from the block start."""
    x = torch.full((1, 4 + 16), TINY["mask_id"])
    state = _state(x, 4, 4, 4, 1)
    state.region.copy_(torch.tensor([[9, 11, 12, 15]]))
    conf = torch.tensor([[0.5, 0.5, 0.5, 0.9]], dtype=torch.float64)
    pred = Prediction(torch.zeros(1, 4, dtype=torch.long), conf, torch.zeros(1, 4, TINY["vocab_size"]))
    rule = PCSamplerCommit(PCSamplerCommit.Config(debias=False, position_decay=0.5))
    scores = rule.scores(pred, torch.ones(1, 4, dtype=torch.bool), state, rule.init_state(state))
    torch.testing.assert_close(scores, conf * torch.exp(-0.5 * torch.tensor([[0.0, 2.0, 3.0, 6.0]])).double())


def test_frequency_table_files(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"num_token": 10, "token_frequency_dict": {"0": 4, "3": 6}}))  # PC-Sampler's writer
    freq = cc.read_table(path).frequencies(5)
    torch.testing.assert_close(freq, torch.tensor([0.4, 0.1, 0.1, 0.6, 0.1], dtype=torch.float64))
    with pytest.raises(ValueError, match="outside this model's vocabulary of 3.*another tokenizer"):
        cc.read_table(path).frequencies(3)
    path.write_text("{}")
    with pytest.raises(ValueError, match="not a token-frequency table"):
        cc.read_table(path)
    table = cc.build_table(lambda s: [ord(c) - 97 for c in s], ["abca", "c"])
    assert table.counts == {0: 2, 1: 1, 2: 2} and table.total == 5
    assert cc.read_table(_write(tmp_path, table)).counts == table.counts


def _write(tmp_path, table: FrequencyTable):
    path = tmp_path / "built.json"
    path.write_text(json.dumps(table.to_json()))
    return path


def test_shipped_tables_are_what_the_builder_writes(tmp_path):
    out = tmp_path / "rebuilt.json"
    cc.main(["tiny-llada", "--out", str(out)])
    rebuilt = json.loads(out.read_text())
    for name in shipped_checkpoints():
        assert json.loads((resolve_checkpoint(name) / cc.TABLE_FILE).read_text()) == rebuilt, name


# ----------------------------------------------------------------------------------------------- decoding


@pytest.fixture(scope="module")
def llada():
    return polestar.load("tiny-llada", dtype=torch.float32, device="cpu")


def _arith(n: int) -> list[str]:
    task = get_task("arith")
    return [task.format_prompt(p.input) for p in load_problems("arith", n)]


@pytest.mark.parametrize("policy,options", [("certainty-prior", {}), ("certainty-prior", {"sigma": 2.0}),
                                            ("pc-sampler", {}), ("pc-sampler", {"position_decay": 0.25})])
def test_a_prompt_decodes_the_same_alone_and_in_a_batch(llada, policy, options):
    prompts = _arith(3) + ["arith:1+2="]
    kw = dict(policy=policy, gen_length=32, block_length=16, **options)
    batch = polestar.generate(llada, prompts, **kw).generations
    for i, prompt in enumerate(prompts):
        assert polestar.generate(llada, [prompt], **kw).generations[0].tolist() == batch[i].tolist()


@pytest.mark.parametrize("name", ["certainty-prior", "pc-sampler"])
def test_the_rules_pass_the_stage_checks(name):
    """``pytest --polestar-stage commit:NAME``: contract, laws, invariants, determinism, batch invariance with the
    default options on the small random models (PC-Sampler undebiased there: they carry no table; the debiased rule
    is checked with a table below)."""
    check_stage("commit", name)


@pytest.mark.parametrize("host,extra", [("fast-dllm", {}), ("elastic-cache", {"threshold": 2.0}),
                                        ("polestar-cache", {})])
def test_pc_sampler_stage_laws_and_invariants_with_a_table(tmp_path, family, host, extra):
    """The stage checks' invariants (every stage output checked against its contract) with debias on, a table for
    the small random models' vocabulary, in hosts with a block or a sliding-window region."""
    path = _table(tmp_path, TINY["vocab_size"], seed=1)
    model = make_model(family, seed=31)
    swap = {"commit": "pc-sampler", "frequency_table": path, "position_decay": 0.25}
    check_decode_invariants(model, host, PROMPTS, swap, gen_length=16, block_length=8, **extra)
    check_batch_invariance(model, host, swap)


@pytest.mark.parametrize("commit", ["certainty-prior", "pc-sampler"])
def test_the_rules_compose_with_every_cache(commit):
    refusals = {r: composition_refusal(r, commit) for r in names("refresh")}
    assert refusals == {r: None for r in refusals}


@pytest.mark.parametrize("refresh", ["dual", "elastic", "polestar", "dllm-cache"])
def test_certainty_prior_decodes_under_the_caches(llada, refresh):
    check_decode_invariants(llada, "certainty-prior", _arith(2), {"refresh": refresh}, gen_length=32,
                            block_length=16, threshold=0.8)


def test_defaults_decode_the_shipped_checkpoints(llada):
    """The checkpoint's table is found by itself; both rules solve the arith problems the baseline solves."""
    task, problems = get_task("arith"), load_problems("arith", 4)
    prompts = [task.format_prompt(p.input) for p in problems]
    for policy in ("certainty-prior", "pc-sampler"):
        out = polestar.generate(llada, prompts, policy=policy, gen_length=64, block_length=16)
        assert all(task.check(p.input, text) for p, text in zip(problems, out.texts)), policy


# ----------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("sigma", [0.0, -1.0, float("nan"), float("inf")])
def test_out_of_range_sigma_is_one_error_naming_it(sigma):
    with pytest.raises(ValueError, match="sigma") as err:
        polestar.assemble("certainty-prior", {"sigma": sigma})
    assert "\n" not in str(err.value)


def test_threshold_out_of_range(tmp_path):
    with pytest.raises(ValueError, match="threshold"):
        polestar.assemble("certainty-prior", {"threshold": 1.5})
    with pytest.raises(ValueError, match="threshold"):
        polestar.assemble("pc-sampler", {"threshold": -1.0})
    with pytest.raises(ValueError, match="clip_alpha"):
        polestar.assemble("pc-sampler", {"clip_alpha": 0.0})
    with pytest.raises(ValueError, match="position_decay"):
        polestar.assemble("pc-sampler", {"position_decay": -0.1})


def test_a_missing_frequency_table_is_one_error_naming_the_fix(tmp_path):
    bare = tmp_path / "tiny-llada-no-table"  # a checkpoint without its table
    bare.mkdir()
    for f in resolve_checkpoint("tiny-llada").iterdir():
        if f.name != cc.TABLE_FILE:
            (bare / f.name).write_bytes(f.read_bytes())
    checkpoint = polestar.load(str(bare), dtype=torch.float32)
    in_memory = make_model("llada", seed=1)  # no checkpoint, no table
    for model, options in ((checkpoint, {}), (in_memory, {"debias": True})):
        with pytest.raises(ValueError) as err:
            polestar.generate(model, [[13, 14, 5]], policy="pc-sampler", gen_length=16, block_length=8, **options)
        text = str(err.value)
        assert "\n" not in text
        assert re.search(r"commit\.frequency_table=PATH.*token_frequency\.json.*attach_table.*commit\.debias=false",
                         text), text
    with pytest.raises(ValueError, match="frequency_table .*is not a file"):
        polestar.assemble("pc-sampler", {"frequency_table": str(tmp_path / "none.json")})


def test_without_a_table_or_debias_the_rule_ranks_like_llada(tmp_path):
    """A model built in memory has no corpus: by default it decodes undebiased, as with debias=false: LLaDA's
    ranking. Given a table (attached or by path) it debiases, whichever way the table came."""
    model = make_model("llada", seed=1)
    kw = dict(gen_length=16, block_length=8)
    base = polestar.generate(model, PROMPTS, policy="baseline", mask_in_softmax=True, **kw).tokens.tolist()
    assert polestar.generate(model, PROMPTS, policy="pc-sampler", **kw).tokens.tolist() == base
    assert polestar.generate(model, PROMPTS, policy="pc-sampler", debias=False, **kw).tokens.tolist() == base
    path = _table(tmp_path, TINY["vocab_size"], seed=2)
    by_path = polestar.generate(model, PROMPTS, policy="pc-sampler", frequency_table=path, **kw).tokens.tolist()
    cc.attach_table(model, cc.read_table(path))
    assert polestar.generate(model, PROMPTS, policy="pc-sampler", **kw).tokens.tolist() == by_path
