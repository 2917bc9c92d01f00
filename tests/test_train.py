"""Fast checks of the training script (polestar.models.train): the loss goes down and checkpoints round-trip."""

from __future__ import annotations

import json

import torch

from polestar.bench.tasks import get_task
from polestar.bench.tasks.base import PROMPT_WIDTH
from polestar.models.loading import load_model
from polestar.models.tokenizer import build_char_tokenizer, special_ids
from polestar.models.train import DEFAULT_MIXTURE, GEN, Batcher, build_parser, evaluate_checkpoint, train


def test_batcher_layout():
    tok = build_char_tokenizer()
    ids, att, P = Batcher(tok, {"copy": 1.0, "arith": 1.0}, seed=0).sample(8)
    assert P == PROMPT_WIDTH and ids.shape == (8, PROMPT_WIDTH + GEN) and bool(att.all())
    eos = special_ids(tok)["eos"]
    assert bool((ids[:, -1] == eos).all())  # answer region ends in EOS fill
    assert get_task("copy").format_prompt("ab").strip() == "copy:ab="


def test_train_loss_decreases_and_checkpoint_roundtrips(tmp_path):
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
    acc = evaluate_checkpoint(out, n=1)
    assert set(acc) == set(DEFAULT_MIXTURE) and all(0.0 <= v <= 1.0 for v in acc.values())
    assert "| arith |" in (out / "README.md").read_text()
