"""How far two benchmark runs of the same problems disagree, token by token, and their metrics side by side.

Used to check that a lossy stage (``quant=nvfp4``, ``offload=cpu``) changes few decoded tokens against an exact
one (``quant=none``, ``offload=none``): run ``polestar bench`` twice with the same problems, policies and decoding,
once per setting, and compare the two JSON files with ``polestar agree A.json B.json``. ``--policy-a P
--policy-b Q`` compares policy ``P`` of run A with policy ``Q`` of run B instead (e.g. ``parallel`` against a
``polestar-cache`` configuration that should equal it).

Both runs' manifests (:mod:`~polestar.bench.manifest`) are compared first: runs that differ in more than one
setting or environment entry (the compared one) are refused unless ``--allow-differences``; with ``--policy-a``
and ``--policy-b`` the policies and their labels are the compared setting and may differ besides.

The generations in a benchmark JSON are decoded text; with the shipped character-level tokenizer one character
is one token, so the character mismatch rate is the token mismatch rate.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from polestar.bench.manifest import manifest_diff, manifest_path


def _mismatches(a: str, b: str) -> int:
    """Positions where ``a`` and ``b`` differ, a missing character counting as a difference."""
    return sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))


def _policy_items(run: dict[str, Any], policy: str, which: str) -> list[dict[str, Any]]:
    items = [dict(i, policy=None) for i in run["items"] if i["policy"] == policy]
    if not items:
        held = sorted({i["policy"] for i in run["items"]})
        raise ValueError(f"run {which} holds no items of policy {policy!r}; it holds {', '.join(held)}")
    return items


def compare_runs(a: dict[str, Any], b: dict[str, Any], policy_a: str | None = None,
                 policy_b: str | None = None) -> dict[str, dict[str, float]]:
    """Per policy: ``{"n", "changed_items", "changed_item_rate", "token_mismatch_rate", "accuracy_a",
    "accuracy_b"}`` for two ``polestar bench`` results over the same problems.

    With ``policy_a`` and ``policy_b`` only those policies' items are compared, against each other (e.g.
    ``parallel`` in one run with ``polestar-cache`` in another, to check that a configuration equals no-cache
    decoding); the result then has one entry, ``"<policy_a> vs <policy_b>"``.
    Raises ``ValueError`` when the runs do not cover the same (policy, input) pairs in the same order.
    """
    items_a, items_b = a["items"], b["items"]
    label = None
    if (policy_a is None) != (policy_b is None):
        raise ValueError("give both policy_a and policy_b, or neither")
    if policy_a is not None:
        items_a, items_b = _policy_items(a, policy_a, "A"), _policy_items(b, policy_b, "B")
        label = f"{policy_a} vs {policy_b}"
    key_a = [(i["policy"], i["input"]) for i in items_a]
    key_b = [(i["policy"], i["input"]) for i in items_b]
    if key_a != key_b:
        raise ValueError("the two runs do not hold the same policies and problems in the same order; "
                         "rerun both with the same --policies, --task, --n and --data")
    out: dict[str, dict[str, float]] = {}
    for ia, ib in zip(items_a, items_b):
        s = out.setdefault(label or ia["policy"], {"n": 0, "changed_items": 0, "mismatched": 0, "tokens": 0,
                                          "correct_a": 0, "correct_b": 0})
        bad = _mismatches(ia["generation"], ib["generation"])
        s["n"] += 1
        s["changed_items"] += bad > 0
        s["mismatched"] += bad
        s["tokens"] += max(len(ia["generation"]), len(ib["generation"]))
        s["correct_a"] += bool(ia["correct"])
        s["correct_b"] += bool(ib["correct"])
    return {
        policy: {
            "n": s["n"],
            "changed_items": s["changed_items"],
            "changed_item_rate": s["changed_items"] / s["n"],
            "token_mismatch_rate": s["mismatched"] / max(s["tokens"], 1),
            "accuracy_a": s["correct_a"] / s["n"],
            "accuracy_b": s["correct_b"] / s["n"],
        }
        for policy, s in out.items()
    }


def format_agreement(result: dict[str, dict[str, float]], title: str) -> str:
    w = max([18, *(len(p) for p in result)])
    head = f"{'policy':{w}s} {'n':>5s} {'changed':>8s} {'token mismatch':>15s} {'acc A':>7s} {'acc B':>7s}"
    lines = [title, head, "-" * len(head)]
    for policy, s in result.items():
        lines.append(f"{policy:{w}s} {s['n']:5d} {100 * s['changed_item_rate']:7.1f}% "
                     f"{100 * s['token_mismatch_rate']:14.2f}% {100 * s['accuracy_a']:6.1f}% "
                     f"{100 * s['accuracy_b']:6.1f}%")
    return "\n".join(lines)


#: the summary metrics :func:`compare_metrics` sets side by side: (summary key, column title)
METRICS = (("tpf", "TPF"), ("tps", "TPS"), ("nfe", "NFE"), ("token_layer_evals_per_token", "evals/tok"),
           ("weight_bytes_per_token", "W/tok"), ("kv_bytes_per_token", "KV/tok"),
           ("proxy_query_evals_per_token", "proxy/tok"))


def compare_metrics(a: dict[str, Any], b: dict[str, Any], policy_a: str | None = None,
                    policy_b: str | None = None) -> dict[str, dict[str, tuple[float, float]]]:
    """Per policy (or ``"<policy_a> vs <policy_b>"``): each of :data:`METRICS` as ``(A, B)`` from the two runs'
    summaries; a metric either summary lacks is left out."""
    pairs = [(policy_a, policy_b)] if policy_a is not None else [(p, p) for p in a.get("summary", {})]
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for pa, pb in pairs:
        sa, sb = a.get("summary", {}).get(pa), b.get("summary", {}).get(pb)
        if sa is None or sb is None:
            continue
        label = pa if policy_a is None else f"{pa} vs {pb}"
        out[label] = {key: (float(sa[key]), float(sb[key])) for key, _ in METRICS if key in sa and key in sb}
    return out


def format_metrics(result: dict[str, dict[str, tuple[float, float]]]) -> str:
    """:func:`compare_metrics` as a table: per policy and metric ``A → B (B/A)``."""
    if not result:
        return ""
    w = max([18, *(len(p) for p in result)])
    titles = dict(METRICS)
    lines = [f"{'policy':{w}s} {'metric':>10s} {'A':>12s} {'B':>12s} {'B/A':>8s}"]
    lines.append("-" * len(lines[0]))
    for policy, metrics in result.items():
        for key, (va, vb) in metrics.items():
            ratio = f"{vb / va:7.3f}x" if va else f"{'-':>8s}"
            lines.append(f"{policy:{w}s} {titles[key]:>10s} {va:12.4g} {vb:12.4g} {ratio}")
    return "\n".join(lines)


def run_manifest(run: dict[str, Any], path: str | Path) -> dict[str, Any] | None:
    """The manifest of a bench run: inside its JSON, else the ``.manifest.json`` file beside it, else None."""
    if isinstance(run.get("manifest"), dict):
        return run["manifest"]
    beside = manifest_path(path)
    if beside.is_file():
        return json.loads(beside.read_text())
    return None


def check_comparable(manifests: list[dict[str, Any] | None], paths: list[str], by_policy: bool,
                     allow: bool) -> list[str]:
    """The differences between two runs' manifests; a ValueError when they differ in more than one entry (the
    setting compared) and ``allow`` is not given. ``by_policy``: policies and labels are compared on purpose."""
    if any(m is None for m in manifests):
        missing = [p for p, m in zip(paths, manifests) if m is None]
        print(f"note: {', '.join(missing)} carries no manifest (a run from before manifests); its settings are not "
              "checked", file=sys.stderr)
        return []
    ignore = ("settings.policies",) if by_policy else ()
    diff = manifest_diff(manifests[0], manifests[1], ignore)
    if len(diff) > 1 and not allow:
        raise ValueError(f"the runs differ in more than the compared setting: {'; '.join(diff)}; rerun one of them "
                         "so that only the compared setting differs, or pass --allow-differences")
    return diff


def agree_cli(path_a: str, path_b: str, policy_a: str | None = None, policy_b: str | None = None,
              allow_differences: bool = False) -> int:
    runs = []
    for path in (path_a, path_b):
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"{path}: no such benchmark JSON (write one with `polestar bench ... --json`)")
        try:
            run = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path} is not a benchmark JSON ({err}); "
                             "write one with `polestar bench ... --json`") from None
        if not isinstance(run, dict) or not isinstance(run.get("items"), list):
            raise ValueError(f"{path} has no 'items' list; is it the output of `polestar bench ... --json`?")
        runs.append(run)
    manifests = [run_manifest(run, path) for run, path in zip(runs, (path_a, path_b))]
    diff = check_comparable(manifests, [path_a, path_b], policy_a is not None, allow_differences)
    result = compare_runs(*runs, policy_a=policy_a, policy_b=policy_b)
    compared = f"\ncompared: {'; '.join(diff)}" if diff else ""
    print(format_agreement(result, f"A = {path_a}\nB = {path_b}{compared}"))
    metrics = format_metrics(compare_metrics(*runs, policy_a=policy_a, policy_b=policy_b))
    if metrics:
        print("\n" + metrics)
    return 0
