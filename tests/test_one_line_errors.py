"""Every entry point keeps the one-line promise: ``polestar lm-eval`` (missing checkpoint, a device this machine
lacks, bad model arguments) before lm-eval logs anything, torchrun runs (one line, from rank 0, for a usage error),
config.json fields of the wrong type, a pickle under a safetensors name (named, never unpickled), ``inspect`` on a
checkpoint it refuses, text that is not UTF-8 (``--prompt``, ``--data`` with file:line, the Python API), and
Ctrl-C during a bench (naming ``--resume``)."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

import polestar
from polestar import registry
from polestar.bench import harness
from polestar.cli import main
from polestar.evaluation import cli as lm_cli
from polestar.models.loading import resolve_checkpoint


def one_error_line(capsys, code_expected: int, argv: list[str]) -> str:
    """Run ``main(argv)``: the exit code is ``code_expected`` and stderr holds exactly one ``error:`` line (after
    at most the checkpoint's ``[model]`` line); returns that line."""
    code = main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.strip().splitlines() if not line.startswith("[model] ")]
    assert code == code_expected, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def checkpoint_copy(tmp_path):
    """A copy of tiny-llada whose config.json or weights a test may break."""
    directory = tmp_path / "ckpt"
    shutil.copytree(resolve_checkpoint("tiny-llada"), directory, ignore=shutil.ignore_patterns("train_log*"))
    return directory


def _set_config(directory: Path, **fields) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(fields)
    (directory / "config.json").write_text(json.dumps(config))


GEN = ["generate", "--prompt", "3+4", "--task", "arith", "--gen-length", "16", "--block-length", "16"]


# ------------------------------------------------------------------------------------------- config.json types


@pytest.mark.parametrize("field, value, must_be", [
    ("n_layers", "4", "an integer"), ("mask_token_id", "1", "an integer"), ("rope_theta", "abc", "a number"),
    ("include_bias", "false", "true or false"), ("d_model", 128.5, "an integer"),
])
def test_a_config_field_of_the_wrong_type_is_named(checkpoint_copy, capsys, field, value, must_be):
    _set_config(checkpoint_copy, **{field: value})
    expected = f"config.json field {field} must be {must_be}, got {value!r} ({type(value).__name__})"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}"):
        polestar.load(checkpoint_copy)
    line = one_error_line(capsys, 1, [*GEN, "--model", str(checkpoint_copy)])
    assert expected in line and "'<='" not in line
    assert expected in one_error_line(capsys, 2, ["inspect", str(checkpoint_copy)])


def test_an_integral_float_is_an_integer(checkpoint_copy):
    _set_config(checkpoint_copy, n_layers=4.0)
    assert polestar.load(checkpoint_copy).spec.n_layers == 4


class _Marker:
    """Unpickling this touches a file: proof that a pickle was (never) opened."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


@pytest.mark.parametrize("kind", ["torch.save", "pickle"])
def test_a_pickle_named_model_safetensors_is_called_a_pickle_and_never_unpickled(checkpoint_copy, tmp_path, capsys,
                                                                               kind):
    marker = tmp_path / "unpickled"
    weights = checkpoint_copy / "model.safetensors"
    if kind == "torch.save":
        torch.save({"x": torch.zeros(2), "marker": _Marker(marker)}, weights)
        what = "a torch.save zip archive \\(a pickle\\)"
    else:
        weights.write_bytes(pickle.dumps({"marker": _Marker(marker)}, protocol=4))
        what = "a pickle \\(protocol 4\\)"
    with pytest.raises(ValueError, match=f"model.safetensors is {what}, not safetensors.*never unpickles"):
        polestar.load(checkpoint_copy)
    line = one_error_line(capsys, 1, [*GEN, "--model", str(checkpoint_copy)])
    assert "(a pickle" in line and "truncated" not in line
    assert not marker.exists()


def test_inspect_exits_non_zero_when_it_refuses_a_field(checkpoint_copy, capsys):
    assert main(["inspect", str(checkpoint_copy)]) == 0
    capsys.readouterr()
    _set_config(checkpoint_copy, alibi=True, block_type="sequential")
    code = main(["inspect", str(checkpoint_copy)])
    out, err = capsys.readouterr()
    assert code == 1 and out.count("REFUSED") == 2  # the facts are still printed
    assert err.strip().splitlines() == [f"error: {checkpoint_copy} does not load: config.json block_type='sequential' "
                                        "(supported: 'llama') (and 1 more, listed above)"]
    assert main(["inspect", str(checkpoint_copy), "--json"]) == 1
    assert len(json.loads(capsys.readouterr().out)["refused"]) == 2


# ----------------------------------------------------------------------------------------------- stage options


def test_an_optional_or_unannotated_option_of_the_wrong_type_is_named(isolated_registry):
    with pytest.raises(ValueError, match="^option 'cluster_layers_together' of refresh stage 'polestar' must be true "
                                         "or false \\(or null\\); got 'abc' \\(str\\)$"):
        registry.build("refresh", "polestar", cluster_layers_together="abc")
    registry.build("refresh", "polestar", cluster_layers_together=None)

    @registry.register("drift", "untyped")
    class Untyped:  # a plugin's config without annotations: the default's type stands in
        @attrs.frozen
        class Config:
            window = attrs.field(default=4, validator=attrs.validators.le(16))

        def __init__(self, config):
            self.config = config

    with pytest.raises(ValueError, match="^option 'window' of drift stage 'untyped' must be an integer <= 16; got "
                                         "'abc' \\(str\\)$"):
        registry.build("drift", "untyped", window="abc")


# ----------------------------------------------------------------------------------------------- text input


def test_a_prompt_that_is_not_utf8_is_named_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(polestar, "load", lambda *a, **k: pytest.fail("loaded a model before the bad prompt"))
    bad = b"3+\xff4".decode("utf-8", "surrogateescape")  # how Python hands over such a command-line argument
    line = one_error_line(capsys, 2, [*GEN[:1], "--prompt", "1+1", "--prompt", bad, "--task", "arith"])
    assert line == ("error: --prompt #2 is not UTF-8 text: byte 0xff at character 3; pass the prompt as UTF-8 "
                    "(convert it first, e.g. iconv -f latin1 -t utf-8)")
    line = one_error_line(capsys, 2, ["trace", "--prompt", bad, "--policies", "fast-dllm", "--out",
                                          str(tmp_path / "trace")])
    assert "--prompt is not UTF-8 text: byte 0xff" in line


def test_a_data_file_that_is_not_utf8_is_named_with_file_and_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(polestar, "load", lambda *a, **k: pytest.fail("loaded a model before the bad file"))
    data = tmp_path / "problems.jsonl"
    data.write_bytes(b'{"input": "3+4", "output": "7"}\n{"input": "3+\xe94"}\n')
    line = one_error_line(capsys, 2, ["bench", "--data", str(data), "--n", "5"])
    assert line == f"error: --data: {data}:2: not UTF-8 text (byte 0xe9 at column 14); save the file as UTF-8"


def test_the_api_names_a_prompt_that_is_not_utf8(shipped_models):
    with pytest.raises(ValueError, match="^prompt 1 is not UTF-8 text: byte 0xff at character 1"):
        polestar.generate(shipped_models["tiny-llada"], ["3+4", "\udcff"], gen_length=16, block_length=16)


# ----------------------------------------------------------------------------------------------- Ctrl-C


def test_ctrl_c_during_a_bench_names_resume(tmp_path, monkeypatch, capsys):
    real, calls = harness.decode_batch, []

    def interrupted_after_one_batch(*args, **kwargs):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(harness, "decode_batch", interrupted_after_one_batch)
    out = tmp_path / "r.fd0.7"
    argv = ["bench", "--policies", "fast-dllm", "--n", "4", "--batch-size", "2", "--gen-length", "16", "--quiet"]
    line = one_error_line(capsys, 130, [*argv, "--json", str(out)])
    assert line == (f"error: interrupted; finished items are kept ({tmp_path / 'r.fd0.7.items.jsonl'}): rerun the "
                    "same command with --resume to continue")
    calls.clear()
    line = one_error_line(capsys, 130, argv)
    assert "nothing was kept" in line and "--resume" in line


# ----------------------------------------------------------------------------------------------- lm-eval


@pytest.fixture
def no_harness(monkeypatch):
    """Fail if lm-eval itself starts: these errors must come before it."""
    monkeypatch.setattr(lm_cli, "_run_harness", lambda argv: pytest.fail("lm-eval started before the bad input"))


@pytest.mark.parametrize("model_args, expected", [
    ("pretrained=/no/such/checkpoint", "error: model argument pretrained=/no/such/checkpoint: checkpoint "
                                       "'/no/such/checkpoint' not found"),
    ("pretrained=tiny-llada,polcy=polestar", "error: unknown model arguments ['polcy']; valid: "),
    ("pretrained=tiny-llada,threshold=abc", "error: model argument threshold: expected a number, got 'abc'"),
    ("pretrained=tiny-llada,gen_length=-16", "error: model arguments: 'gen_length' must be > 0: -16"),
    ("pretrained=tiny-llada,policy=nope", "error: model argument policy=nope: unknown policy 'nope'"),
    ("pretrained=tiny-llada,set.threshold=3", "error: model argument policy=polestar: option 'threshold' of commit "
                                              "stage 'polestar': 3 is out of range"),
    ("pretrained=tiny-llada,oops", "error: --model_args: expected key=value, got 'oops'"),
])
def test_lm_eval_bad_model_args_are_one_line_before_lm_eval_starts(capfd, no_harness, model_args, expected):
    code = main(["lm-eval", "--model_args", model_args, "--tasks", "gsm8k"])
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(expected), err


def test_lm_eval_refuses_a_device_this_machine_lacks(capfd, no_harness, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["--device", "cuda"], ["--model_args", "pretrained=tiny-llada,device=cuda"]):
        code = main(["lm-eval", "--model_args", "pretrained=tiny-llada", "--tasks", "gsm8k", *argv]
                    if argv[0] == "--device" else ["lm-eval", *argv, "--tasks", "gsm8k"])
        err = capfd.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("error: --device cuda: "), err
        assert "--device cpu" in err[0]


# ----------------------------------------------------------------------------------------------- torchrun


def test_a_rank_reports_a_usage_error_once_and_a_failure_with_its_rank(checkpoint_copy, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main(["bench", "--policies", "nope"]) == 2
    assert capsys.readouterr().err == ""  # rank 0 says it
    monkeypatch.setenv("RANK", "0")
    assert main(["bench", "--policies", "nope"]) == 2
    assert capsys.readouterr().err.startswith("error: [rank 0] unknown policy 'nope'")
    monkeypatch.setenv("RANK", "1")  # a failure while working is each rank's own: one line, naming the rank
    _set_config(checkpoint_copy, n_layers="4")
    line = one_error_line(capsys, 1, [*GEN, "--model", str(checkpoint_copy)])
    assert line.startswith("error: [rank 1] loading model") and "n_layers must be an integer" in line


def test_a_rank_reports_a_bad_option_once(monkeypatch, capsys):
    """argparse's own errors (an unknown option, a bad value) too: rank 0 prints the line, the others exit with the
    same code in silence."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    for argv in (["bench", "--bogus"], ["bench", "--n", "x"], ["generate"]):
        monkeypatch.setenv("RANK", "1")
        assert main(argv) == 2
        assert capsys.readouterr().err == ""
        monkeypatch.setenv("RANK", "0")
        assert main(argv) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("error: polestar"), err


@pytest.mark.slow
def test_torchrun_with_a_bad_argument_prints_one_error_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "polestar.cli", "bench", "--policies", "nope", "--num-problems", "2"]
    proc = subprocess.run(cmd, env=dict(env, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-2000:]  # rank 0's; rank 1 says nothing
    assert errors[0].startswith("error: [rank 0] unknown policy 'nope' in --policies")
