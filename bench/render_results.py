"""Render docs/results.md and its plots from the results of bench/run_results.sh, bench/run_agreement.sh and
bench/run_sweep.sh.

``python bench/render_results.py [--raw runs/results]``: every bench JSON in ``--raw`` (the per-item results
``polestar bench --json`` writes under the ignored ``runs/``) is reduced to its per-policy summary,
``docs/results/<name>.summary.json`` (no per-item records); the page is then rendered from the summaries and the
text tables in ``docs/results/``, and each table with more than one policy gets its accuracy–TPF plot
(``<name>.png``, 95% intervals as error bars). The page opens with the hand-written summary (between
``SUMMARY_MARKER`` and ``SUMMARY_END``) and the generated gains over ``fast-dllm``; the hand-written notes below
``NOTES_MARKER`` are kept as well.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from polestar.bench.harness import format_table, pareto_plot

RESULTS = Path("docs/results")
PAGE = Path("docs/results.md")
REFERENCE_POLICY = "fast-dllm"
SUMMARY_SUFFIX = ".summary.json"

SUMMARY_MARKER = "<!-- summary: written by hand, kept by render_results.py -->"
SUMMARY_END = "<!-- end of summary -->"
NOTES_MARKER = "<!-- notes: everything below is written by hand and kept by render_results.py -->"

HEADER = """## Setup

Measured on this project's CPU machine (2 cores, shared), with the shipped checkpoints `tiny-llada` and
`tiny-dream` (≈1M parameters, trained on 1 CPU thread in seven and six stages, 4.2 and 3.75 hours in all; see
their model cards), greedy decoding, generation length 64 in 4 blocks of 16, `threshold` 0.9 unless stated,
n = {n} test problems per task. Every table of this page comes from one of these commands (run from the
repository root; each writes its text tables into `docs/results/` and its per-item results under the ignored
`runs/`; the times are one process on one core of this shared machine, measured or scaled from a measured run
as stated in `docs/log.md`):

```bash
bash bench/run_results.sh {n}        # Table 1, the eight model / task tables, threshold 0.5, commit anatomy: ~30 min
bash bench/run_agreement.sh {n}      # lossy stages, token agreement (clean and noisy checkpoints): ~12 min
bash bench/run_sweep.sh {n}          # Polestar-Cache recompute budget: ~15 min
bash bench/run_frontier.sh {n}       # calibrated checkpoints, frontier, anatomy: ~54 min (cells of 11-16 min)
bash bench/run_side_by_side.sh 100   # the policy side of the two side-by-side tables: ~5 min
python bench/render_results.py --raw runs/results   # summaries, plots, this page: ~10 s
```

The first four take the variables `MODELS` and `TASKS` to run part of a table set (e.g. `MODELS=tiny-llada
TASKS=sudoku bash bench/run_results.sh {n}`, about 8 min with its threshold-0.5 and anatomy runs).
`tests/test_docs_commands.py` runs every command of this page at n = 2. `docs/results/*.summary.json` keep each
table's per-policy summary.

Columns: accuracy with its 95% Wilson interval; TPF = generated non-EOS tokens per forward; TPS = tokens per
second (noisy: several jobs shared the 2 cores); evals/tok = token-layer evaluations (positions computed, summed
over layers and steps) per generated token; NFE = forward passes per problem (every counter is defined in
[Performance](performance.md#counters)). Plots: accuracy against TPF with the 95% interval of each policy.

"""

GAINS_HEADER = """Against `{ref}` on the same problems (threshold 0.9, n = {n}), each cell is *TPF ratio · accuracy
difference in points · token-layer evaluations per token ratio*; `[≠]` marks an accuracy difference whose 95%
intervals do not overlap.

"""

AGREEMENT_HEADER = """## Lossy stages: token agreement (`bash bench/run_agreement.sh`)

The same problems decoded with `quant=none, offload=none` (A) and `quant=nvfp4, offload=cpu` (B); `changed` is
the share of problems whose generation differs, `token mismatch` the share of generated tokens that differ.
"""

ANATOMY_HEADER = """## Commit anatomy (`polestar anatomy`)

Masked candidates of the current block over every (row, step), by confidence: below 0.5, 0.5 to the early-commit
band, the band (0.7 – 0.9) and at or above τ = 0.9; then the commits by origin: confidence ≥ τ, the forced top-1
below τ, other commits below τ (Polestar's drift-delta early commits) and suffix-block commits; `gate` = band
candidates whose drift delta passed `alpha (τ − c)²` / band candidates with a delta. "no stop at EOS": every
block decoded (`--no-stop-at-eos`), as in LLaDA's and Fast-dLLM's reference loops.
"""

FRONTIER_HEADER = """## Calibrated checkpoints: the accuracy–TPF frontier (`bash bench/run_frontier.sh`)

`tiny-llada-noisy` and `tiny-dream-noisy` (fine-tuned with answer-digit label noise ε = 0.15, so their
confidences sit in the 0.7–0.9 band; model cards) on the same problems: `fast-dllm` and `parallel` over a
threshold sweep, the adaptive commit rules at their defaults and `polestar` at α = 3 and 30 (default 10).
Left panel: accuracy (95% interval) against TPF; right: against token-layer evaluations per token.
"""

SWEEP_HEADER = """## Polestar-Cache recompute budget (`bash bench/run_sweep.sh`)

`polestar-cache` (pc) under settings of its refresh selector beside the reference policies, same problems:
`default` is the paper's (8 clusters over the window, top k = 4 per layer and 1 at the last, τ_upd = 1);
`k-all-tau0` refreshes every cluster at every step (equal to no cache). `× fast` = evaluations per token over
`fast-dllm`'s; `Δ fast`, `Δ elastic` = accuracy difference in points.
"""


def summarize(result: dict) -> dict:
    """A ``polestar bench --json`` result without its per-item records (what the docs keep)."""
    return {key: value for key, value in result.items() if key != "items"}


def write_summaries(raw: Path, out: Path = RESULTS) -> list[Path]:
    """Write ``out/<name>.summary.json`` for every bench result ``raw/<name>.json``; returns the written paths."""
    written = []
    for f in sorted(raw.glob("*.json")):
        if f.name.endswith(SUMMARY_SUFFIX):
            continue
        result = json.loads(f.read_text())
        if "summary" not in result:
            continue
        path = out / (f.stem + SUMMARY_SUFFIX)
        path.write_text(json.dumps(summarize(result), indent=1) + "\n")
        written.append(path)
    return written


def table_name(summary_file: Path) -> str:
    """``docs/results/tiny-llada-arith.summary.json`` → ``tiny-llada-arith``."""
    return summary_file.name.removesuffix(SUMMARY_SUFFIX)


def threshold(result: dict) -> float:
    return result.get("options", {}).get("threshold", 0.9)


def plot_title(result: dict) -> str:
    dec = result.get("decoding", {})
    title = f"{result['model']} / {result['task']} / n={result['n']}"
    if "gen_length" in dec:
        title += f" / gen {dec['gen_length']} block {dec['block_length']}"
    if dec.get("stop_at_eos") is False:
        title += " / no stop at EOS"
    return title


def _overlap(a: list[float], b: list[float]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


def gains_table(results: list[dict], reference: str = REFERENCE_POLICY) -> str:
    """Markdown table: one row per (model, task) with ``reference``, one column per other policy, each cell the
    TPF ratio, the accuracy difference in points and the evaluations-per-token ratio against ``reference``."""
    rows = [r for r in results if reference in r["summary"] and threshold(r) == 0.9]
    policies: list[str] = []
    for r in rows:
        policies += [p for p in r["summary"] if p != reference and p not in policies]
    lines = ["| model / task | " + " | ".join(f"`{p}`" for p in policies) + " |",
             "|---" * (len(policies) + 1) + "|"]
    for r in sorted(rows, key=lambda r: (r["model"], r["task"])):
        ref = r["summary"][reference]
        cells = []
        for p in policies:
            s = r["summary"].get(p)
            if s is None:
                cells.append("–")
                continue
            delta = 100 * (s["accuracy"] - ref["accuracy"])
            mark = "" if _overlap(s["accuracy_ci95"], ref["accuracy_ci95"]) else " [≠]"
            cells.append(f"{s['tpf'] / ref['tpf']:.2f}× · {delta:+.1f}{mark} · "
                         f"{s['token_layer_evals_per_token'] / ref['token_layer_evals_per_token']:.2f}×")
        lines.append(f"| {r['model']} {r['task']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def kept_between(text: str, start: str, end: str | None) -> str | None:
    """The part of ``text`` from marker ``start`` up to (not including) marker ``end`` (or to the end)."""
    if start not in text:
        return None
    part = text[text.index(start):]
    if end is not None:
        if end not in part:
            return None
        part = part[: part.index(end)]
    return part


def render(page_text: str | None, results_dir: Path = RESULTS, plots: bool = True) -> str:
    """The results page from the summaries and text tables in ``results_dir``, keeping the hand-written summary
    and notes of ``page_text`` (the current page, if any)."""
    files = sorted(results_dir.glob("*" + SUMMARY_SUFFIX))
    results = [json.loads(f.read_text()) for f in files]
    n = next((r["n"] for r in results), 0)
    old = page_text or ""
    summary = kept_between(old, SUMMARY_MARKER, SUMMARY_END) or SUMMARY_MARKER + "\n(summary to be written)\n\n"
    notes = kept_between(old, NOTES_MARKER, None) or NOTES_MARKER + "\n"
    parts = ["# Results\n", summary.rstrip() + "\n" + SUMMARY_END + "\n",
             GAINS_HEADER.format(ref=REFERENCE_POLICY, n=n) + gains_table(results), HEADER.format(n=n)]
    for f, res in zip(files, results):
        thr = threshold(res)
        title = f"{res['model']} / {res['task']} / n={res['n']} / threshold {thr}"
        parts.append(f"## {res['model']} — {res['task']} (threshold {thr})\n\n"
                     f"```\n{format_table(res['summary'], title)}\n```\n")
        if len(res["summary"]) > 1:
            png = results_dir / f"{table_name(f)}.png"
            if plots:
                pareto_plot(res["summary"], str(png), plot_title(res))
            parts.append(f"![{table_name(f)}](results/{png.name})\n")
    for header, pattern in ((AGREEMENT_HEADER, "*-agree.txt"), (ANATOMY_HEADER, "*-anatomy*.txt"),
                            (FRONTIER_HEADER, "*-frontier.txt"), (SWEEP_HEADER, "*-sweep.txt")):
        found = sorted(results_dir.glob(pattern))
        if found:
            parts.append(header)
            for f in found:
                parts.append(f"```\n{f.read_text().rstrip()}\n```\n")
                plot = f.with_suffix(".png")  # the frontier plots (bench/frontier_table.py --plot)
                if plot.is_file():
                    parts.append(f"![{f.stem}](results/{plot.name})\n")
    parts.append(notes)
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--raw", type=Path, default=None,
                        help="directory of `polestar bench --json` results to summarize first (e.g. runs/results)")
    parser.add_argument("--no-plots", action="store_true", help="do not redraw the PNG plots")
    args = parser.parse_args(argv)
    if args.raw is not None:
        if not args.raw.is_dir():
            raise SystemExit(f"--raw {args.raw}: no such directory (bench/run_results.sh writes runs/results)")
        write_summaries(args.raw)
    PAGE.write_text(render(PAGE.read_text() if PAGE.exists() else None, plots=not args.no_plots))


if __name__ == "__main__":
    main()
