"""Render docs/results.md from the files written by bench/run_results.sh, bench/run_agreement.sh and
bench/run_sweep.sh (``python bench/render_results.py``).

The tables are regenerated; hand-written analysis below the ``NOTES_MARKER`` line of the existing page is kept.
"""

from __future__ import annotations

import json
from pathlib import Path

from polestar.bench.harness import format_table

RESULTS = Path("docs/results")
HEADER = """# Results

Measured on this project's CPU machine (2 cores, shared), with the shipped checkpoints `tiny-llada` and
`tiny-dream` (≈1M parameters, trained on 1 CPU thread in seven and six stages, 4.2 and 3.75 hours in all; see
their model cards), greedy decoding, generation length 64 in 4 blocks of 16, `threshold` 0.9 unless stated,
n = {n} test problems per task. Reproduce with `bash bench/run_results.sh {n}` (both models, all four tasks,
~25 min per model on one core), `bash bench/run_agreement.sh {n}`, `bash bench/run_sweep.sh {n}`, then
`python bench/render_results.py`.

Columns: accuracy with its 95% Wilson interval; TPF = generated non-EOS tokens per forward; TPS = tokens per
second (noisy: several jobs shared the 2 cores); evals/tok = token-layer evaluations (positions computed, summed
over layers and steps) per generated token; NFE = forward passes per problem.

"""

NOTES_MARKER = "<!-- notes: everything below is written by hand and kept by render_results.py -->"
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


SWEEP_HEADER = """## Polestar-Cache recompute budget (`bash bench/run_sweep.sh`)

`polestar-cache` (pc) under settings of its refresh selector beside the reference policies, same problems:
`default` is the paper's (8 clusters over the window, top k = 4 per layer and 1 at the last, τ_upd = 1);
`k-all-tau0` refreshes every cluster at every step (equal to no cache). `× fast` = evaluations per token over
`fast-dllm`'s; `Δ fast`, `Δ elastic` = accuracy difference in points.
"""


def kept_notes(page: Path) -> str:
    """The hand-written part of an existing results page (from the marker on), or just the marker."""
    if page.exists():
        text = page.read_text()
        if NOTES_MARKER in text:
            return text[text.index(NOTES_MARKER):]
    return NOTES_MARKER + "\n"


def main() -> None:
    page = Path("docs/results.md")
    files = sorted(RESULTS.glob("*.json"))
    n = next((json.loads(f.read_text())["n"] for f in files), 0)
    parts = [HEADER.format(n=n)]
    for f in files:
        res = json.loads(f.read_text())
        thr = res.get("options", {}).get("threshold", 0.9)
        title = f"{res['model']} / {res['task']} / n={res['n']} / threshold {thr}"
        parts.append(f"## {res['model']} — {res['task']} (threshold {thr})\n\n```\n{format_table(res['summary'], title)}\n```\n")
        png = f.with_suffix(".png")
        if png.exists():
            parts.append(f"![{f.stem}](results/{png.name})\n")
    agreement = sorted(RESULTS.glob("*-agree.txt"))
    if agreement:
        parts.append(AGREEMENT_HEADER)
        parts += [f"```\n{f.read_text().rstrip()}\n```\n" for f in agreement]
    anatomy = sorted(RESULTS.glob("*-anatomy*.txt"))
    if anatomy:
        parts.append(ANATOMY_HEADER)
        parts += [f"```\n{f.read_text().rstrip()}\n```\n" for f in anatomy]
    sweep = sorted(RESULTS.glob("*-sweep.txt"))
    if sweep:
        parts.append(SWEEP_HEADER)
        parts += [f"```\n{f.read_text().rstrip()}\n```\n" for f in sweep]
    parts.append(kept_notes(page))
    page.write_text("\n".join(parts))


if __name__ == "__main__":
    main()
