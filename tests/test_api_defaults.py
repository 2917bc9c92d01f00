"""``polestar.generate`` takes a model or a checkpoint name (as ``polestar.trace`` does); its defaults fit the
model (a published checkpoint's preset, else 64 / 16 within the context), and ``task=`` writes prompts in the
task's layout as ``polestar generate --task`` does."""

import pytest
import torch

import polestar
from polestar import presets
from polestar.api import DEFAULT_LENGTHS, length_defaults
from polestar.tasks import get_task
from polestar.testing import tiny_model


def test_shipped_model_defaults_fit_its_context(shipped_models):
    model = shipped_models["tiny-llada"]
    assert length_defaults(model) == DEFAULT_LENGTHS
    out = polestar.generate(model, ["3+4*2-5"], task="arith")
    assert out.generations.shape[1] == DEFAULT_LENGTHS["gen_length"] <= model.spec.max_seq_len // 2
    explicit = polestar.generate(model, [get_task("arith").format_prompt("3+4*2-5")], gen_length=64, block_length=16)
    assert torch.equal(out.tokens, explicit.tokens)  # task= is the task's prompt layout, nothing more


def test_small_context_caps_the_generation_length():
    model = tiny_model("llada", max_seq_len=48)
    assert length_defaults(model) == {"gen_length": 16, "block_length": 16}


def test_a_published_checkpoint_takes_its_preset(tmp_path, monkeypatch):
    model = tiny_model("llada")
    (tmp_path / "config.json").write_text("{}")
    preset = presets.get_preset(presets.preset_names()[0])
    monkeypatch.setattr(presets, "preset_for_config", lambda config, directory: preset)
    model.name_or_path = str(tmp_path)
    assert length_defaults(model) == {k: preset.decoding[k] for k in DEFAULT_LENGTHS}


def test_task_rejects_token_ids_and_bad_inputs(shipped_models):
    model = shipped_models["tiny-llada"]
    with pytest.raises(ValueError, match="task='arith' formats string prompts"):
        polestar.generate(model, [[5, 6, 7]], task="arith")
    with pytest.raises(ValueError, match="not an input of the arith task"):
        polestar.generate(model, ["hello"], task="arith")
    with pytest.raises(ValueError, match="unknown task"):
        polestar.generate(model, ["3+4"], task="nope")


def test_generate_takes_a_checkpoint_name_as_trace_does(shipped_models, monkeypatch):
    by_name = polestar.generate("tiny-llada", ["3+4*2-5"], task="arith", policy="fast-dllm")
    loaded = polestar.generate(shipped_models["tiny-llada"], ["3+4*2-5"], task="arith", policy="fast-dllm")
    assert torch.equal(by_name.tokens, loaded.tokens) and by_name.texts == loaded.texts
    monkeypatch.setattr(polestar.api, "load", lambda *a, **k: pytest.fail("loaded before the bad input was named"))
    with pytest.raises(ValueError, match="option 'threshold' of commit stage"):
        polestar.generate("tiny-llada", ["3+4"], threshold="abc")
    with pytest.raises(FileNotFoundError, match="checkpoint 'no-such-model' not found"):
        polestar.generate("no-such-model", ["3+4"])
