"""bench/frontier_table.py: the frontier table lists every (run, policy) point from the bench JSON it is given."""

from __future__ import annotations

import json

from polestar.bench.frontier_table import format_frontier, frontier_rows, main


def _summary(acc: float, tpf: float, evals: float) -> dict:
    return {"accuracy": acc, "accuracy_ci95": [acc - 0.05, acc + 0.05], "tpf": tpf,
            "token_layer_evals_per_token": evals}


RUNS = {
    "tau-0.9": {"model": "m", "task": "t", "n": 500, "options": {"threshold": 0.9},
                "summary": {"fast-dllm": _summary(0.8, 2.0, 40.0), "parallel": _summary(0.82, 1.9, 160.0)}},
    "tau-0.5": {"model": "m", "task": "t", "n": 500, "options": {"threshold": 0.5},
                "summary": {"fast-dllm": _summary(0.6, 5.0, 20.0), "parallel": _summary(0.61, 4.8, 70.0)}},
    "adaptive": {"model": "m", "task": "t", "n": 500, "options": {},
                 "summary": {"polestar": _summary(0.79, 3.0, 30.0)}},
}


def test_rows_put_the_threshold_sweeps_first_in_threshold_order():
    rows = frontier_rows(RUNS)
    assert [(r["policy"], r["threshold"]) for r in rows] == [
        ("fast-dllm", 0.5), ("fast-dllm", 0.9), ("parallel", 0.5), ("parallel", 0.9), ("polestar", None)]
    assert rows[0]["tpf"] == 5.0 and rows[-1]["options"] == ""
    text = format_frontier("title", rows)
    assert "threshold=0.5" in text and "79.0% [ 74.0, 84.0]" in text


def test_main_reads_a_directory_and_draws_the_plot(tmp_path, capsys):
    for label, res in RUNS.items():
        (tmp_path / f"{label}.json").write_text(json.dumps(res))
    plot = tmp_path / "frontier.png"
    main([str(tmp_path), "--plot", str(plot)])
    out = capsys.readouterr().out
    assert out.startswith("m / t / n=500") and out.count("\n") == 3 + len(frontier_rows(RUNS))
    assert plot.stat().st_size > 1000
