"""Compare a run of Research dLLM's own code (``bench/research_dllm.py run``) with a ``polestar bench --json`` run
of the same problems and settings, item by item.

``polestar bench --json OUT.json`` lists per item its policy, input, generation (the text up to the first stop
token, special tokens dropped), correctness and forwards (``nfe``); the items file beside it
(``OUT.items.jsonl``) adds per item ``tokens`` (generated ids that are neither EOS nor mask, over the whole
generation) and ``sequence_token_layer_evals`` (the item's rows through each layer's MLP, summed over layers and
forwards). The peer's generated ids are decoded the same way (this library's tokenizer of the checkpoint, up to
the first EOS, special tokens dropped) and checked by the same task. Run with this library's environment::

    /work/venv213/bin/python bench/research_dllm_compare.py peer.json polestar.json [--policy NAME]

An item is *identical* when its text and its count of non-EOS ids agree (the count covers the ids after the first
EOS that the text does not show). Printed: identical items out of N, accuracy on both sides, forwards per
generated token (forwards / non-EOS ids) on both sides, rows per generated token (MLP rows / non-EOS ids) on both
sides, and with ``--show K`` the first K differing items. ``--json`` prints the same figures as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load_polestar(path: str, policy: str | None) -> tuple[str, list[dict]]:
    """The policy name and its records (``--json`` items merged with the items file's counters), by problem
    index."""
    from polestar.bench.run_files import all_items_paths

    out = json.loads(Path(path).read_text())
    names = list(out["summary"])
    if policy is None:
        if len(names) != 1:
            raise SystemExit(f"{path} holds several policies ({', '.join(names)}); pass --policy")
        policy = names[0]
    items = [dict(it) for it in out["items"] if it["policy"] == policy]
    extra: dict[int, dict] = {}
    for items_file in all_items_paths(path):
        for line in items_file.read_text().splitlines()[1:]:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("policy") == policy:
                extra[rec["index"]] = rec
    for i, it in enumerate(items):
        rec = extra.get(i)
        if rec is None or rec["input"] != it["input"]:
            raise SystemExit(f"{path}: the items file lacks item {i} of {policy} (its counters are needed)")
        it["tokens"], it["rows"] = rec["tokens"], rec["sequence_token_layer_evals"]
    return policy, items


def peer_records(peer: dict, task_name: str) -> list[dict]:
    """The peer's items with their text (as ``polestar bench`` decodes), correctness and non-EOS id count."""
    from tokenizers import Tokenizer

    from polestar.models.text import decode_texts
    from polestar.tasks import get_task

    tok = Tokenizer.from_file(str(Path(peer["checkpoint"]) / "tokenizer.json"))
    task = get_task(task_name)
    eos, mask = peer["eos_id"], peer["mask_id"]
    out = []
    for it in peer["items"]:
        text = decode_texts(tok, [it["tokens"]], [eos])[0]
        out.append({"input": it["input"], "generation": text, "correct": bool(task.check(it["input"], text)),
                    "nfe": it["forwards"], "tokens": sum(t not in (eos, mask) for t in it["tokens"]),
                    "rows": it["mlp_rows"], "ids": it["tokens"]})
    return out


def compare(peer: list[dict], ours: list[dict]) -> dict:
    if len(peer) != len(ours):
        raise SystemExit(f"item counts differ: peer {len(peer)}, polestar {len(ours)}")
    for i, (a, b) in enumerate(zip(peer, ours)):
        if a["input"] != b["input"]:
            raise SystemExit(f"item {i}: different problems ({a['input']!r} vs {b['input']!r}); same --task/--n?")
    same = [a["generation"] == b["generation"] and a["tokens"] == b["tokens"] for a, b in zip(peer, ours)]

    def side(recs):
        tokens = max(sum(r["tokens"] for r in recs), 1)
        return {"accuracy": sum(r["correct"] for r in recs) / len(recs),
                "forwards_per_token": sum(r["nfe"] for r in recs) / tokens,
                "rows_per_token": sum(r["rows"] for r in recs) / tokens,
                "tokens": tokens, "forwards": sum(r["nfe"] for r in recs)}

    same_forwards = sum(a["nfe"] == b["nfe"] for a, b in zip(peer, ours))
    return {"n": len(peer), "identical": sum(same), "same_forwards": same_forwards,
            "differing": [i for i, s in enumerate(same) if not s], "peer": side(peer), "polestar": side(ours)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("peer", help="JSON written by bench/research_dllm.py run")
    p.add_argument("polestar", help="JSON written by polestar bench --json (its items file beside it)")
    p.add_argument("--policy", default=None, help="the policy of the polestar run (when it holds several)")
    p.add_argument("--task", default=None, help="task of the problems (default: the polestar run's)")
    p.add_argument("--show", type=int, default=0, help="print the first K differing items")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    peer = json.loads(Path(args.peer).read_text())
    task = args.task or json.loads(Path(args.polestar).read_text())["task"]
    policy, ours = load_polestar(args.polestar, args.policy)
    theirs = peer_records(peer, task)
    res = compare(theirs, ours)
    res.update(policy=policy, peer_method=f"{peer['strategy']}/{peer['cache']}")
    if args.json:
        print(json.dumps(res))
        return
    a, b = res["peer"], res["polestar"]
    print(f"peer {res['peer_method']} vs polestar {policy}: identical {res['identical']}/{res['n']} "
          f"(same forwards {res['same_forwards']}/{res['n']})")
    print(f"  accuracy          peer {100 * a['accuracy']:5.1f}%   polestar {100 * b['accuracy']:5.1f}%")
    print(f"  forwards/token    peer {a['forwards_per_token']:7.4f}  polestar {b['forwards_per_token']:7.4f}")
    print(f"  rows/token        peer {a['rows_per_token']:7.2f}  polestar {b['rows_per_token']:7.2f}")
    for i in res["differing"][: args.show]:
        print(f"  item {i} {theirs[i]['input']!r}: peer {theirs[i]['generation']!r} ({theirs[i]['nfe']} fwd) | "
              f"polestar {ours[i]['generation']!r} ({ours[i]['nfe']} fwd)", file=sys.stdout)


if __name__ == "__main__":
    main()
