"""`polestar lm-eval --preset table1`: the paper's Table 1 settings reach lm-eval's arguments and the model.

A copy of the shipped tiny LLaDA checkpoint with a longer context stands in for LLaDA-8B (same format, same
loader); nothing is downloaded: the arguments are parsed by lm-eval's own parser and the model decodes real
requests named after lm-eval's tasks."""

import json
import re
import shutil
from pathlib import Path

import lm_eval
import pytest
from lm_eval._cli import HarnessCLI
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model

import polestar
from polestar.evaluation.cli import expand_arguments
from polestar.evaluation.lm_eval_model import PolestarLM  # registers --model polestar
from polestar.evaluation.presets import PRESETS, get_preset
from polestar.models.loading import resolve_checkpoint
from polestar.presets import PAPER_OPTIONS
from polestar.tasks import get_task

PAPER_SHOTS = {"gsm8k": 5, "minerva_math": 4, "humaneval": 0, "mbpp": 3}


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory):
    """tiny-llada with a 1024-token context, so 256- and 512-token generations fit."""
    dst = tmp_path_factory.mktemp("ckpt") / "tiny-llada-long"
    shutil.copytree(resolve_checkpoint("tiny-llada"), dst)
    config = json.loads((dst / "config.json").read_text())
    config["max_sequence_length"] = 1024
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _parse(argv):
    return HarnessCLI()._parser.parse_args(["run", *argv])


@pytest.mark.parametrize("task", list(PAPER_SHOTS))
def test_preset_sets_fewshot_and_model_args(task, long_tiny):
    argv = expand_arguments(["--preset", "table1", "--model_args", f"pretrained={long_tiny},policy=polestar",
                             "--tasks", task])
    args = _parse(argv)
    assert args.model == "polestar"
    assert args.num_fewshot == PAPER_SHOTS[task]
    assert args.model_args == {"pretrained": str(long_tiny), "policy": "polestar", "preset": "table1"}
    assert args.tasks == [task]


def test_explicit_fewshot_wins_and_mixed_tasks_keep_their_own():
    args = _parse(expand_arguments(["--preset", "table1", "--model_args", "pretrained=x", "--tasks", "gsm8k",
                                    "--num_fewshot", "8"]))
    assert args.num_fewshot == 8
    args = _parse(expand_arguments(["--preset=table1", "--tasks", "gsm8k,mbpp", "--model_args", "pretrained=x"]))
    assert args.num_fewshot is None and args.model_args["preset"] == "table1"


def test_lm_eval_task_defaults_equal_the_paper():
    """With several tasks in one run each keeps its own YAML few-shot count: those equal the paper's."""
    root = Path(lm_eval.__file__).parent / "tasks"
    files = {"gsm8k": "gsm8k/gsm8k.yaml", "minerva_math": "minerva_math/minerva_math_algebra.yaml",
             "humaneval": "humaneval/humaneval.yaml", "mbpp": "mbpp/mbpp.yaml"}
    for task, rel in files.items():
        shots = int(re.search(r"^num_fewshot:\s*(\d+)", (root / rel).read_text(), re.M).group(1))
        assert shots == PAPER_SHOTS[task] == get_preset("table1").setting(task).num_fewshot


def test_preset_reaches_the_decoder(long_tiny, monkeypatch):
    argv = expand_arguments(["--preset", "table1", "--model_args", f"pretrained={long_tiny},policy=polestar",
                             "--tasks", "gsm8k"])
    lm = get_model("polestar").create_from_arg_obj(_parse(argv).model_args, {"batch_size": 2, "device": "cpu"})
    calls = []
    real = polestar.generate

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append((kwargs, out.pipeline.describe()))
        return out

    monkeypatch.setattr(polestar, "generate", spy)
    prompt = get_task("arith").format_prompt("3+4*2-5")
    reqs = [Instance("generate_until", {}, (prompt, {"until": ["\n\n"]}), i, (task, 0, 1))
            for i, task in enumerate(["gsm8k", "humaneval", "minerva_math_algebra"])]
    texts = lm.generate_until(reqs)
    assert all(isinstance(t, str) for t in texts)
    lengths = sorted((kw["gen_length"], kw["steps"], kw["block_length"], kw["threshold?"]) for kw, _ in calls)
    assert lengths == [(256, 256, 32, 0.9), (512, 512, 32, 0.9)]  # gsm8k + minerva_math batched; humaneval 512
    for _, stages in calls:  # the paper's stage options reach the pipeline
        assert stages["commit"]["threshold"] == 0.9
        for key, value in PAPER_OPTIONS.items():
            kind, _, option = key.rstrip("?").rpartition(".")
            if kind:
                assert stages[kind][option] == value, key
    assert lm.counters.sequences == 3


def test_explicit_options_win_over_the_preset(long_tiny):
    lm = PolestarLM(pretrained=str(long_tiny), preset="table1", threshold=0.8, device="cpu",
                    **{"set.refresh.topk": 2})
    overrides = lm._stage_overrides()
    assert overrides["threshold?"] == 0.8 and overrides["refresh.topk"] == 2 and "refresh.topk?" not in overrides
    assert overrides["commit.min_confidence?"] == PAPER_OPTIONS["commit.min_confidence?"]


def test_presets_listed_and_unknown_refused():
    assert set(PRESETS) == {"table1", "table1-512", "pc-sampler", "certainty-prior", "d2cache"}
    assert get_preset("table1-512").gen_length("gsm8k") == 512
    with pytest.raises(ValueError, match="unknown evaluation preset 'table2'.*table1"):
        expand_arguments(["--preset", "table2", "--tasks", "gsm8k"])


def test_preset_is_for_the_polestar_model():
    with pytest.raises(ValueError, match="--preset configures the polestar model"):
        expand_arguments(["--preset", "table1", "--model", "hf", "--tasks", "gsm8k"])
    assert _parse(expand_arguments(["--model", "polestar", "--preset", "table1", "--tasks", "mbpp"])).num_fewshot == 3


def test_hyphenated_options_are_accepted(long_tiny):
    argv = expand_arguments(["--preset", "table1", "--model-args", f"pretrained={long_tiny},policy=polestar",
                             "--tasks", "gsm8k", "--output-path=out", "--gen_kwargs", "temperature=0"])
    args = _parse(argv)
    assert args.model_args["preset"] == "table1" and args.output_path == "out" and args.num_fewshot == 5


@pytest.mark.parametrize("name", ["pc-sampler", "certainty-prior", "d2cache"])
def test_a_method_preset_assembles_its_policy_with_every_option_applied(name):
    """A method's preset names options of that method's policy only: each applies (none is dropped as optional)."""
    import polestar

    preset = get_preset(name)
    required = {key.rstrip("?"): value for key, value in preset.options.items()}
    pipeline = polestar.assemble(name, required)
    assert pipeline.policy == name and preset.block_length == 256
