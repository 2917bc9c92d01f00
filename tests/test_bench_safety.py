"""Runs a researcher can trust: a bench never drops finished items silently, checks every output and size before
any work (exit 2), labels every row with its overrides, and survives kill -9 at random points."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from polestar.bench import harness
from polestar.bench.harness import run_bench
from polestar.bench.item_log import items_path, read_previous
from polestar.cli import main

ROOT = Path(__file__).resolve().parents[1]
DECODING = dict(gen_length=16, block_length=16, steps=None, temperature=0.0, seed=0, stop_at_eos=True, compile=False)
SMALL = ["--model", "tiny-llada", "--task", "arith", "--policies", "fast-dllm", "--n", "4", "--batch-size", "2",
         "--gen-length", "16", "--block-length", "16", "--quiet"]


@pytest.fixture
def no_decoding(monkeypatch):
    """Fail the test if `polestar bench` gets as far as decoding."""
    monkeypatch.setattr(harness, "run_bench", lambda *a, **k: pytest.fail("started working before the check"))


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished small bench run (its --json path)."""
    out = tmp_path_factory.mktemp("finished") / "run.json"
    assert main(["bench", *SMALL, "--json", str(out)]) == 0
    return out


def _copy_run(src: Path, dst_dir: Path) -> Path:
    dst = dst_dir / src.name
    for path in src.parent.glob(src.stem + ".*"):
        (dst_dir / path.name).write_bytes(path.read_bytes())
    return dst


def test_rerun_without_resume_is_a_usage_error_and_keeps_the_items(finished, tmp_path, no_decoding, capsys):
    out = _copy_run(finished, tmp_path)
    before = items_path(out).read_text()
    assert main(["bench", *SMALL, "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert "holds 4 finished items" in err and "--resume" in err and "--overwrite" in err
    assert items_path(out).read_text() == before


def test_overwrite_keeps_the_old_files_beside_the_new_ones(finished, tmp_path, capsys):
    out = _copy_run(finished, tmp_path)
    old_items = items_path(out).read_text()
    assert main(["bench", *SMALL, "--json", str(out), "--overwrite"]) == 0
    assert "kept beside the new ones" in capsys.readouterr().err
    kept = sorted(p.name for p in tmp_path.glob("*.old-*"))
    assert any(name.startswith("run.items.jsonl.old-") for name in kept)
    assert any(name.startswith("run.json.old-") for name in kept)
    (old,) = [p for p in tmp_path.glob("run.items.jsonl.old-*")]
    assert old.read_text() == old_items
    assert len(read_previous(out).records) == 4  # the new run's items, not mixed with the old ones


def test_resume_with_changed_settings_is_a_usage_error_before_work(finished, tmp_path, no_decoding, capsys):
    out = _copy_run(finished, tmp_path)
    changed = [*SMALL[:-9], "--n", "6", *SMALL[-7:]]
    assert main(["bench", *changed, "--json", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "other settings (n: 4 -> 6)" in err
    assert main(["bench", *SMALL, "--json", str(out), "--resume", "--overwrite"]) == 2
    assert "exclude each other" in capsys.readouterr().err


def test_resume_says_what_it_reuses(finished, tmp_path, capsys):
    out = _copy_run(finished, tmp_path)
    assert main(["bench", *SMALL, "--json", str(out), "--resume"]) == 0
    err = capsys.readouterr().err
    assert "resume: reusing 4 finished items (fast-dllm 4)" in err and "model=tiny-llada" in err and "n=4" in err


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_unwritable_output_is_a_usage_error_before_work(flag, no_decoding, capsys):
    assert main(["bench", *SMALL, flag, "/proc/out.png"]) == 2
    assert "cannot create files in /proc" in capsys.readouterr().err


def test_anatomy_json_is_checked_before_work(monkeypatch, capsys):
    from polestar.bench import anatomy

    monkeypatch.setattr(anatomy, "commit_anatomy", lambda *a, **k: pytest.fail("started working before the check"))
    assert main(["anatomy", *SMALL, "--json", "/proc/anatomy.json"]) == 2
    assert "cannot create files in /proc" in capsys.readouterr().err


@pytest.mark.parametrize("task,n,limit", [("arith", 100_000_000, "1,000,000"), ("countdown", 100_000, "79,200")])
def test_huge_n_is_refused_naming_the_limit(task, n, limit, no_decoding, capsys):
    assert main(["bench", "--task", task, "--n", str(n), "--quiet"]) == 2
    assert limit in capsys.readouterr().err


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    from polestar.output_files import write_atomic

    path = tmp_path / "summary.json"
    write_atomic(path, "old")

    def fails(tmp):
        Path(tmp).write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_atomic(path, writer=fails)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_problem_generation_shows_progress(capsys):
    harness.load_problems("arith", 50, show_progress=True)
    err = capsys.readouterr().err
    assert "problems" in err and "50/50" in err


@pytest.mark.slow
def test_task_folder_works_from_another_directory(tmp_path, monkeypatch):
    """Written with a relative path, read by lm-eval from another working directory."""
    from lm_eval.tasks import TaskManager, get_task_dict

    from polestar.evaluation.tasks import write_task_dir

    (tmp_path / "here").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    paths = write_task_dir("tasks", "arith", n=4, choices=2)
    data = yaml.safe_load(paths["polestar_arith"].read_text().split("process_results")[0])
    assert Path(data["dataset_kwargs"]["data_files"]["test"]).is_absolute()
    monkeypatch.chdir(tmp_path / "elsewhere")
    for key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(key, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    # lm-eval's own tasks are not indexed: only the written folder is read
    manager = TaskManager(include_path=str(tmp_path / "here" / "tasks"), include_defaults=False)
    tasks = get_task_dict(["polestar_arith"], manager)
    docs = list(tasks["polestar_arith"].test_docs())
    assert len(docs) == 4


def test_lm_eval_output_path_is_checked_before_lm_eval_runs(tmp_path, monkeypatch, capsys):
    from polestar.evaluation import cli as eval_cli

    monkeypatch.setattr(eval_cli, "_run_harness", lambda argv: pytest.fail("lm-eval ran before the check"))
    args = ["lm-eval", "--model", "polestar", "--model_args", "pretrained=tiny-llada", "--tasks", "polestar_arith"]
    assert main([*args, "--output_path", "/proc/results"]) == 2
    assert "--output_path /proc/results" in capsys.readouterr().err
    (tmp_path / "f").write_text("x")
    assert main([*args, "--output_path", str(tmp_path / "f" / "out")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_lm_eval_counters_never_replace_an_earlier_file(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from polestar.evaluation import cli as eval_cli
    from polestar.evaluation import lm_eval_model
    from polestar.evaluation.counters import DecodingCounters

    lm = SimpleNamespace(pretrained="m", policy="p", world_size=1, rank=0, total_counters=lambda: DecodingCounters())
    monkeypatch.setattr(lm_eval_model, "LAST_MODEL", lm)
    monkeypatch.setattr(eval_cli.time, "strftime", lambda fmt: "2026-01-01T00-00-00")
    first = eval_cli.write_counters(["--output_path", str(tmp_path)])
    second = eval_cli.write_counters(["--output_path", str(tmp_path)])
    assert first != second and first.is_file() and second.is_file()


def test_task_folder_over_a_file_is_refused(tmp_path):
    from polestar.evaluation.tasks import write_task_dir

    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        write_task_dir(tmp_path / "f", "arith", n=4, choices=2)


@pytest.mark.slow
def test_check_sh_names_a_missing_triton_before_its_first_step(tmp_path):
    """check.sh on a machine without triton says, before its first step, which step it skips and what to
    install (stopped right after by a bad --modes, so no step runs)."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['triton'] = None  # as if not installed\n")
    env = dict(os.environ, POLESTAR_SKIP_INSTALL="1", PYTHON=sys.executable, PYTHONPATH=str(tmp_path))
    run = subprocess.run(["bash", str(ROOT / "bench/gpu/check.sh"), "--tiny", "--modes", "none"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert "# triton not installed: step 6 (Triton kernels) is skipped; pip install triton" in run.stdout
    assert "wrote" not in run.stdout


@pytest.mark.slow
def test_gpu_check_without_triton_skips_only_the_kernel_step(tmp_path, monkeypatch):
    """Triton is hidden (``importlib.util.find_spec("triton")`` is None) in a child process: hiding it here would
    leave torch's lazily imported modules and caches in this worker as they were set up without Triton."""
    from bench.gpu import check

    out = tmp_path / "rows.json"
    argv = ["--tiny", "--device", "cpu", "--batches", "1", "--gen", "8", "--prompt", "4", "--modes", "eager",
            "--json", str(out)]
    code = textwrap.dedent(
        f"""
        import importlib.util
        import sys

        from bench.gpu import check

        real = importlib.util.find_spec
        importlib.util.find_spec = lambda name, *a: None if name == "triton" else real(name, *a)
        sys.exit(check.main({argv!r}))
        """
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = run.stdout.splitlines()
    skip = next(i for i, line in enumerate(lines) if "step 6 (Triton kernels) will be skipped" in line)
    assert skip < next(i for i, line in enumerate(lines) if line.startswith("# step 1: wrote"))
    assert "pip install triton" in lines[skip]
    rows = json.loads(out.read_text())
    assert rows["kernels"] == [] and "triton is not installed" in rows["kernels_skipped"] and rows["policies"]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "TRITON_INTERPRET=1" in check.kernel_step_blocker(__import__("torch").device("cpu"))


def test_overrides_label_rows_titles_plots_and_records(tmp_path, monkeypatch, capsys):
    import matplotlib.pyplot as plt

    texts = []
    real = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (texts.extend(
        t.get_text() for t in fig.axes[0].get_legend().get_texts()), real(fig))[1])
    out, plot = tmp_path / "o.json", tmp_path / "o.png"
    args = [*SMALL[:4], "--policies", "fast-dllm,elastic-cache,baseline", *SMALL[6:]]
    assert main(["bench", *args, "--set", "commit=entropy-bound", "--json", str(out), "--plot", str(plot)]) == 0
    printed = capsys.readouterr().out
    assert "fast-dllm[commit=entropy-bound]" in printed and "elastic-cache[commit=entropy-bound]" in printed
    assert "set commit=entropy-bound" in printed.splitlines()[0]
    result = json.loads(out.read_text())
    labels = {"fast-dllm": "fast-dllm[commit=entropy-bound]", "elastic-cache": "elastic-cache[commit=entropy-bound]",
              "baseline": "baseline[commit=entropy-bound]"}
    assert {name: s["label"] for name, s in result["summary"].items()} == labels
    assert all(item["label"] == labels[item["policy"]] for item in result["items"])
    assert sorted(texts) == sorted(labels.values()) and plot.is_file()
    # an option that only some policies take labels only those
    assert harness.policy_label("fast-dllm", {"threshold": 0.5}) == "fast-dllm[threshold=0.5]"
    assert harness.policy_label("baseline", {"threshold": 0.5}) == "baseline"


# ----------------------------------------------------------------------------- kill -9


N_KILL, BATCH, KILLS = 60, 10, 3


def _complete_records(path: Path) -> int:
    return len(read_previous(path).records) if items_path(path).exists() else 0


def _bench_process(out: Path, resume: bool) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "polestar.cli", "bench", "--model", "tiny-llada", "--task", "arith",
           "--policies", "fast-dllm", "--n", str(N_KILL), "--batch-size", str(BATCH), "--gen-length", "16",
           "--block-length", "16", "--quiet", "--json", str(out)] + (["--resume"] if resume else [])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_kill_9_at_random_points_loses_at_most_a_batch(tmp_path):
    """A real `polestar bench` over 60 items, killed with SIGKILL at three random points (seeded): each kill
    leaves only whole batches on disk, every batch written before the kill is reused by the next --resume, and
    the resumed result equals an uninterrupted run."""
    rng = random.Random(1234)
    # kill once this many batches are on disk (at most 4 of 6: two are left to decode, so the kill lands in flight)
    targets = sorted(rng.sample(range(1, N_KILL // BATCH - 1), KILLS))
    extra_delay = [rng.uniform(0.0, 0.02) for _ in targets]  # and a random moment after that
    out = tmp_path / "run.json"
    for k, (target, delay) in enumerate(zip(targets, extra_delay)):
        proc = _bench_process(out, resume=k > 0)
        while _complete_records(out) < target * BATCH and proc.poll() is None:
            time.sleep(0.005)
        time.sleep(delay)
        on_disk_before = _complete_records(out)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL, proc.stderr.read()[-2000:]
        kept = _complete_records(out)
        assert kept >= on_disk_before and kept % BATCH == 0  # nothing written is lost; no half batch is kept
        assert kept < N_KILL
    proc = _bench_process(out, resume=True)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert f"resume: reusing {kept} finished items" in err
    resumed = json.loads(out.read_text())
    full = run_bench("tiny-llada", "arith", ["fast-dllm"], N_KILL, {}, DECODING, batch_size=BATCH,
                     show_progress=False, json_out=str(tmp_path / "full.json"))
    assert resumed["items"] == full["items"]
    timing = ("tps", "wall_s", "compile_s")
    assert ({k: v for k, v in resumed["summary"]["fast-dllm"].items() if k not in timing}
            == {k: v for k, v in full["summary"]["fast-dllm"].items() if k not in timing})
