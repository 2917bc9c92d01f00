"""The subcommands the benchmark adds to ``polestar``: ``bench``, ``anatomy`` and ``agree``.

Each ``add_*`` function adds one subparser with its handler; pyproject.toml registers them in the
``polestar.commands`` entry-point group, from which :func:`polestar.cli.add_commands` adds them, so the command line
reaches the benchmark without importing it. The handlers import the harness only when their command runs.
"""

from __future__ import annotations

import argparse
import json

from polestar.cli import add_decoding_args, add_plugin_arg, decoding_from_args
from polestar.cli_checks import UsageError, parse_sets, working


def _add_problem_args(p: argparse.ArgumentParser, policies: str, n: int, batch_size: int) -> None:
    """Model, task, policies and problems of `bench` and `anatomy`."""
    p.add_argument("--model", default="tiny-llada",
                   help="a shipped checkpoint name or an HF-format directory (default tiny-llada)")
    p.add_argument("--task", default="arith", help="the task whose problems are generated (default arith)")
    p.add_argument("--policies", default=policies,
                   help=f"comma-separated policy names, each optionally with settings of its own, "
                        f"polestar[drift=kl] (default {policies})")
    p.add_argument("--n", "--num-problems", dest="n", type=int, default=n,
                   help=f"number of problems (default {n}; write --num-problems under torchrun, whose parser takes "
                        "--n for its own)")
    p.add_argument("--batch-size", type=int, default=batch_size,
                   help=f"problems decoded together (default {batch_size})")
    p.add_argument("--data", default=None, help="JSONL with {input, output} records instead of generated problems")
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT.json")
    p.add_argument("--quiet", action="store_true", help="no progress bar on stderr")


def cmd_bench(args) -> int:
    from polestar.bench.harness import run_bench_cli

    return run_bench_cli(args, parse_sets(args.set), decoding_from_args(args))


def bench_interrupted_line(args) -> str:
    """What a Ctrl-C of ``polestar bench`` left behind: with ``--json`` its finished items, for ``--resume``."""
    if not args.json_out:
        return ("interrupted; nothing was kept (with --json OUT.json a bench keeps its finished items, and --resume "
                "continues it)")
    from polestar.bench.item_log import all_items_paths

    kept = ", ".join(str(p) for p in all_items_paths(args.json_out)) or "no items file yet"
    return f"interrupted; finished items are kept ({kept}): rerun the same command with --resume to continue"


def cmd_agree(args) -> int:
    from polestar.bench.agreement import agree_cli

    if (args.policy_a is None) != (args.policy_b is None):
        raise UsageError("--policy-a and --policy-b go together; give both or neither")
    return agree_cli(args.a, args.b, args.policy_a, args.policy_b, args.allow_differences)


def cmd_anatomy(args) -> int:
    from polestar.bench.anatomy import commit_anatomy, format_anatomy
    from polestar.bench.harness import check_problem_args
    from polestar.output_files import check_writable, write_atomic

    sets = parse_sets(args.set)
    decoding = decoding_from_args(args)
    policies = check_problem_args(args, sets, decoding)
    check_writable([args.json_out])
    from polestar.inspection import announce_model
    from polestar.threads import apply_thread_flag

    apply_thread_flag(args)

    announce_model(args.model, args.dtype)
    with working("anatomy"):
        result = commit_anatomy(args.model, args.task, policies, args.n, sets, decoding, args.batch_size, args.data,
                                args.dtype, args.device)
    title = (f"{args.model} / {args.task} / n={args.n} / commit anatomy"
             + ("" if args.stop_at_eos else " / no stop at EOS"))
    if sets:  # the overrides belong in the title, as in bench's
        title += " / set " + " ".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}"
                                      for k, v in sorted(sets.items()))
    print(format_anatomy(result, title))
    if args.json_out:
        write_atomic(args.json_out, json.dumps(result, indent=1))
    return 0


def add_bench(sub) -> None:
    """``polestar bench``: accuracy / throughput of policies on a task (:mod:`polestar.bench.harness`)."""
    b = sub.add_parser("bench", help="accuracy / throughput of policies on a task")
    _add_problem_args(b, "baseline,parallel,fast-dllm", n=200, batch_size=1)
    b.add_argument("--plot", default=None, metavar="OUT.png")
    b.add_argument("--profile", action="store_true", help="report the share of step time per stage")
    b.add_argument("--resume", action="store_true",
                   help="reuse the finished items of an interrupted run with the same settings (kept beside --json "
                        "in OUT.items.jsonl)")
    b.add_argument("--resume-any-timing", action="store_true",
                   help="with --resume, reuse items timed with other threads, compile, device, dtype or batch size "
                        "(refused otherwise); the summary and manifest then mark the timings as mixed")
    b.add_argument("--overwrite", action="store_true",
                   help="start over although OUT.items.jsonl holds finished items (the old files are kept beside "
                        "the new ones as *.old-<time>)")
    add_decoding_args(b, policy=False)
    b.set_defaults(func=cmd_bench, on_interrupt=bench_interrupted_line)


def add_anatomy(sub) -> None:
    """``polestar anatomy``: where a policy's commits come from, by confidence (:mod:`polestar.bench.anatomy`)."""
    an = sub.add_parser("anatomy", help="where a policy's commits come from, by confidence (diagnostic)")
    _add_problem_args(an, "fast-dllm,polestar", n=100, batch_size=50)
    add_decoding_args(an, policy=False)
    an.set_defaults(func=cmd_anatomy)


def add_agree(sub) -> None:
    """``polestar agree``: token mismatch between two bench runs (:mod:`polestar.bench.agreement`)."""
    a = sub.add_parser("agree", help="token mismatch between two `polestar bench --json` runs of the same problems")
    a.add_argument("a", metavar="A.json")
    a.add_argument("b", metavar="B.json")
    a.add_argument("--policy-a", help="compare only this policy of A ... (needs --policy-b)")
    a.add_argument("--policy-b", help="... with this policy of B")
    a.add_argument("--allow-differences", action="store_true",
                   help="compare runs whose manifests differ in more than one setting")
    a.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    add_plugin_arg(a)
    a.set_defaults(func=cmd_agree)
