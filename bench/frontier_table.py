"""Table and plot of the accuracy–TPF frontier from a ``bench/run_frontier.sh`` directory.

``python bench/frontier_table.py runs/frontier/tiny-llada-noisy-arith --plot out.png``. Every ``*.json`` in the
directory (but the runs' manifests) is one ``polestar bench --json`` run; each of its policies becomes one point,
labelled by the policy and the ``--set`` options of the run. Rows: accuracy with its 95% Wilson interval, tokens
per forward (TPF) and token-layer evaluations per generated token. The plot has two panels (accuracy against TPF
and against evaluations per token), with the interval as error bars; the threshold sweeps of ``fast-dllm`` and
``parallel`` are drawn as curves with their thresholds placed so that no two labels overlap
(:mod:`~polestar.bench.plot_labels`), every other run as a point with its own marker, named in the legend below
the panels.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from polestar.bench.plot_labels import place_labels
from polestar.bench.run_files import result_files, run_base
from polestar.bench.sweep_table import accuracy_cell
from polestar.output_files import write_atomic

#: markers of the single points, cycled (the colours follow matplotlib's cycle)
MARKERS = ("s", "D", "^", "v", "P", "X", "<", ">", "p", "h")

SWEPT = ("fast-dllm", "parallel")


def frontier_rows(runs: dict[str, dict]) -> list[dict]:
    """One row per (run, policy): ``runs`` maps a run label to its bench JSON."""
    rows = []
    for _label, res in runs.items():
        options = res.get("options", {})
        for policy, s in res["summary"].items():
            opts = " ".join(f"{k}={v}" for k, v in options.items())
            rows.append({
                "policy": policy, "options": opts, "threshold": options.get("threshold"),
                "accuracy": s["accuracy"], "ci": s["accuracy_ci95"], "tpf": s["tpf"],
                "evals": s["token_layer_evals_per_token"], "n": res["n"],
            })
    rows.sort(key=lambda r: (r["policy"] not in SWEPT, r["policy"], r["threshold"] or 0.0, r["options"]))
    return rows


def format_frontier(title: str, rows: list[dict]) -> str:
    w = max([16, *(len(r["policy"]) + 2 for r in rows)])  # a --policies entry with settings of its own is longer
    head = f"{'policy':<{w}}{'options':<18}{'accuracy':>23}{'TPF':>7}{'evals/tok':>11}"
    lines = [title, head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['policy']:<{w}}{r['options'] or '-':<18}{accuracy_cell(r):>23}"
                     f"{r['tpf']:>7.2f}{r['evals']:>11.1f}")
    return "\n".join(lines)


def frontier_plot(rows: list[dict], path: str, title: str) -> None:
    """Two panels: accuracy (95% interval as error bars) against TPF and against evaluations per token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.8), sharey=True)
    singles = [r for r in rows if r["policy"] not in SWEPT]
    for ax, key, xlabel in ((axes[0], "tpf", "tokens per forward (TPF)"),
                            (axes[1], "evals", "token-layer evaluations per token")):
        sweep_pts = []
        for policy in SWEPT:
            pts = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["threshold"] or 0.0)
            if not pts:
                continue
            xs = [r[key] for r in pts]
            ys = [100 * r["accuracy"] for r in pts]
            err = [[100 * (r["accuracy"] - r["ci"][0]) for r in pts], [100 * (r["ci"][1] - r["accuracy"]) for r in pts]]
            ax.errorbar(xs, ys, yerr=err, marker="o", ms=3, capsize=2, label=f"{policy} (τ sweep)")
            sweep_pts += [(x, y, f"{r['threshold']}") for r, x, y in zip(pts, xs, ys)]
        for i, r in enumerate(singles):
            y = 100 * r["accuracy"]
            label = r["policy"] + (f" {r['options']}" if r["options"] else "")
            ax.errorbar([r[key]], [y], yerr=[[y - 100 * r["ci"][0]], [100 * r["ci"][1] - y]],
                        marker=MARKERS[i % len(MARKERS)], ms=5, capsize=2, linestyle="none", label=label)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if sweep_pts:
            xs, ys, texts = zip(*sweep_pts)
            place_labels(ax, xs, ys, texts, fontsize=6,
                         avoid=[(r[key], 100 * r["accuracy"]) for r in singles])
    axes[0].set_ylabel("accuracy (%), 95% interval")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=min(4, max(len(labels), 1)), frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.06 + 0.035 * ((len(labels) - 1) // 4), 1, 1))
    write_atomic(path, writer=lambda tmp: fig.savefig(tmp, dpi=120, format=Path(path).suffix.lstrip(".") or "png"))
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory")
    p.add_argument("--plot", default=None, metavar="OUT.png")
    args = p.parse_args(argv)
    d = Path(args.directory)
    runs = {run_base(f).name: json.loads(f.read_text()) for f in result_files(d)}  # not the runs' manifests
    if not runs:
        raise SystemExit(f"error: no bench JSON in {d}; run bench/run_frontier.sh first")
    first = next(iter(runs.values()))
    title = f"{first['model']} / {first['task']} / n={first['n']} / accuracy–TPF frontier"
    rows = frontier_rows(runs)
    print(format_frontier(title, rows))
    if args.plot:
        frontier_plot(rows, args.plot, title)


if __name__ == "__main__":
    main()
