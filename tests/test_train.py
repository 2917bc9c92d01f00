"""Fast checks of the training script (polestar.training.train): the loss goes down and checkpoints round-trip."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from polestar.models.loading import load_model
from polestar.models.tokenizer import build_char_tokenizer, special_ids
from polestar.tasks import get_task
from polestar.tasks.arith import solve
from polestar.tasks.base import PROMPT_WIDTH
from polestar.training.train import (
    DEFAULT_MIXTURE,
    GEN,
    Batcher,
    build_parser,
    chain_facts_batch,
    evaluate_checkpoint,
    facts_batch,
    sample_mask,
    train,
)


def test_batcher_layout():
    tok = build_char_tokenizer()
    ids, att, P = Batcher(tok, {"copy": 1.0, "arith": 1.0}, seed=0).sample(8)
    assert P == PROMPT_WIDTH and ids.shape == (8, PROMPT_WIDTH + GEN) and bool(att.all())
    eos = special_ids(tok)["eos"]
    assert bool((ids[:, -1] == eos).all())  # answer region ends in EOS fill
    assert get_task("copy").format_prompt("ab").strip() == "copy:ab="


def test_facts_batch_holds_single_steps_with_the_result_masked():
    tok = build_char_tokenizer()
    mask = special_ids(tok)["mask"]
    x, y = facts_batch(tok, 50, random.Random(0), mask)
    assert x.shape == (50, 5) and bool((x[:, -1] == mask).all())
    for row, target in zip(x.tolist(), y.tolist()):
        text = tok.decode(row[:4])
        assert text[3] == "=" and tok.decode([target]) == str(solve(text[:3]))


def test_chain_facts_cut_each_chain_before_one_of_its_results():
    tok = build_char_tokenizer()
    mask = special_ids(tok)["mask"]
    batcher = Batcher(tok, {"arith": 1.0}, seed=0)
    x, att, pos, target, valid = chain_facts_batch(batcher, 40, torch.Generator().manual_seed(0), mask)
    assert x.shape == (40, PROMPT_WIDTH + GEN) and bool(att.all()) and bool(valid[:, 0].all())
    assert not bool(valid[:, 1].any())  # arith results are single digits
    assert 0 < int(valid[:, 2].sum()) < 40  # the last step's result has no copy
    for row, (p, _, p_copy), (t, _, t_copy), (_, _, has_copy) in zip(x.tolist(), pos.tolist(), target.tolist(),
                                                                    valid.tolist()):
        assert all(tok_id == mask for tok_id in row[p:]) and mask not in row[:p]  # kept up to the cut, masked after
        prompt, answer = tok.decode(row[:PROMPT_WIDTH]), tok.decode(row[PROMPT_WIDTH:p])
        assert answer.endswith("=") and prompt.strip().startswith("arith:")
        assert tok.decode([t]) == str(solve(answer[-4:-1]))  # "...7*2=" -> the result of 7*2
        assert p_copy == (p + 2 if has_copy else p) and t_copy == t  # "=7,7": the next left operand
    x, _, pos, _, _ = chain_facts_batch(batcher, 40, torch.Generator().manual_seed(1), mask, random_after=True)
    cut = pos[:, 0]
    assert bool((x[torch.arange(40)[:, None], pos] == mask).all())  # the value and its copy stay hidden
    before = torch.arange(x.shape[1])[None, :] < cut[:, None]
    assert not bool((x[before] == mask).any())
    assert 0 < int((x[~before] != mask).sum())  # some later tokens are left visible


def test_chain_facts_on_countdown_target_every_digit_of_the_result():
    tok = build_char_tokenizer()
    mask = special_ids(tok)["mask"]
    batcher = Batcher(tok, {"countdown": 1.0, "countdown4": 1.0}, seed=0)
    ids, _, _ = Batcher(tok, {"countdown": 1.0, "countdown4": 1.0}, seed=0).sample(60)
    x, _, pos, target, valid = chain_facts_batch(batcher, 60, torch.Generator().manual_seed(0), mask)
    assert 0 < int(valid[:, 1].sum()) < 60 and 0 < int(valid[:, 2].sum()) < 60  # both one- and two-digit results
    for full, row, (p, p2, p3), (t, t2, t3), (_, v2, v3) in zip(ids.tolist(), x.tolist(), pos.tolist(),
                                                               target.tolist(), valid.tolist()):
        assert all(tok_id == mask for tok_id in row[p:]) and mask not in row[:p]
        answer = tok.decode(full[PROMPT_WIDTH:]).split("<|endoftext|>")[0]
        cut = p - PROMPT_WIDTH  # the result of the equation ending at the cut
        lhs, result = answer[:cut].rsplit(",", 1)[-1], answer[cut:].split(",")[0]
        a, op, b = re.fullmatch(r"(\d+)([-+*/])(\d+)=", lhs).groups()
        assert int(result) == int(eval(f"{a}{op}{b}".replace("/", "//")))
        assert tok.decode([t]) == result[0] and v2 == (len(result) == 2)
        if v2:
            assert p2 == p + 1 and tok.decode([t2]) == result[1]
        rest = answer[cut + len(result):]
        assert v3 == rest.startswith(",")
        if v3:
            assert p3 == p + len(result) + 1 and tok.decode([t3]) == rest[1]


def test_sample_mask_prefix_rows_hide_a_suffix_inside_the_answer():
    eos = 0
    ans = torch.full((64, 20), eos)
    lengths = torch.randint(1, 15, (64,), generator=torch.Generator().manual_seed(1))
    for i, n in enumerate(lengths.tolist()):
        ans[i, :n] = 7
    masked, t = sample_mask(ans, eos, torch.Generator().manual_seed(0), prefix_frac=1.0)
    for i, n in enumerate(lengths.tolist()):
        row = masked[i].tolist()
        cut = row.index(True)
        assert all(row[cut:]) and not any(row[:cut]) and cut <= n  # a suffix, cut inside answer + first EOS
        assert t[i].item() == pytest.approx((20 - cut) / 20)
    plain, t0 = sample_mask(ans, eos, torch.Generator().manual_seed(0))
    assert bool(((t0 > 0) & (t0 <= 1)).all()) and plain.shape == ans.shape


def test_train_loss_decreases_and_checkpoint_roundtrips(tmp_path, capsys):
    out = tmp_path / "tiny"
    args = build_parser().parse_args([
        "--family", "llada", "--out", str(out), "--steps", "30", "--minutes", "5", "--threads", "1",
        "--batch", "16", "--d-model", "32", "--layers", "2", "--heads", "2", "--warmup", "5", "--lr", "3e-3",
        "--tasks", "copy", "--eval-every", "0", "--final-n", "0", "--no-progress", "--log-every", "5",
    ])
    summary = train(args)
    hist = summary["history"]
    assert summary["steps"] == 30 and len(hist) == 30
    assert sum(hist[-5:]) / 5 < 0.8 * sum(hist[:5]) / 5, hist
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md", "train_log.jsonl"):
        assert (out / name).is_file(), name
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert any("loss" in r for r in records) and any(r.get("event") == "trained" for r in records)

    model = summary["model"]
    loaded = load_model(out)
    assert loaded.tokenizer is not None and loaded.spec == model.spec
    x = torch.randint(3, model.spec.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    x[:, 20:] = model.spec.mask_id
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))

    # the stand-alone final evaluation appends to the log and rewrites the model card
    capsys.readouterr()
    acc = evaluate_checkpoint(out, n=1)
    assert set(acc) == set(DEFAULT_MIXTURE) and all(0.0 <= v <= 1.0 for v in acc.values())
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("final evaluation: ")]
    assert len(progress) == len(DEFAULT_MIXTURE)  # one line per batch on stderr: the evaluation is never silent
    assert progress[0].startswith(f"final evaluation: {list(DEFAULT_MIXTURE)[0]} 1/1 · task 1/{len(DEFAULT_MIXTURE)}")
    assert "| arith |" in (out / "README.md").read_text()

    # fine-tuning from the checkpoint keeps its architecture, with the curriculum aids on
    tuned = tmp_path / "tuned"
    args = build_parser().parse_args([
        "--family", "llada", "--init", str(out), "--out", str(tuned), "--steps", "2", "--threads", "1",
        "--batch", "4", "--tasks", "arith", "--facts-batch", "8", "--chain-facts", "4", "--prefix-frac", "0.5",
        "--eval-every", "0", "--final-n", "0", "--no-progress",
    ])
    assert train(args)["model"].spec == model.spec
    with pytest.raises(ValueError, match="llada checkpoint but --family is dream"):
        train(build_parser().parse_args(["--family", "dream", "--init", str(out), "--out", str(tuned), "--steps", "1",
                                         "--final-n", "0", "--no-progress"]))


def test_answer_noise_flips_only_digits_at_the_given_rate():
    from polestar.training.train import noisy_targets

    tok = build_char_tokenizer()
    digits = torch.tensor([tok.token_to_id(d) for d in "0123456789"])
    text = "12+34=46,46*2=92" * 4
    ans = torch.tensor([tok.encode(text).ids] * 400)
    noisy = noisy_targets(ans, digits, 0.3, torch.Generator().manual_seed(0))
    is_digit = torch.isin(ans, digits)
    assert torch.equal(noisy[~is_digit], ans[~is_digit])  # operators and '=' never change
    assert torch.isin(noisy[is_digit], digits).all()
    changed = (noisy != ans)[is_digit].float().mean().item()
    assert abs(changed - 0.3 * 0.9) < 0.01  # a uniform draw keeps the same digit 1 time in 10
    assert torch.equal(noisy_targets(ans, digits, 0.0, torch.Generator()), ans)
