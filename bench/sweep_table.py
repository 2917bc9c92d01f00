"""One table from a ``bench/run_sweep.sh`` directory: ``python bench/sweep_table.py runs/sweep/tiny-llada-sudoku``.

``reference.json`` holds the reference policies (``fast-dllm``, ``elastic-cache``, ...); every other ``*.json``
is one ``polestar-cache`` run, labelled by its file name (the runs' ``*.manifest.json`` are not runs), with its
``--set`` options. Rows give accuracy with its 95% interval, token-layer evaluations per generated token, their
ratio to ``fast-dllm``'s, and the accuracy difference to ``fast-dllm`` and to ``elastic-cache``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from polestar.bench.harness import text_table
from polestar.bench.run_files import result_files, run_base


def sweep_rows(reference: dict, runs: dict[str, dict]) -> list[dict]:
    """Rows of the table: the reference policies first, then each run (``label -> bench JSON``) in order."""
    ref = reference["summary"]
    fast, elastic = ref["fast-dllm"], ref["elastic-cache"]
    rows = []
    entries = [(name, s, "") for name, s in ref.items()]
    for label, res in runs.items():
        (s,) = res["summary"].values()
        opts = " ".join(f"{k.removeprefix('refresh.')}={v}" for k, v in res.get("options", {}).items())
        entries.append((f"pc:{label}", s, opts))
    for name, s, opts in entries:
        rows.append({
            "name": name, "options": opts, "accuracy": s["accuracy"], "ci": s["accuracy_ci95"],
            "evals": s["token_layer_evals_per_token"],
            "evals_ratio": s["token_layer_evals_per_token"] / fast["token_layer_evals_per_token"],
            "vs_fast": 100 * (s["accuracy"] - fast["accuracy"]),
            "vs_elastic": 100 * (s["accuracy"] - elastic["accuracy"]),
        })
    return rows


def accuracy_cell(row: dict) -> str:
    """``row["accuracy"]`` and its interval ``row["ci"]`` as ``"97.6% [ 95.9, 98.6]"``."""
    return f"{100 * row['accuracy']:.1f}% [{100 * row['ci'][0]:5.1f},{100 * row['ci'][1]:5.1f}]"


def format_sweep(title: str, rows: list[dict]) -> str:
    head = f"{'run':<16}{'accuracy':>22}{'evals/tok':>11}{'× fast':>8}{'Δ fast':>8}{'Δ elastic':>10}  options"
    return text_table(title, head, (
        f"{r['name']:<16}{accuracy_cell(r):>22}{r['evals']:>11.1f}{r['evals_ratio']:>8.2f}{r['vs_fast']:>+8.1f}"
        f"{r['vs_elastic']:>+10.1f}  {r['options']}" for r in rows))


def main(directory: str) -> None:
    d = Path(directory)
    reference = json.loads((d / "reference.json").read_text())
    runs = {run_base(f).name: json.loads(f.read_text())
            for f in sorted(result_files(d), key=lambda f: f.stat().st_mtime) if f.name != "reference.json"}
    title = f"{reference['model']} / {reference['task']} / n={reference['n']} / polestar-cache (pc) sweep"
    print(format_sweep(title, sweep_rows(reference, runs)))


if __name__ == "__main__":
    main(sys.argv[1])
