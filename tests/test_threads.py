"""Intra-op threads: one for a small model unless OMP_NUM_THREADS or --threads say otherwise; --threads on every
command that runs a model; the bench manifest and items header record the threads the run used."""

import json

import pytest
import torch

from polestar.bench.item_log import items_path
from polestar.bench.manifest import manifest_path
from polestar.cli import main
from polestar.threads import SMALL_D_MODEL, choose_threads, model_width

TINY = ["--model", "tiny-llada", "--gen-length", "16", "--block-length", "8"]


@pytest.fixture
def threads_restored(monkeypatch):
    """The test changes torch's threads through a command and OMP_NUM_THREADS is unset; both are put back."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_rule():
    assert choose_threads(3, 128, {}).threads == 3  # --threads wins over everything
    assert choose_threads(3, 4096, {"OMP_NUM_THREADS": "8"}).threads == 3
    omp = choose_threads(None, 128, {"OMP_NUM_THREADS": "4"})
    assert omp.threads is None and "OMP_NUM_THREADS=4" in omp.reason  # torch reads it itself
    assert choose_threads(None, 128, {}).threads == 1  # the shipped checkpoints' width
    assert choose_threads(None, SMALL_D_MODEL - 1, {}).threads == 1
    assert choose_threads(None, SMALL_D_MODEL, {}).threads is None  # torch's default pool
    assert choose_threads(None, 4096, {}).threads is None  # LLaDA-8B
    assert choose_threads(None, None, {}).threads is None  # width unknown: left alone
    assert choose_threads(None, 128, {"OMP_NUM_THREADS": " "}).threads == 1  # set but empty: not set


def test_model_width_reads_config_json(tmp_path):
    assert model_width("tiny-llada") == 128 and model_width("tiny-dream") == 128
    assert model_width(tmp_path) is None and model_width("/no/such/model") is None


def _bench(tmp_path, *extra):
    out = tmp_path / "r.json"
    code = main(["bench", *TINY, "--policies", "fast-dllm", "--n", "1", "--quiet", "--json", str(out), *extra])
    assert code == 0
    header = json.loads(items_path(out).read_text().splitlines()[0])["header"]
    return json.loads(manifest_path(out).read_text()), header, json.loads(out.read_text())


def test_bench_defaults_to_one_thread_for_a_small_model_and_records_it(tmp_path, threads_restored):
    torch.set_num_threads(2)
    manifest, header, result = _bench(tmp_path)
    assert torch.get_num_threads() == 1
    assert manifest["threads"] == 1 and header["threads"] == 1 and result["manifest"]["threads"] == 1
    assert "threads" not in manifest["settings"]  # recorded once, as torch uses them


def test_threads_flag_wins_and_is_recorded(tmp_path, threads_restored):
    manifest, header, _ = _bench(tmp_path, "--threads", "2")
    assert torch.get_num_threads() == 2 and manifest["threads"] == 2 and header["threads"] == 2


def test_omp_num_threads_is_left_to_torch(tmp_path, threads_restored, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)  # as torch would have read it at start-up
    manifest, _, _ = _bench(tmp_path)
    assert manifest["threads"] == 2


@pytest.mark.parametrize("argv", [
    ["generate", *TINY, "--prompt", "3+4", "--task", "arith"],
    ["anatomy", *TINY, "--policies", "fast-dllm", "--n", "1"],
    ["trace", *TINY, "--task", "arith", "--index", "0", "--policies", "fast-dllm", "--no-png"],
], ids=["generate", "anatomy", "trace"])
def test_every_command_that_runs_a_model_takes_threads(argv, tmp_path, threads_restored, capsys):
    if argv[0] == "trace":
        argv = [*argv, "--out", str(tmp_path / "t")]
    assert main([*argv, "--threads", "2"]) == 0
    assert torch.get_num_threads() == 2
    assert main(argv) == 0
    assert torch.get_num_threads() == 1  # the default for the tiny model
    capsys.readouterr()
    assert main([*argv, "--threads", "0"]) == 2
    assert "--threads must be at least 1, got 0" in capsys.readouterr().err


def test_lm_eval_takes_threads_before_lm_eval_starts(monkeypatch, capsys, threads_restored):
    from polestar.evaluation import cli as eval_cli

    seen = []
    monkeypatch.setattr(eval_cli, "_run_harness", lambda argv: seen.append((list(argv), torch.get_num_threads())))
    monkeypatch.setattr(eval_cli, "write_counters", lambda argv: None)
    args = ["lm-eval", "--model_args", "pretrained=tiny-llada", "--tasks", "polestar_arith"]
    assert main([*args, "--threads", "0"]) == 2
    assert "--threads must be an integer of at least 1, got '0'" in capsys.readouterr().err
    assert main([*args, "--threads", "2"]) == 0
    assert main(args) == 0
    (argv2, threads2), (_, threads_default) = seen
    assert "--threads" not in argv2 and threads2 == 2 and threads_default == 1
