"""Presets of the published models (polestar.presets): registry, recognition from config.json, the paper's
values, and the command line (flags override a preset)."""

import json

import pytest

from polestar import assemble, presets
from polestar.cli import main
from polestar.models.published import DREAM_7B_INSTRUCT_CONFIG, LLADA_8B_INSTRUCT_CONFIG


def test_registry_lists_the_published_models():
    assert presets.preset_names() == ["dream-v0-instruct-7b", "llada-1.5", "llada-8b-instruct"]
    with pytest.raises(ValueError, match="unknown preset 'llada'; known presets: dream-v0-instruct-7b, llada-1.5"):
        presets.get_preset("llada")
    with pytest.raises(ValueError, match="already registered"):
        presets.register_preset(presets.get_preset("llada-1.5"))


def test_recognised_from_config_json():
    assert presets.preset_for_config(LLADA_8B_INSTRUCT_CONFIG, "/m/LLaDA-8B-Instruct").name == "llada-8b-instruct"
    assert presets.preset_for_config(LLADA_8B_INSTRUCT_CONFIG, "/m/LLaDA-1.5").name == "llada-1.5"
    assert presets.preset_for_config(LLADA_8B_INSTRUCT_CONFIG).name == "llada-8b-instruct"
    assert presets.preset_for_config(DREAM_7B_INSTRUCT_CONFIG, "/m/anything").name == "dream-v0-instruct-7b"
    assert presets.preset_for_config({**LLADA_8B_INSTRUCT_CONFIG, "n_layers": 1}) is None
    assert presets.preset_for_config({"model_type": "llada", "d_model": 32}) is None


@pytest.mark.parametrize("name", ["llada-8b-instruct", "llada-1.5", "dream-v0-instruct-7b"])
def test_paper_settings(name):
    p = presets.get_preset(name)
    assert p.policy == "polestar"
    assert p.decoding == {"gen_length": 256, "block_length": 32, "temperature": 0.0}  # steps follow gen_length
    stages = assemble(p.policy, dict(p.options)).describe()
    assert stages["commit"]["threshold"] == 0.9 and stages["commit"]["min_confidence"] == 0.7
    assert stages["commit"]["window"] == 5 and stages["commit"]["alpha"] == 10.0
    assert stages["refresh"]["n_clusters"] == 8 and stages["refresh"]["topk"] == 4
    assert stages["refresh"]["prefix_blocks"] == 2 and stages["refresh"]["suffix_blocks"] == 1
    assert assemble("fast-dllm", dict(p.options)).describe()["commit"]["threshold"] == 0.9  # optional elsewhere


def test_cli_flags_override_the_preset(capsys):
    base = ["generate", "--model", "tiny-llada", "--prompt", "1+2=", "--gen-length", "32", "--block-length", "16",
            "--json"]
    assert main(base + ["--preset", "llada-8b-instruct"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert "[preset llada-8b-instruct]" in captured.err
    assert out["policy"] == "polestar" and out["stages"]["commit"]["threshold"] == 0.9
    assert len(out["tokens"][0]) == out["prompt_len"] + 32
    assert main(base + ["--preset", "llada-8b-instruct", "--policy", "fast-dllm", "--set", "threshold=0.5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "fast-dllm" and out["stages"]["commit"]["threshold"] == 0.5
    assert main(base) == 0  # tiny-llada is no published model: no preset, the old defaults
    captured = capsys.readouterr()
    assert json.loads(captured.out)["policy"] == "fast-dllm" and "[preset" not in captured.err


def test_unknown_preset_fails_before_loading(capsys):
    assert main(["generate", "--model", "/nonexistent", "--prompt", "x", "--preset", "bogus"]) == 2
    assert "unknown preset 'bogus'" in capsys.readouterr().err


def test_presets_and_policies_commands(capsys):
    assert main(["presets", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert set(listed) == set(presets.preset_names()) and listed["llada-1.5"]["decoding"]["gen_length"] == 256
    assert main(["policies", "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["presets"]) == set(presets.preset_names())
