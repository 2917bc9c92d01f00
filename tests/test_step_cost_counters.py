"""The step-cost counters (weight bytes, K/V bytes, proxy query rows) wherever the run counters are reported:
``polestar bench`` summaries and table, and the lm-eval counters; every sum equals ``RunStats.merge`` of the
batches' own counters. The engine's values are replaced by synthetic ones, so the sums are checked with nonzero,
uneven counts whatever the engine fills in."""

from __future__ import annotations

import attrs
import pytest

import polestar
from polestar.bench import harness
from polestar.evaluation.counters import DecodingCounters
from polestar.stats import RunStats, SequenceStats
from polestar.tasks import get_task


def _with_costs(stats: RunStats, salt: int) -> RunStats:
    """``stats`` with uneven synthetic step-cost counters (not multiples of any batch size)."""
    return attrs.evolve(stats, weight_bytes=1_000_003 * stats.nfe + salt, kv_bytes=7_919 * stats.nfe + 2 * salt,
                        proxy_query_evals=31 * stats.nfe + salt)


@pytest.fixture(scope="module")
def tiny_llada():
    return polestar.load("tiny-llada")


@pytest.fixture
def batches(monkeypatch):
    """Patch the harness's ``generate`` to give synthetic step-cost counters; returns the list of each batch's
    ``RunStats`` as returned."""
    seen: list[RunStats] = []
    real = harness.polestar.generate

    def generate(*args, **kwargs):
        out = real(*args, **kwargs)
        out = attrs.evolve(out, stats=_with_costs(out.stats, len(seen) + 1))
        seen.append(out.stats)
        return out

    monkeypatch.setattr(harness.polestar, "generate", generate)
    return seen


def test_split_evenly_sums_to_the_total():
    assert harness.split_evenly(10, 3) == [4, 3, 3]
    assert harness.split_evenly(2, 4) == [1, 1, 0, 0]
    assert sum(harness.split_evenly(1_000_003, 7)) == 1_000_003


def test_bench_summary_sums_equal_the_merged_batches(tiny_llada, batches):
    task = get_task("arith")
    problems = harness.load_problems("arith", 5)
    decoding = dict(gen_length=32, block_length=16, steps=None, temperature=0.0, seed=0)
    _, summary = harness.run_policy(tiny_llada, task, problems, "polestar", {}, decoding, batch_size=3)
    assert len(batches) == 2  # batches of 3 and 2
    merged = RunStats.merge(batches)
    assert summary["steps"] == merged.nfe
    assert summary["weight_bytes"] == merged.weight_bytes
    assert summary["kv_bytes"] == merged.kv_bytes
    assert summary["proxy_query_evals"] == merged.proxy_query_evals
    assert summary["weight_bytes_per_token"] == pytest.approx(merged.weight_bytes_per_token)
    assert summary["weight_bytes_per_step"] == pytest.approx(merged.weight_bytes_per_step)
    assert summary["kv_bytes_per_token"] == pytest.approx(merged.kv_bytes / merged.tokens)
    assert summary["proxy_query_evals_per_token"] == pytest.approx(merged.proxy_query_evals / merged.tokens)


def _summary(**costs) -> dict:
    return {"accuracy": 0.5, "accuracy_ci95": [0.4, 0.6], "tpf": 2.0, "tps": 10.0, "nfe": 8.0,
            "token_layer_evals_per_token": 12.0, **costs}


def test_table_shows_the_cost_columns_when_the_summaries_carry_them():
    new = _summary(weight_bytes_per_token=2.5e9, weight_bytes_per_step=1.6e10, kv_bytes_per_token=3.2e6,
                   proxy_query_evals_per_token=40.0)
    table = harness.format_table({"polestar": new}, "t")
    head, row = table.splitlines()[1], table.splitlines()[3]
    assert head.split()[-4:] == ["W/tok", "W/step", "KV/tok", "proxy/tok"]
    assert row.split()[-4:] == ["2.5G", "16.0G", "3.2M", "40"]
    old = harness.format_table({"polestar": _summary()}, "t")  # a summary from before these counters
    assert old.splitlines()[1].split()[-2:] == ["evals/tok", "NFE"]


def _run(nfe: int, tokens: int, salt: int) -> RunStats:
    seqs = (SequenceStats(nfe, tokens // 2, 10), SequenceStats(nfe, tokens - tokens // 2, 10))
    return _with_costs(RunStats(nfe, tokens, 0.5, 20, seqs), salt)


def test_lm_eval_counters_sum_the_runs():
    runs = [_run(8, 30, 1), _run(5, 11, 2), _run(3, 7, 3)]
    counters = DecodingCounters()
    for r in runs:
        counters.add(r)
    merged = RunStats.merge(runs)
    d = DecodingCounters.total([counters, DecodingCounters()]).as_dict()
    assert (d["weight_bytes"], d["kv_bytes"], d["proxy_query_evals"]) == (
        merged.weight_bytes, merged.kv_bytes, merged.proxy_query_evals)
    assert d["weight_bytes_per_token"] == pytest.approx(merged.weight_bytes_per_token)
    assert d["weight_bytes_per_step"] == pytest.approx(merged.weight_bytes_per_step)
    assert d["kv_bytes_per_token"] == pytest.approx(merged.kv_bytes / merged.tokens)
    assert d["proxy_query_evals_per_token"] == pytest.approx(merged.proxy_query_evals / merged.tokens)
