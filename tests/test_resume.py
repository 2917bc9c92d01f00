"""`polestar bench` keeps finished items beside --json and resumes an interrupted run to the same result."""

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

from polestar.bench import harness
from polestar.bench.harness import format_table, run_bench
from polestar.bench.item_log import check_previous, items_path
from polestar.bench.manifest import manifest_path
from polestar.cli import main
from polestar.output_files import check_writable

DECODING = dict(gen_length=32, block_length=16, steps=None, temperature=0.0, seed=0, stop_at_eos=True, compile=False)
POLICIES = ["parallel", "fast-dllm"]
ARGS = dict(batch_size=2, show_progress=False)


def _run(json_out, resume=False):
    return run_bench("tiny-llada", "arith", POLICIES, 6, {}, DECODING, json_out=str(json_out), resume=resume, **ARGS)


def _without_time(summary):
    return {p: {k: v for k, v in s.items() if k not in ("tps", "wall_s")} for p, s in summary.items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("full") / "full.json")


def test_killed_run_resumes_to_the_same_table(tmp_path, monkeypatch, uninterrupted):
    out = tmp_path / "run.json"
    real, calls = harness.decode_batch, []

    def dies_after_four_batches(*args, **kwargs):
        if len(calls) == 4:
            raise KeyboardInterrupt("killed")
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(harness, "decode_batch", dies_after_four_batches)
    with pytest.raises(KeyboardInterrupt):
        _run(out)
    lines = items_path(out).read_text().splitlines()
    assert len(lines) == 1 + 4 * 2  # header + four batches of two
    with items_path(out).open("a") as f:
        f.write('{"policy": "fast-dllm", "ind')  # a line cut short by the kill

    calls.clear()
    monkeypatch.setattr(harness, "decode_batch", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    resumed = _run(out, resume=True)
    assert len(calls) == 2  # only the batches that were not finished: 6 batches in all
    assert resumed["items"] == uninterrupted["items"]
    assert _without_time(resumed["summary"]) == _without_time(uninterrupted["summary"])
    def table(summary):  # the printed table, with the wall-clock column (TPS) zeroed
        return format_table({p: dict(s, tps=0.0) for p, s in summary.items()}, "t")

    assert table(resumed["summary"]) == table(uninterrupted["summary"])


def test_resume_refuses_other_settings(tmp_path):
    out = tmp_path / "run.json"
    items_path(out).write_text(json.dumps({"header": {"model": "tiny-llada", "n": 99}}) + "\n")
    with pytest.raises(ValueError, match="other settings.*n"):
        _run(out, resume=True)


def test_without_resume_finished_items_are_kept(tmp_path, uninterrupted):
    out = tmp_path / "run.json"
    items_path(out).write_text(json.dumps({"header": {"stale": True}}) + "\n"
                               + json.dumps({"policy": "parallel", "index": 0}) + "\n")
    with pytest.raises(ValueError, match="holds 1 finished items.*--resume.*--overwrite"):
        _run(out)
    result = run_bench("tiny-llada", "arith", POLICIES, 6, {}, DECODING, json_out=str(out), overwrite=True, **ARGS)
    assert result["items"] == uninterrupted["items"]
    lines = items_path(out).read_text().splitlines()
    assert "stale" not in lines[0] and len(lines) == 1 + 2 * 6
    (old,) = tmp_path.glob("run.items.jsonl.old-*")
    assert "stale" in old.read_text()


def test_output_paths_checked_before_decoding(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(harness, "run_bench", lambda *a, **k: pytest.fail("decoded before checking the outputs"))
    (tmp_path / "o.items.jsonl").mkdir()  # the items file beside --json cannot be written
    code = main(["bench", "--n", "2", "--json", str(tmp_path / "o.json")])
    assert code == 2
    assert f"{tmp_path / 'o.items.jsonl'} is a folder" in capsys.readouterr().err
    code = main(["bench", "--n", "2", "--plot", str(tmp_path)])
    assert code == 2 and "is a directory" in capsys.readouterr().err
    code = main(["bench", "--n", "2", "--resume"])
    assert code == 2 and "--resume needs --json" in capsys.readouterr().err
    check_writable([tmp_path / "ok.json", None])  # a writable path passes
    with pytest.raises(ValueError, match="folder .*missing does not exist"):
        check_writable([tmp_path / "missing" / "o.json"])


def test_resume_refuses_an_edited_plugin_and_the_manifest_records_its_digest(tmp_path, isolated_registry, capsys):
    from tests.test_plugins import HELLINGER

    plugin = tmp_path / "hellinger_resumed.py"
    plugin.write_text(HELLINGER.format(name="hellinger"))
    out = tmp_path / "run.json"
    args = ["bench", "--plugin", str(plugin), "--policies", "polestar", "--set", "drift=hellinger", "--n", "4",
            "--batch-size", "2", "--gen-length", "16", "--block-length", "16", "--quiet", "--json", str(out)]
    assert main(args) == 0
    digest = "sha256:" + hashlib.sha256(plugin.read_bytes()).hexdigest()
    manifest = json.loads((tmp_path / "run.manifest.json").read_text())
    assert manifest["plugins"] == {str(plugin.resolve()): digest} and "plugins" not in manifest["settings"]
    assert json.loads(items_path(out).read_text().splitlines()[0])["header"]["plugins"] == manifest["plugins"]
    capsys.readouterr()
    assert main([*args, "--resume"]) == 0  # the same file: its items are reused
    assert "reusing 4 finished items" in capsys.readouterr().err
    plugin.write_text(HELLINGER.format(name="hellinger").replace("h.mean(dim=1)", "h.amax(dim=1)"))
    assert main([*args, "--resume"]) == 2  # edited: one line, before any work
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --resume: plugin {plugin.resolve()} changed (sha256:"), err
    assert "--overwrite" in err[0]


# ----------------------------------------------------------------------------------------------- timing settings


@pytest.fixture
def threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_resume_refuses_items_timed_with_other_threads_unless_any_timing(tmp_path, threads_restored):
    out = tmp_path / "run.json"
    torch.set_num_threads(2)
    first = _run(out)
    torch.set_num_threads(1)
    with pytest.raises(ValueError, match=r"^--resume: the finished items in .* were timed with other settings "
                                         r"\(threads: 2 -> 1\).*--resume-any-timing") as err:
        _run(out, resume=True)
    assert "\n" not in str(err.value)
    mixed = run_bench("tiny-llada", "arith", POLICIES, 6, {}, DECODING, json_out=str(out), resume=True,
                      resume_any_timing=True, **ARGS)
    assert mixed["items"] == first["items"]
    timings = {"mixed": True, "differences": ["threads: 2 -> 1"]}
    assert mixed["timings"] == timings and mixed["manifest"]["timings"] == timings
    assert json.loads(manifest_path(out).read_text())["timings"] == timings
    assert all(s["timings"] == timings for s in mixed["summary"].values())
    assert first["timings"] == {"mixed": False, "differences": []} and "timings" not in first["summary"]["parallel"]


@pytest.mark.parametrize("change, named", [
    ({"threads": 3}, "threads: 1 -> 3"), ({"decoding": dict(DECODING, compile=True)}, "compile: false -> true"),
    ({"device": "cuda"}, 'device: "cpu" -> "cuda"'), ({"dtype": "bfloat16"}, 'dtype: "float32" -> "bfloat16"'),
    ({"batch_size": 4}, "batch_size: 2 -> 4"),
], ids=["threads", "compile", "device", "dtype", "batch_size"])
def test_each_timing_setting_is_named_with_both_values(tmp_path, change, named):
    header = harness.run_header("tiny-llada", "arith", 6, None, DECODING, {}, 2, "float32", "cpu", threads=1)
    out = tmp_path / "run.json"
    items_path(out).write_text(json.dumps({"header": header}) + "\n"
                               + json.dumps({"policy": "parallel", "index": 0}) + "\n")
    new = {**header, **change}
    with pytest.raises(ValueError, match=re.escape(f"({named})")):
        check_previous(out, new, resume=True, overwrite=False)
    assert check_previous(out, new, resume=True, overwrite=False, any_timing=True).mixed_timing == (named,)
    other = {**new, "n": 7}  # a setting that decides the items is refused even with any_timing
    with pytest.raises(ValueError, match="other settings.*n: 6 -> 7"):
        check_previous(out, other, resume=True, overwrite=False, any_timing=True)
    assert check_previous(out, header, resume=True, overwrite=False).mixed_timing == ()


def test_cli_names_the_timing_setting_in_one_line(tmp_path, capsys):
    out = str(tmp_path / "r.json")
    base = ["bench", "--policies", "fast-dllm", "--n", "2", "--gen-length", "16", "--block-length", "8", "--quiet",
            "--json", out]
    assert main([*base, "--batch-size", "1"]) == 0
    capsys.readouterr()
    assert main([*base, "--batch-size", "2", "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "(batch_size: 1 -> 2)" in err[0] and "--resume-any-timing" in err[0], err
    assert main([*base, "--batch-size", "2", "--resume-any-timing"]) == 2
    assert "--resume-any-timing goes with --resume" in capsys.readouterr().err
    assert main([*base, "--batch-size", "2", "--resume", "--resume-any-timing"]) == 0
    captured = capsys.readouterr()
    assert "timings mixed (--resume-any-timing: reused items were timed with batch_size: 1 -> 2)" in captured.out
    assert "resume: timings mixed (batch_size: 1 -> 2)" in captured.err
    assert json.loads(Path(out).read_text())["timings"]["mixed"] is True
