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
    assert out["polestar-commit"]["label"] == "polestar-commit[alpha=Infinity]"  # rows name their overrides
    assert "polestar-commit[alpha=Infinity]" in format_anatomy(out, "t")


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


def test_right_counts_never_exceed_commits(anatomy):
    for row in anatomy.values():
        for origin in ("confident", "top1_below_tau", "other_below_tau", "suffix"):
            assert 0 <= row[f"right_{origin}"] <= row[origin]
    assert "equal to the reference" in format_anatomy(anatomy, "t")


def test_right_counts_compare_each_commit_with_the_reference_at_its_column():
    import torch

    from polestar.bench.anatomy import CommitRecorder
    from polestar.state import CommitOrigins, StepRecord, SuffixCommit

    # prompt of 2 columns, generation of 4 (block = columns 2..3, then a suffix column 5); reference gen 7 8 9 9
    recorder = CommitRecorder(0.9, 0.7)
    recorder.reference = torch.tensor([[7, 8, 9, 9]])
    before = torch.tensor([[1, 1, 0, 0, 0, 0]])
    after = torch.tensor([[1, 1, 7, 5, 0, 9]])  # column 2 right (confident), 3 wrong (early, below τ), 5 right
    conf = torch.tensor([[0.95, 0.6]], dtype=torch.float64)
    masked = torch.tensor([[True, True]])
    rule = torch.tensor([[True, True]])
    forced = torch.tensor([[False, False]])
    suffix = SuffixCommit(torch.tensor([[5]]), torch.tensor([[9]]), torch.tensor([[0.95]]), torch.tensor([[True]]))
    origins = CommitOrigins(rule, forced, None, None, suffix)
    recorder(StepRecord(0, 0, 0, 2, 4, None, torch.tensor([True]), masked, conf, before, after,
                        after != before, origins))
    c = recorder.counts
    assert (c["confident"], c["right_confident"]) == (1, 1)
    assert (c["other_below_tau"], c["right_other_below_tau"]) == (1, 0)
    assert (c["suffix"], c["right_suffix"]) == (1, 1)
