"""Accuracy / throughput harness behind ``polestar bench``: same problems, same counters, every policy."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import polestar
from polestar.bench.tasks import get_task
from polestar.bench.tasks.base import Problem, split
from polestar.policy import Pipeline
from polestar.registry import KINDS


def wilson_interval(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (well behaved at 0 and n)."""
    if n == 0:
        return (0.0, 0.0)
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def load_problems(task_name: str, n: int, data: str | None = None, seed: int = 0) -> list[Problem]:
    """``n`` test problems of ``task_name`` (generated), or the first ``n`` records of a JSONL ``data`` file with
    ``{"input": ..., "output": ...}`` (Dream's Countdown / Sudoku evaluation layout)."""
    if data is None:
        return split(get_task(task_name), n, "test", seed)
    path = Path(data)
    if not path.is_file():
        raise FileNotFoundError(f"--data file {data} does not exist")
    problems = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if "input" not in rec:
            raise ValueError(f"{data}:{lineno}: record has no 'input' field")
        problems.append(Problem(task_name, str(rec["input"]), str(rec.get("output", ""))))
        if len(problems) >= n:
            break
    return problems


def run_policy(model, task, problems: list[Problem], policy: str | Pipeline, options: dict[str, Any],
               decoding: dict[str, Any], batch_size: int = 1, progress=None) -> tuple[list[dict], dict]:
    """Decode every problem with ``policy`` (a name or an assembled pipeline); return per-item records and a
    summary (with ``stages``: the stages and options the policy ran with, ``Pipeline.describe()``)."""
    name = policy if isinstance(policy, str) else policy.policy
    items = []
    tokens = seq_nfe = evals = 0
    wall = 0.0
    out = None
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        prompts = [task.format_prompt(p.input) for p in chunk]
        out = polestar.generate(model, prompts, policy=policy, **decoding, **options)
        for prob, text, seq in zip(chunk, out.texts, out.stats.sequences):
            items.append({
                "policy": name, "input": prob.input, "generation": text,
                "correct": bool(task.check(prob.input, text)), "nfe": seq.nfe,
            })
        tokens += out.stats.tokens
        seq_nfe += sum(s.nfe for s in out.stats.sequences)
        evals += out.stats.token_layer_evals
        wall += out.stats.wall_s
        if progress is not None:
            progress.update(len(chunk))
    correct = sum(i["correct"] for i in items)
    lo, hi = wilson_interval(correct, len(items))
    summary = {
        "accuracy": correct / max(len(items), 1),
        "accuracy_ci95": [lo, hi],
        "tpf": tokens / max(seq_nfe, 1),
        "tps": tokens / wall if wall > 0 else 0.0,
        "nfe": seq_nfe / max(len(items), 1),
        "token_layer_evals_per_token": evals / max(tokens, 1),
        "n": len(items),
        "wall_s": wall,
        "stages": out.pipeline.describe() if out is not None else None,  # the stages and options it ran with
    }
    return items, summary


def format_table(summary: dict[str, dict], title: str) -> str:
    head = f"{'policy':18s} {'accuracy':>9s} {'95% CI':>15s} {'TPF':>6s} {'TPS':>8s} {'evals/tok':>10s} {'NFE':>7s}"
    lines = [title, head, "-" * len(head)]
    for name, s in summary.items():
        lo, hi = s["accuracy_ci95"]
        lines.append(
            f"{name:18s} {100 * s['accuracy']:8.1f}% [{100 * lo:5.1f},{100 * hi:5.1f}] {s['tpf']:6.2f} "
            f"{s['tps']:8.1f} {s['token_layer_evals_per_token']:10.1f} {s['nfe']:7.1f}"
        )
    return "\n".join(lines)


def pareto_plot(summary: dict[str, dict], path: str, title: str) -> None:
    """Accuracy against TPF, one point per policy with its 95% Wilson interval as an error bar, the Pareto front
    (best accuracy at each TPF, on the point estimates) joined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    pts = sorted((s["tpf"], 100 * s["accuracy"], name, s["accuracy_ci95"]) for name, s in summary.items())
    for tpf, acc, name, (lo, hi) in pts:
        ax.errorbar(tpf, acc, yerr=[[max(acc - 100 * lo, 0.0)], [max(100 * hi - acc, 0.0)]], fmt="o", capsize=3)
        ax.annotate(name, (tpf, acc), fontsize=8, xytext=(3, 3), textcoords="offset points")
    front, best = [], -1.0
    for tpf, acc, _, _ in sorted(pts, key=lambda t: -t[0]):
        if acc > best:
            front.append((tpf, acc))
            best = acc
    if len(front) > 1:
        xs, ys = zip(*sorted(front))
        ax.plot(xs, ys, "--", alpha=0.5)
    ax.set_xlabel("tokens per forward (TPF)")
    ax.set_ylabel("accuracy (%), 95% interval")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_bench(model_name: str, task_name: str, policies: list[str], n: int, options: dict[str, Any],
              decoding: dict[str, Any], batch_size: int = 1, data: str | None = None, dtype: str = "float32",
              device: str = "cpu", show_progress: bool = True) -> dict:
    """Run every policy on the same problems; returns ``{"items": [...], "summary": {policy: {...}}}``."""
    task = get_task(task_name)
    for name in policies:  # fail on a bad policy or option before any decoding
        polestar.assemble(name, optional_overrides(options))
    for key, value in options.items():
        if not any(_accepts(name, key, value, options) for name in policies):
            polestar.assemble(policies[0], {**_swaps(options, key), key: value})  # raises, listing valid options
    model = polestar.load(model_name, dtype=dtype, device=device)
    problems = load_problems(task_name, n, data)
    items, summary = [], {}
    bar = _progress(len(problems) * len(policies), show_progress)
    for name in policies:
        its, summ = run_policy(model, task, problems, name, optional_overrides(options), decoding, batch_size, bar)
        items += its
        summary[name] = summ
    if bar is not None:
        bar.close()
    return {
        "model": model_name, "task": task_name, "n": len(problems), "decoding": decoding, "options": options,
        "items": items, "summary": summary, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def profile_policies(model_name, task_name, policies, n, options, decoding, batch_size=1, dtype="float32",
                     device="cpu") -> dict[str, dict[str, float]]:
    """Share of step time per stage (``polestar.profiling`` scopes) for each policy, on ``n`` problems."""
    from polestar.profiling import profile_shares

    task = get_task(task_name)
    model = polestar.load(model_name, dtype=dtype, device=device)
    problems = load_problems(task_name, n)
    out = {}
    for name in policies:
        opts = optional_overrides(options)
        times = profile_shares(lambda name=name, opts=opts: run_policy(model, task, problems, name, opts, decoding, batch_size))
        total = times.pop("total")
        drift_parts = ("proxy_attention", "drift", "cluster", "store", "packet")
        shares = {"model_forward": (times["forward"] - sum(times[k] for k in drift_parts)) / total}
        shares.update({k: times[k] / total for k in (*drift_parts, "commit")})
        shares["other"] = max(0.0, 1.0 - sum(shares.values()))
        out[name] = shares
    return out


def format_profile(profile: dict[str, dict[str, float]]) -> str:
    cols = ["model_forward", "proxy_attention", "drift", "cluster", "store", "packet", "commit", "other"]
    lines = ["share of step time (%)", f"{'policy':18s} " + " ".join(f"{c[:10]:>10s}" for c in cols)]
    for name, shares in profile.items():
        lines.append(f"{name:18s} " + " ".join(f"{100 * shares[c]:10.1f}" for c in cols))
    return "\n".join(lines)


def optional_overrides(options: dict[str, Any]) -> dict[str, Any]:
    """``--set`` options as optional overrides (``key?``): each applies to the policies whose stages take it
    (see :func:`polestar.assemble`)."""
    return {k + "?": v for k, v in options.items()}


def _swaps(options: dict[str, Any], but: str) -> dict[str, Any]:
    """The stage swaps among ``options`` (other than ``but``), as optional overrides."""
    return optional_overrides({k: v for k, v in options.items() if k in KINDS and k != but})


def _accepts(policy: str, key: str, value: Any, options: dict[str, Any]) -> bool:
    """Whether ``policy``, with the stage swaps of ``options``, has a stage taking ``key=value``."""
    try:
        polestar.assemble(policy, {**_swaps(options, key), key: value})
    except ValueError:
        return False
    return True


def _progress(total: int, show: bool):
    if not show:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the bench/test extras
        return None
    return tqdm(total=total, desc="bench", unit="problem")


def run_bench_cli(args, options: dict[str, Any], decoding: dict[str, Any]) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    result = run_bench(args.model, args.task, policies, args.n, options, decoding, args.batch_size, args.data,
                       args.dtype, args.device)
    title = f"{args.model} / {args.task} / n={result['n']} / gen {args.gen_length} block {args.block_length}"
    if not args.stop_at_eos:
        title += " / no stop at EOS"
    print(format_table(result["summary"], title))
    if args.profile:
        result["profile"] = profile_policies(args.model, args.task, policies, min(args.n, 8), options, decoding,
                                             args.batch_size, args.dtype, args.device)
        print(format_profile(result["profile"]))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    if args.plot:
        pareto_plot(result["summary"], args.plot, title)
    return 0
