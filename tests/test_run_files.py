"""A bench run's files are named from the whole ``--json`` name: the runs of a threshold sweep (``r.fd0.7``,
``r.fd0.8``) keep their own items logs and manifests, the table scripts read a folder of runs without mistaking
a manifest for a run, and every file is written with the mode the umask gives (group-readable, not 0600)."""

from __future__ import annotations

import json
import os
import stat

import pytest

from polestar.bench import frontier_table, sweep_table
from polestar.bench.item_log import all_items_paths
from polestar.bench.run_files import items_path, manifest_path, result_files, run_base
from polestar.cli import main
from polestar.output_files import write_atomic

ARGS = ["bench", "--model", "tiny-llada", "--task", "arith", "--policies", "fast-dllm", "--n", "2", "--batch-size", "2",
        "--gen-length", "16", "--block-length", "16", "--quiet"]


@pytest.mark.parametrize("name, base", [
    ("r.fd0.7.json", "r.fd0.7"), ("r.fd0.7", "r.fd0.7"), ("run.json", "run"), ("run", "run"),
    ("a.b.c.d.json", "a.b.c.d"), ("r.json.bak", "r.json.bak"), ("r.JSON", "r.JSON"),
])
def test_the_base_is_the_whole_name_less_a_final_json(tmp_path, name, base):
    out = tmp_path / "sweep.v2" / name  # dots in a folder name change nothing
    assert run_base(out) == tmp_path / "sweep.v2" / base
    assert items_path(out) == tmp_path / "sweep.v2" / f"{base}.items.jsonl"
    assert items_path(out, rank=3, world_size=4) == tmp_path / "sweep.v2" / f"{base}.items.rank3.jsonl"
    assert manifest_path(out) == tmp_path / "sweep.v2" / f"{base}.manifest.json"


def test_names_that_share_a_prefix_never_share_files(tmp_path):
    names = ["r.fd0.7", "r.fd0.8", "r.fd0", "r", "r.items"]
    assert len({items_path(tmp_path / n) for n in names}) == len(names)
    assert len({manifest_path(tmp_path / n) for n in names}) == len(names)
    for path in ("r.items.jsonl", "r.items.rank0.jsonl", "r.items.rank1.jsonl", "r.fd0.items.jsonl",
                 "r.items.items.jsonl", "r.items.jsonl.old-20250101-000000", "r.itemsx.jsonl"):
        (tmp_path / path).write_text("{}\n")
    found = [p.name for p in all_items_paths(tmp_path / "r.json")]
    assert found == ["r.items.jsonl", "r.items.rank0.jsonl", "r.items.rank1.jsonl"]
    assert [p.name for p in all_items_paths(tmp_path / "r.fd0")] == ["r.fd0.items.jsonl"]
    assert [p.name for p in all_items_paths(tmp_path / "r.items.json")] == ["r.items.items.jsonl"]
    assert all_items_paths(tmp_path / "missing-folder" / "r.json") == []


def _run(out, threshold: float) -> int:
    return main([*ARGS, "--set", f"threshold={threshold}", "--json", str(out)])


def test_a_threshold_sweep_keeps_one_items_log_and_manifest_per_run(tmp_path, capsys):
    for t in (0.7, 0.8):
        assert _run(tmp_path / f"r.fd{t}", t) == 0  # no .json: the whole name is the base
    capsys.readouterr()
    for t in (0.7, 0.8):
        lines = (tmp_path / f"r.fd{t}.items.jsonl").read_text().splitlines()
        assert json.loads(lines[0])["header"]["options"] == {"threshold": t} and len(lines) == 1 + 2
        manifest = json.loads((tmp_path / f"r.fd{t}.manifest.json").read_text())
        assert manifest["settings"]["options"] == {"threshold": t}
        assert json.loads((tmp_path / f"r.fd{t}").read_text())["manifest"] == manifest
    # each run resumes from its own items only: 2 finished items, not 4 and not the other threshold's
    assert _run(tmp_path / "r.fd0.7", 0.7) == 2  # finished items: --resume or --overwrite
    assert "r.fd0.7.items.jsonl holds 2 finished items" in capsys.readouterr().err
    assert main([*ARGS, "--set", "threshold=0.7", "--json", str(tmp_path / "r.fd0.7"), "--resume"]) == 0
    assert "reusing 2 finished items" in capsys.readouterr().err


def test_a_folder_of_runs_with_their_manifests_reads_as_runs(tmp_path, capsys):
    for t in (0.7, 0.8):
        assert _run(tmp_path / f"r.fd{t}.json", t) == 0
    assert [p.name for p in result_files(tmp_path)] == ["r.fd0.7.json", "r.fd0.8.json"]
    assert (tmp_path / "r.fd0.7.manifest.json").is_file() and (tmp_path / "r.fd0.8.manifest.json").is_file()
    capsys.readouterr()
    frontier_table.main([str(tmp_path)])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "tiny-llada / arith / n=2 / accuracy–TPF frontier"
    rows = [line for line in out if line.startswith("fast-dllm")]
    assert len(rows) == 2 and "threshold=0.7" in rows[0] and "threshold=0.8" in rows[1]


def test_the_sweep_table_skips_the_manifests(tmp_path, capsys):
    assert main([*ARGS, "--policies", "fast-dllm,elastic-cache", "--json", str(tmp_path / "reference.json")]) == 0
    assert main([*ARGS, "--policies", "polestar-cache", "--set", "refresh.topk=2",
                 "--json", str(tmp_path / "k2.json")]) == 0
    capsys.readouterr()
    sweep_table.main(str(tmp_path))
    out = capsys.readouterr().out
    assert "pc:k2" in out and "manifest" not in out


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_a_run_writes_its_files_with_the_mode_any_tool_would(tmp_path, umask, capsys):
    old = os.umask(umask)
    try:
        assert _run(tmp_path / "r.json", 0.9) == 0
        write_atomic(tmp_path / "plain.txt", "x")
    finally:
        os.umask(old)
    for name in ("r.json", "r.items.jsonl", "r.manifest.json", "plain.txt"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name  # group-readable, not 0600
