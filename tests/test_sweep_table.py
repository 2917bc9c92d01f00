"""bench/sweep_table.py: the Polestar-Cache sweep table is computed from the bench JSON it is given."""

from __future__ import annotations

import json

import pytest

from polestar.bench.sweep_table import format_sweep, main, sweep_rows


def _summary(acc: float, evals: float) -> dict:
    return {"accuracy": acc, "accuracy_ci95": [acc - 0.05, acc + 0.05], "token_layer_evals_per_token": evals}


REFERENCE = {"model": "m", "task": "t", "n": 500,
             "summary": {"fast-dllm": _summary(0.60, 40.0), "elastic-cache": _summary(0.70, 80.0)}}
RUNS = {"default": {"options": {}, "summary": {"polestar-cache": _summary(0.65, 50.0)}},
        "k2": {"options": {"refresh.topk": 2}, "summary": {"polestar-cache": _summary(0.62, 44.0)}}}


def test_rows_are_relative_to_fast_dllm_and_elastic_cache():
    rows = {r["name"]: r for r in sweep_rows(REFERENCE, RUNS)}
    assert list(rows) == ["fast-dllm", "elastic-cache", "pc:default", "pc:k2"]
    assert rows["fast-dllm"]["evals_ratio"] == 1.0 and rows["fast-dllm"]["vs_fast"] == 0.0
    assert rows["pc:default"]["evals_ratio"] == pytest.approx(1.25)
    assert rows["pc:default"]["vs_fast"] == pytest.approx(5.0)
    assert rows["pc:default"]["vs_elastic"] == pytest.approx(-5.0)
    assert rows["pc:k2"]["options"] == "topk=2"  # the stage prefix is dropped
    text = format_sweep("title", list(rows.values()))
    assert "pc:k2" in text and "+2.0" in text and "1.10" in text


def test_main_reads_a_sweep_directory(tmp_path, capsys):
    (tmp_path / "reference.json").write_text(json.dumps(REFERENCE))
    for label, res in RUNS.items():
        (tmp_path / f"{label}.json").write_text(json.dumps(res))
    main(str(tmp_path))
    out = capsys.readouterr().out
    assert out.startswith("m / t / n=500") and "pc:default" in out and "pc:k2" in out
