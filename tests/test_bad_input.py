"""Bad input answered at once and clearly.

Every case goes through the command line (``polestar.cli.main``): the exit code (2 usage error, 1 runtime failure),
exactly one ``error:`` line on stderr naming the flag / key / file, and, for the usage errors, no model load (the
``no_work`` fixture fails the test if a model is loaded). Where it applies the Python API is checked too.
"""

import json
import sys

import attrs
import pytest
import torch

import polestar
from polestar.bench.harness import check_problem_args
from polestar.cli import build_parser, main
from polestar.cli_checks import UsageError
from polestar.models.loading import build_model, save_model
from polestar.models.tokenizer import build_char_tokenizer, special_ids
from polestar.stats import RunStats, SequenceStats, compile_seconds
from polestar.tasks import get_task, split, task_names
from tests.conftest import make_model


def _spec(max_seq_len=128):
    tok = build_char_tokenizer()
    ids = special_ids(tok)
    vocab = tok.get_vocab_size()
    return tok, dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=4, mlp_hidden=64, vocab_size=vocab,
                     embedding_size=vocab, rope_theta=10000.0, norm_eps=1e-5, max_seq_len=max_seq_len,
                     mask_id=ids["mask"], eos_id=ids["eos"], pad_id=ids["pad"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tok, spec = _spec()
    path = tmp_path_factory.mktemp("ckpt")
    save_model(build_model("llada", spec, seed=0), path, tokenizer=tok)
    return str(path)


@pytest.fixture(scope="module")
def nan_checkpoint(tmp_path_factory):
    tok, spec = _spec()
    model = build_model("llada", spec, seed=0)
    with torch.no_grad():
        dict(model.named_parameters())["model.transformer.blocks.0.ff_proj.weight"].fill_(float("nan"))
    path = tmp_path_factory.mktemp("nan")
    save_model(model, path, tokenizer=tok)
    return str(path)


@pytest.fixture
def no_work(monkeypatch):
    """Fail if the command loads a model: a usage error must be found before any work."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was reported")

    monkeypatch.setattr(polestar, "load", refuse)


def run(capsys, argv):
    """``main(argv)`` → (exit code, the single stderr line); asserts that stderr is exactly one ``error:`` line,
    after at most the checkpoint's one-line facts that a command prints before loading it."""
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if not line.startswith("[model] ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert len(err.strip().splitlines()) <= 2, err
    assert "Traceback" not in err
    return code, lines[0]


GEN = ["generate", "--model", "tiny-llada", "--gen-length", "16", "--block-length", "8"]
BENCH = ["bench", "--model", "tiny-llada", "--n", "1", "--gen-length", "16", "--block-length", "8"]


# ----------------------------------------------------------------------------- bad flags, files and devices


def test_device_cuda_without_cuda(capsys, no_work, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, line = run(capsys, [*GEN, "--prompt", "3+4", "--device", "cuda"])
    assert code == 2 and "--device cuda" in line and "--device cpu" in line


def test_device_unknown(capsys, no_work):
    code, line = run(capsys, [*GEN, "--prompt", "3+4", "--device", "foo"])
    assert code == 2 and "--device 'foo'" in line


def test_nan_weights_refused(capsys, nan_checkpoint):
    code, line = run(capsys, ["generate", "--model", nan_checkpoint, "--prompt", "3+4", "--gen-length", "16",
                              "--block-length", "8"])
    assert code == 1 and "NaN" in line and "weight" in line


@pytest.fixture
def first_sequence_fails(monkeypatch):
    """The engine records non-finite logits as ``SequenceStats.error``: make the first sequence of every call
    carry one (the rest decode normally), so the CLI's reporting is tested on its own."""
    real = polestar.generate

    def with_error(*args, **kwargs):
        out = real(*args, **kwargs)
        seqs = (attrs.evolve(out.stats.sequences[0], error="non-finite logits at step 0"), *out.stats.sequences[1:])
        return attrs.evolve(out, stats=attrs.evolve(out.stats, sequences=seqs))

    monkeypatch.setattr(polestar, "generate", with_error)


def test_sequence_error_is_one_line_exit_1(capsys, checkpoint, first_sequence_fails):
    # reported in one line with exit code 1, not an empty output with exit code 0
    code, line = run(capsys, ["generate", "--model", checkpoint, "--prompt", "3+4", "--prompt", "1+1",
                              "--gen-length", "16", "--block-length", "8"])
    assert code == 1 and "prompt #1 '3+4'" in line and "non-finite logits" in line


def test_bench_reports_sequence_errors(capsys, checkpoint, first_sequence_fails, tmp_path):
    out_json = tmp_path / "r.json"
    code, line = run(capsys, ["bench", "--model", checkpoint, "--policies", "fast-dllm", "--n", "2", "--batch-size",
                              "2", "--gen-length", "16", "--block-length", "8", "--quiet", "--json", str(out_json)])
    assert code == 1 and "1 of 2 problem(s) stopped early" in line and "non-finite logits" in line
    items = json.loads(out_json.read_text())["items"]
    assert [item["error"] for item in items] == ["non-finite logits at step 0", None]


def test_task_input_validated(capsys, no_work):
    code, line = run(capsys, [*GEN, "--task", "copy", "--prompt", "HELLO"])
    assert code == 2 and "'HELLO'" in line and "copy" in line and "lowercase" in line
    with pytest.raises(ValueError, match="not an input of the copy task"):
        get_task("copy").format_prompt("HELLO")


@pytest.mark.parametrize("name", task_names())
def test_every_task_validates_its_inputs(name):
    task = get_task(name)
    for problem in split(task, 5, "test", seed=0):
        task.validate_input(problem.input)  # generated inputs are accepted
        assert problem.input in task.format_prompt(problem.input)
    for bad in ["HELLO WORLD", "", "3+4*2" * 10]:
        with pytest.raises(ValueError):
            task.validate_input(bad)


def test_bench_n_zero(capsys, no_work):
    code, line = run(capsys, [*BENCH, "--n", "0"])
    assert code == 2 and "--n must be at least 1" in line
    from polestar.bench.harness import run_bench

    for policies, n, batch_size, match in ([["baseline"], 0, 1, "n must be"], [[], 1, 1, "no policies"],
                                           [["baseline"], 1, 0, "batch_size must be"]):
        with pytest.raises(ValueError, match=match):
            run_bench("tiny-llada", "arith", policies, n, {}, {"gen_length": 16, "block_length": 8}, batch_size)


def test_bench_policies_empty(capsys, no_work):
    code, line = run(capsys, [*BENCH, "--policies", ""])
    assert code == 2 and "--policies is empty" in line


@pytest.mark.parametrize("size", ["-1", "0"])
def test_bench_batch_size(capsys, no_work, size):
    code, line = run(capsys, [*BENCH, "--batch-size", size])
    assert code == 2 and f"--batch-size must be at least 1, got {size}" in line


def test_bench_rejects_policy_flag(capsys, no_work):
    code, line = run(capsys, [*BENCH, "--policy", "polestar"])
    assert code == 2 and "use --policies polestar" in line


def test_option_the_single_policy_lacks(capsys, no_work):
    code, line = run(capsys, [*GEN, "--prompt", "3+4", "--policy", "baseline", "--set", "threshold=0.5"])
    assert code == 2 and "'threshold'" in line and "baseline" in line
    code, line = run(capsys, [*BENCH, "--policies", "baseline", "--set", "threshold=0.5"])
    assert code == 2 and "'threshold'" in line
    # several policies: an option none of them has is an error; one that some have is accepted
    code, line = run(capsys, [*BENCH, "--policies", "baseline,parallel", "--set", "topk=3"])
    assert code == 2 and "'topk'" in line
    args = build_parser().parse_args([*BENCH, "--policies", "baseline,parallel", "--set", "threshold=0.5"])
    assert check_problem_args(args, {"threshold": 0.5},
                              {"gen_length": 16, "block_length": 8}) == ["baseline", "parallel"]


def test_option_of_wrong_type_names_key(capsys, no_work):
    code, line = run(capsys, [*GEN, "--prompt", "3+4", "--set", "threshold=abc"])
    assert code == 2 and "'threshold'" in line and "must be a number" in line and "'abc'" in line
    with pytest.raises(ValueError, match="option 'threshold' of commit stage 'threshold' must be a number"):
        polestar.assemble("fast-dllm", {"threshold": "abc"})


def test_malformed_data_names_file_and_line(capsys, no_work, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"input": "3+4", "output": "3+4=7"}\n{"input": "1+1"\n')
    code, line = run(capsys, [*BENCH, "--n", "5", "--data", str(data)])
    assert code == 2 and f"{data}:2" in line and "not valid JSON" in line
    data.write_text('{"input": "hello"}\n')
    code, line = run(capsys, [*BENCH, "--data", str(data)])
    assert code == 2 and f"{data}:1" in line and "not an input of the arith task" in line


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_output_into_missing_directory(capsys, no_work, tmp_path, flag):
    target = tmp_path / "missing" / "out.x"
    code, line = run(capsys, [*BENCH, flag, str(target)])
    assert code == 2 and flag in line and "does not exist" in line


def test_plot_without_matplotlib(capsys, no_work, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    code, line = run(capsys, [*BENCH, "--plot", str(tmp_path / "p.png")])
    assert code == 2 and "--plot needs matplotlib" in line


def test_set_without_equals_is_usage_error(capsys, no_work):
    code, line = run(capsys, [*GEN, "--prompt", "3+4", "--set", "threshold"])
    assert code == 2 and "KEY=VALUE" in line and "'threshold'" in line


def test_version(capsys):
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"polestar {version('polestar-dllm')}"


def test_debug_shows_traceback(capsys, no_work):
    assert main([*GEN, "--prompt", "3+4", "--device", "foo", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("error: --device")


# ----------------------------------------------------------------------------- bad options, layouts and prompts


def test_out_of_range_option_names_key_and_range(capsys, no_work):
    code, line = run(capsys, [*GEN, "--prompt", "3+4", "--policy", "polestar", "--set", "refresh.n_clusters=1"])
    assert code == 2 and "'n_clusters'" in line and ">= 2" in line
    with pytest.raises(ValueError, match=r"'threshold'.*\[0, 1\]"):
        polestar.assemble("fast-dllm", {"threshold": 3})


def test_a_number_out_of_range_is_called_out_of_range_not_a_wrong_type(capsys, no_work):
    code, line = run(capsys, [*GEN, "--prompt", "3+4", "--set", "threshold=1.5"])
    assert code == 2 and "'threshold'" in line and "1.5 is out of range" in line and "[0, 1]" in line
    assert "must be a number" not in line
    with pytest.raises(ValueError, match=r"option 'threshold' of commit stage 'threshold': 3 is out of range"):
        polestar.assemble("fast-dllm", {"threshold": 3})


def test_task_input_error_reads_as_english(capsys, no_work):
    code, line = run(capsys, [*GEN, "--task", "arith", "--prompt", "x"])
    assert code == 2 and "not an input of the arith task: 'x'" in line and "not a arith" not in line
    with pytest.raises(ValueError, match="not an input of the countdown task"):
        get_task("countdown").validate_input("1,2")


def test_inspect_names_its_positional_argument(capsys):
    code, line = run(capsys, ["inspect", "/nope"])
    assert code == 2 and line.startswith("error: inspect MODEL_DIR '/nope' not found") and "--model" not in line


HUB = "GSAI-ML/LLaDA-8B-Instruct"


@pytest.mark.parametrize("argv", [
    ["generate", "--model", HUB, "--prompt", "3+4"], ["bench", "--model", HUB, "--n", "1"], ["inspect", HUB],
    ["trace", "--model", HUB, "--task", "arith", "--out", "t"]], ids=["generate", "bench", "inspect", "trace"])
def test_a_hub_id_says_to_download_a_local_folder(capsys, no_work, argv):
    code, line = run(capsys, argv)
    assert code == 2 and "reads local Hugging Face-format folders" in line and "downloads nothing" in line
    assert f"huggingface-cli download {HUB} --local-dir ~/models/LLaDA-8B-Instruct" in line


def test_the_api_answers_a_hub_id_with_the_download_command():
    with pytest.raises(FileNotFoundError, match=f"huggingface-cli download {HUB} --local-dir"):
        polestar.load(HUB)
    with pytest.raises(FileNotFoundError, match="not found"):  # a path that is no hub id keeps its message
        polestar.load("/no/such/folder")


def test_topk_above_cluster_count(capsys, no_work):
    code, line = run(capsys, [*GEN, "--prompt", "3+4", "--policy", "polestar", "--set", "topk=20"])
    assert code == 2 and "topk (20) cannot exceed n_clusters (8)" in line
    with pytest.raises(ValueError, match="topk_last"):
        polestar.assemble("polestar", {"refresh.topk_last": 9})


def test_steps_not_a_multiple_of_blocks(capsys, no_work):
    code, line = run(capsys, [*GEN, "--prompt", "3+4", "--steps", "3"])
    assert code == 2 and "steps (3) must be a multiple of the number of blocks (2" in line


def test_empty_batch_and_empty_prompt(capsys, checkpoint):
    with pytest.raises(ValueError, match="empty batch"):
        polestar.generate(make_model("llada"), [], gen_length=16, block_length=8)
    code, line = run(capsys, ["generate", "--model", checkpoint, "--prompt", "", "--gen-length", "16",
                              "--block-length", "8"])
    assert code == 2 and "prompt 0 is empty" in line


# ----------------------------------------------------------------------------- further bad inputs


@pytest.mark.parametrize("argv, expected", [
    (["--gen-length", "-8"], "gen_length must be a positive integer, got -8"),
    (["--block-length", "24"], "must be a multiple of block_length (24); e.g. block_length 16"),
    (["--temperature", "-1"], "temperature must be in [0, 100]"),
    (["--task", "nope"], "unknown task 'nope'"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--model", "pyproject.toml"], "--model pyproject.toml is a file"),
    (["--model", "/no/such/dir"], "--model '/no/such/dir' not found"),
    (["--set", "refresh=bogus"], "unknown refresh stage 'bogus'"),
    (["--policy", "polestar", "--set", "topk=2.5"], "option 'topk' of refresh stage 'polestar' must be an integer"),
    (["--set", "=3"], "--set expects KEY=VALUE"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--seed", "x"], "argument --seed: invalid int value"),
    (["--gen-lenth", "3"], "unrecognized arguments: --gen-lenth"),
    (["--policy", "nope"], "unknown policy 'nope'"),
    (["--steps", "128"], "steps (128) cannot exceed gen_length (64)"),
])
def test_further_bad_generate_inputs(capsys, no_work, argv, expected):
    base = ["generate", "--prompt", "3+4", "--gen-length", "64", "--block-length", "16"]
    code, line = run(capsys, [*base, *argv])
    assert code == 2 and expected in line


def test_prompt_longer_than_context(capsys, checkpoint):
    code, line = run(capsys, ["generate", "--model", checkpoint, "--prompt", "1+" * 60 + "1", "--gen-length", "16",
                              "--block-length", "8"])
    assert code == 2 and "prompt #1 has 121 tokens" in line and "context (128)" in line


def test_further_bad_api_inputs():
    model = make_model("llada")
    with pytest.raises(ValueError, match="option 'threshold' of commit stage 'threshold' must be a number; got 'high'"):
        polestar.generate(model, [[1, 2]], gen_length=16, block_length=8, threshold="high")
    with pytest.raises(ValueError, match="temperature must be a number"):
        polestar.generate(model, [[1, 2]], gen_length=16, block_length=8, temperature="hot")
    with pytest.raises(ValueError, match="seed must be an integer"):
        polestar.generate(model, [[1, 2]], gen_length=16, block_length=8, seed=1.5)
    with pytest.raises(ValueError, match="stop_at_eos must be True or False"):
        polestar.generate(model, [[1, 2]], gen_length=16, block_length=8, stop_at_eos="yes")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        polestar.generate(model, [[1, 999]], gen_length=16, block_length=8)
    with pytest.raises(ValueError, match="suffix_commit"):
        polestar.assemble("polestar", {"suffix_commit": 1})


def test_agree_bad_files(capsys, tmp_path):
    junk = tmp_path / "junk.json"
    junk.write_text("not json")
    code, line = run(capsys, ["agree", str(junk), str(junk)])
    assert code == 2 and str(junk) in line and "not a benchmark JSON" in line
    junk.write_text(json.dumps({"summary": {}}))
    code, line = run(capsys, ["agree", str(junk), str(junk)])
    assert code == 2 and "no 'items' list" in line
    code, line = run(capsys, ["agree", str(junk), str(junk), "--policy-a", "x"])
    assert code == 2 and "--policy-a and --policy-b go together" in line


def test_corrupt_checkpoint_is_runtime_failure(capsys, checkpoint, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    code, line = run(capsys, ["generate", "--model", str(broken), "--prompt", "3+4", "--gen-length", "16",
                              "--block-length", "8"])
    assert code == 1 and "loading model" in line and str(broken) in line


# ----------------------------------------------------------------------------- feedback on long work


def test_progress_on_several_batches(capsys, checkpoint):
    argv = ["generate", "--model", checkpoint, "--prompt", "3+4", "--prompt", "1+1", "--prompt", "2*3",
            "--gen-length", "16", "--block-length", "8", "--batch-size", "2"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert [line.split(" · ")[0] for line in err.splitlines() if line.startswith("generate:")] == [
        "generate: batch 1/2", "generate: batch 2/2"]
    assert len(out.strip().splitlines()) == 3
    assert main([*argv, "--quiet"]) == 0
    assert "generate: batch" not in capsys.readouterr().err
    assert main([*argv[:-2], "--batch-size", "8"]) == 0  # one batch: no progress lines
    assert "generate: batch" not in capsys.readouterr().err
    assert main([*argv, "--json", "--quiet"]) == 0  # one JSON object per batch
    batches = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [len(b["texts"]) for b in batches] == [2, 1]


def test_compile_seconds_counts_compile_time():
    before = compile_seconds()
    fn = torch.compile(lambda x: torch.sin(x) * 2, backend="eager")
    fn(torch.ones(3, 5, 7))
    assert compile_seconds() > before


def test_run_stats_merge_and_compile_field():
    a = RunStats(3, 10, 1.0, 30, (SequenceStats(3, 10, 30),), compile_s=2.0)
    b = RunStats(2, 4, 0.5, 8, (SequenceStats(2, 4, 8, error="boom"),))
    merged = RunStats.merge([a, b])
    assert (merged.nfe, merged.tokens, merged.wall_s, merged.compile_s) == (5, 14, 1.5, 2.0)
    assert merged.errors == [(1, "boom")]
    assert merged.as_dict()["compile_s"] == 2.0 and merged.as_dict()["per_sequence"][1]["error"] == "boom"
    assert merged.tps == pytest.approx(14 / 1.5)


def test_usage_error_is_a_value_error():
    # API callers that catch ValueError keep working
    assert issubclass(UsageError, ValueError)
