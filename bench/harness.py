"""Accuracy / throughput harness behind ``polestar bench``: same problems, same counters, every policy."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import polestar
from polestar.bench.item_log import (
    PLUGINS,
    ItemLog,
    Previous,
    check_previous,
    describe_settings,
    items_path,
)
from polestar.bench.manifest import build_manifest, manifest_path
from polestar.entries import BenchEntry, parse_entry, value_text
from polestar.evaluation import distributed
from polestar.models.loading import dtype_name
from polestar.output_files import check_writable, write_atomic
from polestar.overrides import Overrides
from polestar.policy import Pipeline
from polestar.problems import check_problem_count, load_problems, progress_bar
from polestar.stats import compile_seconds
from polestar.tasks import get_task
from polestar.tasks.base import Problem


def wilson_interval(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (well behaved at 0 and n)."""
    if n == 0:
        return (0.0, 0.0)
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


#: Fields of a bench item in the ``--json`` output (``error``: why decoding stopped early, e.g. non-finite logits,
#: else None); the items JSONL also keeps the per-item counters.
ITEM_FIELDS = ("policy", "label", "input", "generation", "correct", "nfe", "error")


#: Counters of a whole batch (:class:`~polestar.stats.RunStats`) that each record carries a share of: ``steps``
#: (batched forward passes), ``token_layer_evals`` (every row computed, padding included), ``weight_bytes``,
#: ``kv_bytes`` and ``proxy_query_evals``; the shares of a batch are
#: integers that sum to the batch's value, so a summary's sums equal :meth:`RunStats.merge` of its batches.
BATCH_COUNTERS = ("steps", "token_layer_evals", "weight_bytes", "kv_bytes", "proxy_query_evals")


def split_evenly(total: int, n: int) -> list[int]:
    """``total`` split into ``n`` integer shares that differ by at most one and sum to ``total``."""
    base, extra = divmod(total, n)
    return [base + (i < extra) for i in range(n)]


def batch_counter_shares(stats, n: int) -> list[dict[str, int]]:
    """Each of ``n`` records' share of the :data:`BATCH_COUNTERS` of one batch's ``stats`` (a ``RunStats``)."""
    totals = {"steps": stats.nfe, "token_layer_evals": stats.token_layer_evals, "weight_bytes": stats.weight_bytes,
              "kv_bytes": stats.kv_bytes, "proxy_query_evals": stats.proxy_query_evals}
    shares = {key: split_evenly(int(value), n) for key, value in totals.items()}
    return [{key: shares[key][i] for key in BATCH_COUNTERS} for i in range(n)]


def decode_batch(model, task, chunk: list[Problem], policy: str | Pipeline, options: dict[str, Any],
                 decoding: dict[str, Any]) -> tuple[list[dict], Pipeline]:
    """Decode one batch of problems; return one record per problem (:data:`ITEM_FIELDS` plus its ``tokens``, its
    own ``sequence_token_layer_evals``, ``wall_s`` and ``compile_s``, the batch's times split evenly, and its share
    of the batch's :data:`BATCH_COUNTERS`) and the pipeline it ran."""
    name = policy if isinstance(policy, str) else policy.policy
    prompts = [task.format_prompt(p.input) for p in chunk]
    out = polestar.generate(model, prompts, policy=policy, **decoding, **options)
    records = []
    shares = batch_counter_shares(out.stats, len(chunk))
    for prob, text, seq, share in zip(chunk, out.texts, out.stats.sequences, shares):
        records.append({
            "policy": name, "input": prob.input, "generation": text,
            "correct": bool(task.check(prob.input, text)), "nfe": seq.nfe, "error": getattr(seq, "error", None),
            "tokens": seq.tokens, "sequence_token_layer_evals": seq.token_layer_evals,
            "revoked": getattr(seq, "revoked", 0),
            "wall_s": out.stats.wall_s / len(chunk),
            "compile_s": out.stats.compile_s / len(chunk), **share,
        })
    return records, out.pipeline


def cost_summary(records: list[dict]) -> dict:
    """The step-cost counters of ``records`` (see docs/performance.md, "Counters"): the sums of
    :data:`BATCH_COUNTERS` (records from before these counters count 0), weight bytes per generated token and
    per step, K/V bytes per token and proxy query rows per token."""
    sums = {key: sum(r.get(key, 0) for r in records) for key in BATCH_COUNTERS}
    tokens = max(sum(r["tokens"] for r in records), 1)
    return {
        **sums,
        "weight_bytes_per_token": sums["weight_bytes"] / tokens,
        "weight_bytes_per_step": sums["weight_bytes"] / max(sums["steps"], 1),
        "kv_bytes_per_token": sums["kv_bytes"] / tokens,
        "proxy_query_evals_per_token": sums["proxy_query_evals"] / tokens,
    }


def summarize(records: list[dict], stages: dict | None) -> dict:
    """Accuracy (with its 95% interval), TPF, TPS, NFE, token-layer evaluations per token and the step-cost
    counters (:func:`cost_summary`) of ``records`` (from :func:`decode_batch`); ``stages``: the pipeline's
    ``describe()``."""
    correct = sum(r["correct"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    seq_nfe = sum(r["nfe"] for r in records)
    wall = sum(r["wall_s"] for r in records)
    lo, hi = wilson_interval(correct, len(records))
    return {
        "accuracy": correct / max(len(records), 1),
        "accuracy_ci95": [lo, hi],
        "tpf": tokens / max(seq_nfe, 1),
        "tps": tokens / wall if wall > 0 else 0.0,
        "nfe": seq_nfe / max(len(records), 1),
        "token_layer_evals_per_token": sum(r["token_layer_evals"] for r in records) / max(tokens, 1),
        "sequence_token_layer_evals_per_token": (
            sum(r.get("sequence_token_layer_evals", r["token_layer_evals"]) for r in records) / max(tokens, 1)),
        "n": len(records),
        "wall_s": wall,
        "compile_s": sum(r.get("compile_s", 0.0) for r in records),  # torch.compile time, excluded from wall_s and tps
        **cost_summary(records),
        # committed tokens a revoking commit rule (WINO) took back, beside the final tokens TPF counts
        "revoked_per_token": sum(r.get("revoked", 0) for r in records) / max(tokens, 1),
        "stages": stages,  # the stages and options it ran with
    }


def public_item(record: dict) -> dict:
    """The :data:`ITEM_FIELDS` of a record (what ``--json`` lists under ``items``; ``label`` defaults to the
    policy name)."""
    return {k: record.get(k, record["policy"]) if k == "label" else record[k] for k in ITEM_FIELDS}


def applied_overrides(policy: str, options: dict[str, Any]) -> dict[str, Any]:
    """The ``--set`` options of ``options`` that apply to ``policy`` (a stage of it takes them; a stage swap it
    can make), in key order."""
    return {k: options[k] for k in sorted(options) if _accepts(policy, k, options[k], options)}


def policy_label(policy: str, options: dict[str, Any]) -> str:
    """The ``--policies`` entry ``policy`` (a name, or a name with settings of its own: ``polestar[drift=kl]``) with
    the ``--set`` overrides that apply to it: ``fast-dllm[commit=entropy-bound]``, or the bare name without any.
    Table rows, plot labels and JSON records carry it; ``--policies`` accepts it as an entry."""
    entry = bench_entry(policy)
    return entry.label(applied_overrides(entry.policy, options))


def bench_entry(text: str) -> BenchEntry:
    """One ``--policies`` entry read (:mod:`~polestar.entries`; values as ``--set`` reads them)."""
    from polestar.cli_checks import _parse_value

    return parse_entry(text, _parse_value)


def entry_overrides(text: str, options: dict[str, Any]) -> dict[str, Any]:
    """The overrides the ``--policies`` entry ``text`` decodes with: ``--set``'s ``options`` where they apply, its
    own settings required."""
    return bench_entry(text).overrides(options)


def run_header(model_name: str, task_name: str, n: int, data: str | None, decoding: dict[str, Any],
               options: dict[str, Any], batch_size: int, dtype: str, device: str,
               threads: int | None = None) -> dict[str, Any]:
    """The settings that decide a bench run's items and their timings (the items file's header; ``--resume``
    needs them equal, the timing ones unless ``--resume-any-timing``: see
    :data:`~polestar.bench.item_log.TIMING_SETTINGS`), with the digest of every plugin's source file
    (:func:`polestar.plugins.plugin_sources`) when there are plugins. ``threads``: torch's intra-op threads
    (default: the number torch uses now)."""
    import torch

    from polestar.plugins import plugin_sources

    header = {"model": model_name, "task": task_name, "n": n, "data": data, "decoding": decoding, "options": options,
              "batch_size": batch_size, "dtype": dtype, "device": str(device),
              "threads": torch.get_num_threads() if threads is None else threads}
    sources = plugin_sources()
    if sources:
        header[PLUGINS] = sources
    return header


def run_policy(model, task, problems: list[Problem], policy: str | Pipeline, options: dict[str, Any],
               decoding: dict[str, Any], batch_size: int = 1, progress=None) -> tuple[list[dict], dict]:
    """Decode every problem with ``policy`` (a name or an assembled pipeline); return per-item records and a
    summary (with ``stages``: the stages and options the policy ran with, ``Pipeline.describe()``)."""
    records, pipeline = [], None
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        recs, pipeline = decode_batch(model, task, chunk, policy, options, decoding)
        records += recs
        if progress is not None:
            progress.update(len(chunk))
    return [public_item(r) for r in records], summarize(records, pipeline.describe() if pipeline else None)


#: Step-cost columns of :func:`format_table`: (header, summary key), shown when the summaries carry them (the
#: summaries of runs from before these counters do not, and keep their old table)
COST_COLUMNS = (("W/tok", "weight_bytes_per_token"), ("W/step", "weight_bytes_per_step"),
                ("KV/tok", "kv_bytes_per_token"), ("proxy/tok", "proxy_query_evals_per_token"))


def _cost_cell(key: str, value: float) -> str:
    """One cost column's cell: bytes and rows with SI prefixes, the revocation rate (a fraction) with 3 decimals."""
    return f"{value:.3f}" if key == "revoked_per_token" else si(value)


def si(value: float) -> str:
    """``value`` in at most 6 characters with an SI prefix (``512``, ``3.4k``, ``16.1G``)."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{prefix}"
    return f"{value:.0f}" if value == int(value) else f"{value:.1f}"


def text_table(title: str, head: str, rows) -> str:
    """A bench text table: ``title``, the column ``head``, a rule as wide as it, then one line per row."""
    return "\n".join([title, head, "-" * len(head), *rows])


def format_table(summary: dict[str, dict], title: str) -> str:
    """The ``polestar bench`` table: accuracy, 95% interval, TPF, TPS, evaluations per token and NFE per policy,
    then the step-cost columns (:data:`COST_COLUMNS`, bytes with SI prefixes) when the summaries carry them."""
    costs = [(head, key) for head, key in COST_COLUMNS if all(key in s for s in summary.values())]
    if any(s.get("revoked_per_token", 0) > 0 for s in summary.values()):  # a revoking commit rule ran
        costs.append(("rev/tok", "revoked_per_token"))
    labels = {name: s.get("label", name) for name, s in summary.items()}
    w = max([18, *(len(label) for label in labels.values())])
    head = f"{'policy':{w}s} {'accuracy':>9s} {'95% CI':>15s} {'TPF':>6s} {'TPS':>8s} {'evals/tok':>10s} {'NFE':>7s}"
    head += "".join(f" {h:>9s}" for h, _ in costs)
    lines = []
    for name, s in summary.items():
        lo, hi = s["accuracy_ci95"]
        lines.append(
            f"{labels[name]:{w}s} {100 * s['accuracy']:8.1f}% [{100 * lo:5.1f},{100 * hi:5.1f}] {s['tpf']:6.2f} "
            f"{s['tps']:8.1f} {s['token_layer_evals_per_token']:10.1f} {s['nfe']:7.1f}"
            + "".join(f" {_cost_cell(key, s.get(key, 0)):>9s}" for _, key in costs)
        )
    return text_table(title, head, lines)


def pareto_plot(summary: dict[str, dict], path: str, title: str) -> None:
    """Accuracy against TPF, one point per policy with its 95% Wilson interval as an error bar, the Pareto front
    (best accuracy at each TPF, on the point estimates) joined. Points are named in a legend (each its own marker
    and colour, the label with its overrides), so no two names can overlap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4 + 0.18 * len(summary)))
    pts = sorted((s["tpf"], 100 * s["accuracy"], s.get("label", name), s["accuracy_ci95"])
                 for name, s in summary.items())
    markers = "osD^vPX<>ph"
    for i, (tpf, acc, name, (lo, hi)) in enumerate(pts):
        ax.errorbar(tpf, acc, yerr=[[max(acc - 100 * lo, 0.0)], [max(100 * hi - acc, 0.0)]], fmt=markers[i % 11],
                    capsize=3, label=name)
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
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    fig.tight_layout()
    write_atomic(path, writer=lambda tmp: fig.savefig(tmp, dpi=120, format=Path(path).suffix.lstrip(".") or "png"))
    plt.close(fig)


def run_bench(model_name: str, task_name: str, policies: list[str], n: int, options: dict[str, Any],
              decoding: dict[str, Any], batch_size: int = 1, data: str | None = None, dtype: str | None = None,
              device: str = "cpu", show_progress: bool = True, json_out: str | None = None,
              resume: bool = False, overwrite: bool = False, previous: Previous | None = None,
              resume_any_timing: bool = False) -> dict:
    """Run every policy on the same problems; returns ``{"items": [...], "summary": {policy: {...}},
    "manifest": {...}}`` (items and summaries carry each policy's ``label`` with its overrides).

    Under ``torchrun`` (``WORLD_SIZE`` > 1) the batches are dealt round robin to the ranks and every rank returns
    the gathered result (items in problem order; each batch is the one a single process decodes, so the items
    equal a single-process run). With ``json_out`` each finished batch is appended to the items file beside it
    (:mod:`~polestar.bench.item_log`) and the manifest is written beside it first
    (:mod:`~polestar.bench.manifest`); ``resume`` reuses the batches already there; finished items from an
    earlier run without ``resume`` are a ValueError unless ``overwrite`` (which moves the old files aside).
    ``previous``: :func:`~polestar.bench.item_log.check_previous`'s reading of those files when the caller has
    already made it with the same settings (the CLI does, to fail before loading the model), else read here.
    ``resume_any_timing`` reuses finished items timed with other threads, compile, device, dtype or batch size;
    the result then carries ``"timings": {"mixed": true, "differences": [...]}`` (also in the manifest), and so
    does every policy's summary that reused such items.
    """
    check_run_args(policies, n, batch_size)
    task = get_task(task_name)
    check_entries(policies, options)  # fail on a bad policy or option before any decoding
    if resume and json_out is None:
        raise ValueError("--resume needs --json OUT.json (the finished items are kept beside it)")
    if data is None:
        check_problem_count(task_name, n)
    header = run_header(model_name, task_name, n, data, decoding, options, batch_size, dtype, device)  # as asked
    labels = {name: policy_label(name, options) for name in policies}
    manifest = build_manifest({**header, "policies": policies, "labels": labels}, str(device))
    rank, world_size = distributed.init_from_env(device)
    device = distributed.local_device(device)
    if json_out and previous is None:
        previous = check_previous(json_out, header, resume, overwrite, resume_any_timing)
    timings = mixed_timings(previous)
    manifest["timings"] = timings
    distributed.barrier()  # every rank has read the earlier files before rank 0 moves any aside
    log = ItemLog(json_out, header, rank, world_size) if json_out else None
    finished = previous.records if previous is not None else {}
    if log is not None:
        log.start(previous, overwrite, extra=[Path(json_out), manifest_path(json_out)])
        if rank == 0:
            write_atomic(manifest_path(json_out), json.dumps(manifest, indent=1))
    model = polestar.load(model_name, dtype=dtype, device=device)
    problems = load_problems(task_name, n, data, show_progress=show_progress and rank == 0)
    starts = list(range(0, len(problems), batch_size))
    mine = [starts[b] for b in distributed.shard(len(starts), rank, world_size)]
    items, summary = [], {}
    bar = progress_bar(sum(len(problems[s : s + batch_size]) for s in mine) * len(policies),
                       show_progress and rank == 0)
    for name in policies:
        entry = bench_entry(name)
        opts = entry.overrides(options)
        local = []
        reused = False
        warmed_up = False  # this policy's first decoded batch (compile, first allocations) is kept off the bar's rate
        for start in mine:
            chunk = problems[start : start + batch_size]
            keys = [(name, start + i) for i in range(len(chunk))]
            if all(k in finished for k in keys):
                records = [finished[k] for k in keys]
                reused = True
            else:
                first_compile = decoding.get("compile") and not local and show_progress and rank == 0
                if first_compile:
                    _say(bar, f"compiling {name}: its layer regions, at the first steps of each step phase...")
                compiled_before = compile_seconds()
                records, _ = decode_batch(model, task, chunk, entry.policy, opts, decoding)
                compiled = compile_seconds() - compiled_before
                if bar is not None and warmed_up:  # the bar's rate and ETA count decoding only
                    bar.start_t += compiled
                if first_compile:
                    _say(bar, f"compiled {name} in {compiled:.1f} s")
                for i, rec in enumerate(records):
                    rec["index"] = start + i
                    rec["policy"] = name  # the entry: the policy, with its own settings if it has any
                    rec["label"] = labels[name]
                if log is not None:
                    log.append(records)
            local += records
            if bar is not None and not warmed_up and not all(k in finished for k in keys):
                restart_rate(bar, len(chunk))
                warmed_up = True
            elif bar is not None:
                bar.update(len(chunk))
        gathered = distributed.all_gather_objects((local, reused))
        records = sorted((r for part, _ in gathered for r in part), key=lambda r: r["index"])
        items += [public_item(r) for r in records]
        summary[name] = {"label": labels[name], "overrides": {**applied_overrides(entry.policy, options), **entry.own},
                         **summarize(records, polestar.assemble(entry.policy, opts).describe())}
        if timings["mixed"] and any(part_reused for _, part_reused in gathered):
            summary[name]["timings"] = timings
    if bar is not None:
        bar.close()
    return {
        "model": model_name, "task": task_name, "n": len(problems), "decoding": decoding, "options": options,
        "items": items, "summary": summary, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "manifest": manifest,
        "dtype": dtype_name(model.dtype),  # the dtype the weights were loaded in
        "timings": timings,
    }


def restart_rate(bar, done: int) -> None:
    """Advance ``bar`` by ``done`` problems and count its rate (and so its ETA) from now on, over the problems still
    to come: a policy's first batch compiles, allocates and warms caches, and a rate that included it would read
    hours for a minute's work."""
    bar.n += done
    bar.initial = bar.n
    bar.start_t = bar.last_print_t = bar._time()
    bar.last_print_n = bar.n
    bar.refresh()


def _say(bar, line: str) -> None:
    """One line on stderr, above the progress bar when there is one."""
    if bar is not None:
        bar.write(line, file=sys.stderr)
    else:
        print(line, file=sys.stderr, flush=True)


def mixed_timings(previous: Previous | None) -> dict[str, Any]:
    """``{"mixed": bool, "differences": [...]}``: whether the reused items were timed with other settings
    (``--resume-any-timing``) and which (``["threads: 2 -> 1"]``)."""
    differences = list(previous.mixed_timing) if previous is not None else []
    return {"mixed": bool(differences), "differences": differences}


def profile_policies(model_name, task_name, policies, n, options, decoding, batch_size=1, dtype="float32",
                     device="cpu") -> dict[str, dict[str, float]]:
    """Share of step time per stage (``polestar.profiling`` scopes) for each policy, on ``n`` problems."""
    from polestar.profiling import FORWARD_SCOPES, profile_shares

    task = get_task(task_name)
    model = polestar.load(model_name, dtype=dtype, device=device)
    problems = load_problems(task_name, n)
    out = {}
    for name in policies:
        entry = bench_entry(name)
        opts = entry.overrides(options)
        times = profile_shares(lambda entry=entry, opts=opts: run_policy(model, task, problems, entry.policy, opts,
                                                                         decoding, batch_size))
        total = times.pop("total")
        shares = {"model_forward": (times["forward"] - sum(times[k] for k in FORWARD_SCOPES)) / total}
        shares.update({k: times[k] / total for k in (*FORWARD_SCOPES, "commit")})
        shares["other"] = max(0.0, 1.0 - sum(shares.values()))
        out[name] = shares
    return out


def format_profile(profile: dict[str, dict[str, float]]) -> str:
    from polestar.profiling import FORWARD_SCOPES

    cols = ["model_forward", *FORWARD_SCOPES, "commit", "other"]
    lines = ["share of step time (%)", f"{'policy':18s} " + " ".join(f"{c[:10]:>10s}" for c in cols)]
    for name, shares in profile.items():
        lines.append(f"{name:18s} " + " ".join(f"{100 * shares[c]:10.1f}" for c in cols))
    return "\n".join(lines)


def optional_overrides(options: dict[str, Any]) -> dict[str, Any]:
    """``--set`` options as optional overrides (``key?``): each applies to the policies whose stages take it
    (see :func:`polestar.assemble`)."""
    return Overrides.parse(options).as_optional().as_dict()


def _alone(key: str, value: Any, options: dict[str, Any]) -> Overrides:
    """``key=value`` with the other stage swaps among ``options``, those as optional overrides."""
    others = Overrides.parse({k: v for k, v in options.items() if k != key}).swaps_only().as_optional()
    return others.merge({key: value})


def _accepts(policy: str, key: str, value: Any, options: dict[str, Any]) -> bool:
    """Whether ``policy``, with the stage swaps of ``options``, has a stage taking ``key=value``."""
    try:
        polestar.assemble(policy, _alone(key, value, options))
    except ValueError:
        return False
    return True


def check_entries(policies: list[str], options: dict[str, Any]) -> None:
    """Every ``--policies`` entry assembles with its own settings (each must apply) and the ``--set`` options that
    apply to it, and every ``--set`` option applies to at least one entry; else a ValueError naming the entry or
    the option (with the options there are)."""
    for name in policies:
        entry = bench_entry(name)
        try:
            polestar.assemble(entry.policy, entry.overrides(options))
        except (ValueError, TypeError) as err:
            where = f"--policies entry {name!r}" if entry.own else "--set"
            raise type(err)(f"{where}: {err}") from None
    for key, value in options.items():
        if not any(_accepts(bench_entry(name).policy, key, value, options) for name in policies):
            try:
                polestar.assemble(bench_entry(policies[0]).policy, _alone(key, value, options))
            except (ValueError, TypeError) as err:  # raises, listing the options there are
                raise type(err)(f"--set: {err}") from None


def check_run_args(policies: list[str], n: int, batch_size: int) -> None:
    """ValueError, before any work, for an empty policy list or ``n`` / ``batch_size`` below 1 (Python API)."""
    if not policies:
        raise ValueError(f"no policies given; name at least one of: {', '.join(polestar.policy_names())}")
    for name, value in (("n", n), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer of at least 1, got {value!r}")


def check_problem_args(args, options: dict[str, Any], decoding: dict[str, Any]) -> list[str]:
    """Every check of ``polestar bench`` / ``anatomy`` arguments, before any model is loaded; returns the policies.

    Raises :class:`~polestar.cli_checks.UsageError` (one line naming the flag and the fix) for: ``--policy``
    (bench takes ``--policies``), an empty or unknown ``--policies``, ``--n`` / ``--batch-size`` < 1, a bad
    decoding layout, a ``--set`` that the single chosen policy does not have (or, with several policies, that
    none has), ``--device``, ``--model``, ``--task``, a malformed ``--data`` file (file and line named) and
    ``--json`` / ``--plot`` outputs whose directory is missing (and ``--plot`` without matplotlib).
    """
    from polestar import cli_checks as cc

    if getattr(args, "policy", None) is not None:
        raise cc.UsageError(f"this command takes --policies (comma-separated), not --policy; "
                            f"use --policies {args.policy}")
    policies = cc.split_policies(args.policies)
    cc.check_positive("--n", args.n)
    cc.check_positive("--batch-size", args.batch_size)
    cc.check_generation_config(decoding)
    if len(policies) == 1:  # exactly one policy asked for: every --set must apply to it
        entry = bench_entry(policies[0])
        try:
            polestar.assemble(entry.policy, Overrides.parse(options).merge(entry.own))
        except (ValueError, TypeError) as err:
            where = f"--policies entry {policies[0]!r}" if entry.own else "--set"
            raise cc.UsageError(f"{where}: {cc.one_line(err)}") from None
    try:
        check_entries(policies, options)
    except (ValueError, TypeError) as err:
        raise cc.UsageError(cc.one_line(err)) from None
    cc.check_device(args.device)
    cc.check_model(args.model)
    cc.get_task_or_usage(args.task)
    for flag, path in (("--json", args.json_out), ("--plot", getattr(args, "plot", None))):
        cc.check_output_file(flag, path)
    cc.check_plot_backend(getattr(args, "plot", None))
    if args.data is None:
        try:
            check_problem_count(args.task, args.n)
        except ValueError as err:
            raise cc.UsageError(cc.one_line(err)) from None
    else:
        try:
            load_problems(args.task, args.n, args.data)
        except (ValueError, FileNotFoundError) as err:
            line = cc.one_line(err)
            raise cc.UsageError(line if line.startswith("--data") else f"--data: {line}") from None
    return policies


def run_bench_cli(args, options: dict[str, Any], decoding: dict[str, Any]) -> int:
    """``polestar bench``: check the arguments and output paths, run, then (rank 0) print the table and write
    JSON / plot."""
    from polestar.cli_checks import UsageError, working
    from polestar.threads import apply_thread_flag

    policies = check_problem_args(args, options, decoding)
    resume, overwrite = getattr(args, "resume", False), getattr(args, "overwrite", False)
    any_timing = getattr(args, "resume_any_timing", False)
    if (resume or overwrite or any_timing) and not args.json_out:
        flag = "--resume" if resume else "--overwrite" if overwrite else "--resume-any-timing"
        raise UsageError(f"{flag} needs --json OUT.json (the finished items are kept beside it)")
    threads = apply_thread_flag(args)
    outputs = [args.json_out, args.plot]
    if args.json_out:
        outputs += [items_path(args.json_out), manifest_path(args.json_out)]
    check_writable(outputs)
    previous = None
    if args.json_out:
        header = run_header(args.model, args.task, args.n, args.data, decoding, options, args.batch_size, args.dtype,
                            args.device, threads)
        try:
            previous = check_previous(args.json_out, header, resume, overwrite, any_timing)
        except ValueError as err:
            raise UsageError(str(err)) from None
        if resume and distributed.rank() == 0:
            counts = ", ".join(f"{p} {k}" for p, k in sorted(previous.counts().items())) or "none"
            where = ", ".join(str(p) for p in previous.paths) or "no items file yet"
            print(f"resume: reusing {len(previous.records)} finished items ({counts}) from {where}; written with "
                  f"{describe_settings(previous.header) if previous.header else 'no header'}", file=sys.stderr)
            if previous.mixed_timing:
                print(f"resume: timings mixed ({'; '.join(previous.mixed_timing)}): TPS and wall time blend both "
                      "setups (--resume-any-timing)", file=sys.stderr)
        elif overwrite and previous.paths and distributed.rank() == 0:
            print(f"overwrite: the earlier files ({', '.join(str(p) for p in previous.paths)}) are kept beside the "
                  "new ones as *.old-<time>", file=sys.stderr)
    if distributed.rank() == 0:
        from polestar.inspection import announce_model

        announce_model(args.model, args.dtype)
    try:
        with working("bench"):
            result = run_bench(args.model, args.task, policies, args.n, options, decoding, args.batch_size,
                               args.data, args.dtype, args.device, show_progress=not args.quiet,
                               json_out=args.json_out, resume=resume, overwrite=overwrite, previous=previous,
                               resume_any_timing=any_timing)
        rank = distributed.rank()
        distributed.barrier()  # every rank finishes before any leaves the process group
    finally:
        distributed.shutdown()
    if rank != 0:  # rank 0 reports the gathered result
        return 0
    title = f"{args.model} / {args.task} / n={result['n']} / gen {args.gen_length} block {args.block_length}"
    if not args.stop_at_eos:
        title += " / no stop at EOS"
    if options:
        title += " / set " + " ".join(f"{k}={value_text(v)}" for k, v in sorted(options.items()))
    print(format_table(result["summary"], title))
    if result["timings"]["mixed"]:
        print("timings mixed (--resume-any-timing: reused items were timed with "
              f"{'; '.join(result['timings']['differences'])}): TPS and wall time blend both setups")
    if args.compile:
        print("compile time (excluded from TPS): " + ", ".join(
            f"{name} {s['compile_s']:.1f}s" for name, s in result["summary"].items()))
    if args.profile:
        result["profile"] = profile_policies(args.model, args.task, policies, min(args.n, 8), options, decoding,
                                             args.batch_size, args.dtype, args.device)
        print(format_profile(result["profile"]))
    if args.json_out:
        write_atomic(args.json_out, json.dumps(result, indent=1))
    if args.plot:
        pareto_plot(result["summary"], args.plot, title)
    failed = [item for item in result["items"] if item.get("error")]
    if failed:
        from polestar.cli_checks import RuntimeFailure

        first = failed[0]
        raise RuntimeFailure(f"{len(failed)} of {len(result['items'])} problem(s) stopped early, scored as wrong; "
                             "first: "
                             f"policy {first['policy']}, input {first['input']!r}: {first['error']} (items carry "
                             "'error' in --json)")
    return 0
