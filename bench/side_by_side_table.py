"""The policy side of a side-by-side table of docs/results.md, from a ``bench/run_side_by_side.sh`` directory:
``python bench/side_by_side_table.py runs/side-by-side/elastic``.

Every ``*.json`` in the directory (but the runs' manifests) is one ``polestar bench --json`` run of one policy,
labelled by its file name, in the order the script ran them. The columns divide by the generated *positions*
(``n × gen_length``), as the released code's counts do, not by the generated non-EOS tokens as ``polestar
bench``'s TPF and evals/tok do: accuracy, positions per forward (``gen_length / NFE``), rows through a layer's
attention and MLP per position (``token_layer_evals``, the run counter: every plan slot the steps executed) and,
in brackets, the sequences' own rows (``sequence_token_layer_evals``), and probe rows per position
(``proxy_query_evals``: Elastic-Cache's tracked keys, dLLM-Cache's value probes).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from polestar.bench.harness import text_table
from polestar.bench.run_files import result_files, run_base


def side_row(label: str, result: dict) -> dict:
    """The table's numbers for one bench run (one policy)."""
    (s,) = result["summary"].values()
    positions = result["n"] * result["decoding"]["gen_length"]
    tokens = s["tpf"] * s["nfe"] * s["n"]  # generated non-EOS tokens, what the bench's per-token columns divide by
    return {
        "label": label, "model": result["model"], "options": " ".join(f"{k}={v}" for k, v in result["options"].items()),
        "accuracy": s["accuracy"], "positions_per_forward": result["decoding"]["gen_length"] / s["nfe"],
        "rows": s["token_layer_evals"] / positions,
        "own_rows": s["sequence_token_layer_evals_per_token"] * tokens / positions,
        "probe_rows": s["proxy_query_evals"] / positions,
    }


def format_side(title: str, rows: list[dict]) -> str:
    head = (f"{'setting':<22}{'accuracy':>9}{'pos/fwd':>9}{'rows/pos':>10}{'(own)':>9}{'probe/pos':>11}"
            "  options")
    return text_table(title, head, (
        f"{r['label']:<22}{r['accuracy']:>9.2f}{r['positions_per_forward']:>9.2f}{r['rows']:>10.1f}"
        f"{'(' + format(r['own_rows'], '.1f') + ')':>9}{r['probe_rows']:>11.1f}  {r['options']}" for r in rows))


def main(directory: str) -> None:
    files = sorted(result_files(Path(directory)), key=lambda f: f.stat().st_mtime)
    results = {run_base(f).name: json.loads(f.read_text()) for f in files}
    first = next(iter(results.values()))
    (policy,) = first["summary"]
    decoding = first["decoding"]
    title = (f"{policy} / {first['task']} / n={first['n']} / gen {decoding['gen_length']}"
             + ("" if decoding.get("stop_at_eos", True) else " / no stop at EOS") + " / per generated position")
    print(format_side(title, [side_row(label, res) for label, res in results.items()]))


if __name__ == "__main__":
    main(sys.argv[1])
