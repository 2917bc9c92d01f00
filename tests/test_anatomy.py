"""Commit anatomy (`polestar anatomy`): its counts against invariants of block decoding."""

import json

import pytest

from polestar.bench.anatomy import BIN_LABELS, commit_anatomy, format_anatomy
from polestar.cli import main

DECODING = dict(gen_length=32, block_length=16, steps=None, temperature=0.0, seed=0, stop_at_eos=False)
N = 6


@pytest.fixture(scope="module")
def anatomy():
    return commit_anatomy("tiny-llada", "arith", ["fast-dllm", "polestar", "eb"], N, {}, DECODING, batch_size=4)


def test_bins_partition_candidates(anatomy):
    for row in anatomy.values():
        assert sum(row[b] for b in BIN_LABELS) == row["candidates"]
        assert row["row_steps"] > 0


def test_every_position_committed_once_without_eos_stop(anatomy):
    # without the EOS stop every generated position is committed exactly once, in its block or as a suffix commit
    for row in anatomy.values():
        assert row["confident"] + row["top1_below_tau"] + row["other_below_tau"] + row["suffix"] == N * 32


def test_threshold_rule_commits_below_tau_only_as_top1(anatomy):
    assert anatomy["fast-dllm"]["other_below_tau"] == 0
    assert anatomy["fast-dllm"]["suffix"] == 0
    assert anatomy["polestar"]["delta_passed_gate"] <= anatomy["polestar"]["band_with_delta"]
    assert "band_with_delta" not in anatomy["eb"]


def test_infinite_alpha_adds_no_early_commits():
    out = commit_anatomy("tiny-llada", "arith", ["polestar-commit"], 4, {"alpha": float("inf")}, DECODING)
    assert out["polestar-commit"]["other_below_tau"] == 0
    assert out["polestar-commit"]["delta_passed_gate"] == 0


def test_table_and_cli(anatomy, tmp_path, capsys):
    table = format_anatomy(anatomy, "t")
    assert all(name in table for name in anatomy)
    out = tmp_path / "a.json"
    assert main(["anatomy", "--task", "arith", "--policies", "fast-dllm", "--n", "2", "--gen-length", "32",
                 "--no-stop-at-eos", "--json", str(out)]) == 0
    assert "fast-dllm" in capsys.readouterr().out
    row = json.loads(out.read_text())["fast-dllm"]
    assert row["confident"] + row["top1_below_tau"] == 2 * 32


def test_bad_arguments_fail_before_decoding(capsys):
    assert main(["anatomy", "--policies", "nope", "--n", "2"]) == 2
    assert "unknown policy" in capsys.readouterr().err
    with pytest.raises(ValueError, match="at least 1"):
        commit_anatomy("tiny-llada", "arith", ["fast-dllm"], 0, {}, DECODING)
