"""bench/render_results.py and the plot of bench/harness.py: summaries without per-item records, the gains over
fast-dllm computed from the summaries, hand-written parts of the page kept, 95% intervals drawn."""

from __future__ import annotations

import json

import matplotlib.axes
import pytest

from polestar.bench import harness
from polestar.bench import render_results as rr


def _policy(acc: float, ci: tuple[float, float], tpf: float, evals: float) -> dict:
    return {"accuracy": acc, "accuracy_ci95": list(ci), "tpf": tpf, "tps": 1.0, "nfe": 4.0,
            "token_layer_evals_per_token": evals, "n": 100, "wall_s": 1.0}


def _result(task: str, threshold: float | None = None, **summary) -> dict:
    return {"model": "tiny-m", "task": task, "n": 100, "decoding": {"gen_length": 64, "block_length": 16},
            "options": {} if threshold is None else {"threshold": threshold},
            "items": [{"id": i, "correct": True} for i in range(3)], "summary": summary, "date": "today"}


RESULT = _result("arith", **{
    "fast-dllm": _policy(0.80, (0.71, 0.87), 4.0, 40.0),
    "polestar": _policy(0.78, (0.69, 0.85), 5.0, 50.0),
    "baseline": _policy(0.99, (0.95, 1.0), 0.5, 400.0),
})


def test_summaries_drop_the_per_item_records(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    raw.mkdir()
    out.mkdir()
    (raw / "tiny-m-arith.json").write_text(json.dumps(RESULT))
    (raw / "notes.json").write_text(json.dumps({"not": "a bench result"}))
    written = rr.write_summaries(raw, out)
    assert [p.name for p in written] == ["tiny-m-arith.summary.json"]
    kept = json.loads(written[0].read_text())
    assert "items" not in kept and kept["summary"] == RESULT["summary"] and kept["n"] == 100
    assert rr.write_summaries(out, out) == []  # summaries are not summarized again
    assert rr.table_name(written[0]) == "tiny-m-arith"


def test_gains_table_is_relative_to_fast_dllm():
    t05 = _result("arith", 0.5, parallel=_policy(0.5, (0.4, 0.6), 9.0, 10.0))  # other threshold: not a row
    table = rr.gains_table([RESULT, t05])
    lines = table.strip().splitlines()
    assert lines[0] == "| model / task | `polestar` | `baseline` |"
    assert len(lines) == 3
    # polestar: TPF 5/4, accuracy 78 - 80 points, evaluations 50/40; intervals overlap
    assert "| tiny-m arith | 1.25× · -2.0 · 1.25× | 0.12× · +19.0 [≠] · 10.00× |" == lines[2]


def test_render_keeps_the_hand_written_parts_and_draws_plots(tmp_path):
    (tmp_path / "tiny-m-arith.summary.json").write_text(json.dumps(rr.summarize(RESULT)))
    (tmp_path / "tiny-m-arith-anatomy.txt").write_text("anatomy table")
    old = f"# Results\n{rr.SUMMARY_MARKER}\nWe found X.\n{rr.SUMMARY_END}\nold tables\n{rr.NOTES_MARKER}\nNotes Y.\n"
    page = rr.render(old, tmp_path)
    assert page.startswith(f"# Results\n\n{rr.SUMMARY_MARKER}\nWe found X.\n{rr.SUMMARY_END}\n")
    assert page.endswith(f"{rr.NOTES_MARKER}\nNotes Y.\n") and "old tables" not in page
    assert page.index("1.25× · -2.0 · 1.25×") < page.index("## Setup") < page.index("## tiny-m — arith")
    assert "anatomy table" in page and "![tiny-m-arith](results/tiny-m-arith.png)" in page
    assert (tmp_path / "tiny-m-arith.png").stat().st_size > 0
    assert rr.render(page, tmp_path, plots=False) == page  # rendering is idempotent


def test_plot_error_bars_are_the_wilson_intervals(tmp_path, monkeypatch):
    calls = []
    original = matplotlib.axes.Axes.errorbar

    def record(self, x, y, yerr=None, **kw):
        calls.append((x, y, yerr))
        return original(self, x, y, yerr=yerr, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar", record)
    harness.pareto_plot(RESULT["summary"], str(tmp_path / "p.png"), "title")
    got = {round(x, 3): (y, yerr[0][0], yerr[1][0]) for x, y, yerr in calls}  # (accuracy, below, above)
    assert got[4.0] == pytest.approx((80.0, 9.0, 7.0))
    assert got[5.0] == pytest.approx((78.0, 9.0, 7.0))
    assert got[0.5] == pytest.approx((99.0, 4.0, 1.0))


def test_render_lists_frontier_tables_with_their_plots(tmp_path):
    (tmp_path / "tiny-m-noisy-arith-frontier.txt").write_text("frontier table")
    (tmp_path / "tiny-m-noisy-arith-frontier.png").write_bytes(b"png")
    (tmp_path / "tiny-m-noisy-sudoku-frontier.txt").write_text("frontier table without plot")
    page = rr.render(None, tmp_path, plots=False)
    assert page.index("## Calibrated checkpoints") < page.index("frontier table")
    assert "![tiny-m-noisy-arith-frontier](results/tiny-m-noisy-arith-frontier.png)" in page
    assert "tiny-m-noisy-sudoku-frontier.png" not in page
