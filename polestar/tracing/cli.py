"""``polestar trace``: its arguments and its run (the parser entry and the dispatch live in :mod:`polestar.cli`).

Example: ``polestar trace --model tiny-llada-noisy --task sudoku --index 0 --policies fast-dllm,polestar --out DIR``
writes ``DIR/trace.html`` (self-contained), ``DIR/trace.json`` and the PNG figures."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from polestar import cli_checks as cc


def add_trace_args(p: argparse.ArgumentParser) -> None:
    """The arguments of ``polestar trace`` besides the decoding ones."""
    p.add_argument("--model", default="tiny-llada", help="checkpoint directory or shipped name")
    p.add_argument("--prompt", default=None, help="the prompt to decode (with --task: the task's input, formatted)")
    p.add_argument("--task", default=None, help="a registered task: with --index, decode that test item")
    p.add_argument("--index", type=int, default=None, help="the task's test item to decode (0 = the first)")
    p.add_argument("--data", default=None, help="JSONL with {input, output} records instead of generated items")
    p.add_argument("--policies", default="fast-dllm,polestar", help="one policy, or two side by side (comma-separated)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="folder for trace.html, trace.json and the PNGs (created inside an existing folder)")
    p.add_argument("--title", default=None, help="the page's title (default: the policies, model and item)")
    p.add_argument("--no-png", dest="png", action="store_false", help="write the HTML page and data only")


def _prompt(args) -> tuple[str, str | None, str]:
    """The prompt, the reference answer (None when unknown) and a label of the item; usage errors first."""
    if args.index is not None and args.task is None:
        raise cc.UsageError("--index picks an item of --task; add --task NAME")
    if args.prompt is None and args.task is None:
        raise cc.UsageError("give --prompt TEXT, or --task NAME --index N")
    if args.prompt is not None and args.index is not None:
        raise cc.UsageError("give --prompt or --index, not both")
    if args.prompt is not None:
        cc.check_utf8_prompts("--prompt", [args.prompt])
        if args.task is None:
            return args.prompt, None, "prompt"
        cc.check_task_prompts(args.task, [args.prompt])
        return cc.get_task_or_usage(args.task).format_prompt(args.prompt), None, f"{args.task} prompt"
    task = cc.get_task_or_usage(args.task)
    index = 0 if args.index is None else args.index
    if index < 0:
        raise cc.UsageError(f"--index must be >= 0, got {index}")
    from polestar.problems import load_problems

    try:
        problems = load_problems(args.task, index + 1, args.data)
    except (ValueError, FileNotFoundError) as err:
        raise cc.UsageError(f"--data: {cc.one_line(err)}") from None
    if index >= len(problems):
        raise cc.UsageError(f"--index {index}: --data {args.data} holds {len(problems)} record(s)")
    item = problems[index]
    return task.format_prompt(item.input), item.output or None, f"{args.task} #{index}"


def run_trace_cli(args, sets: dict[str, Any], decoding: dict[str, Any]) -> int:
    """Check every argument, then trace and print where the files went (one line per policy, then the paths)."""
    from polestar.tracing.run import check_policies, trace

    if getattr(args, "policy", None) is not None:
        raise cc.UsageError(f"trace takes --policies (one, or two comma-separated), not --policy; "
                            f"use --policies {args.policy}")
    if decoding.pop("compile", False):
        raise cc.UsageError("trace reads every step back and runs it eagerly; drop --compile")
    names = cc.split_policies(args.policies, entries=False)
    try:
        check_policies(names, sets)
    except (ValueError, TypeError) as err:
        raise cc.UsageError(f"--policies/--set: {cc.one_line(err)}") from None
    cc.check_generation_config(decoding)
    cc.check_device(args.device)
    cc.check_model(args.model)
    prompt, reference, label = _prompt(args)
    out = Path(args.out)
    cc.check_outside_source_or_usage("--out", out)
    if out.exists() and not out.is_dir():
        raise cc.UsageError(f"--out {args.out} is a file; give a folder (it is created when missing)")
    parent = out.expanduser().parent
    if not out.exists() and not parent.is_dir():  # the rule of every output flag: its folder must exist
        raise cc.UsageError(f"--out {args.out}: directory {parent} does not exist; create it first "
                            f"(mkdir -p {parent})")
    if args.png:
        try:
            from polestar.tracing.png import check_backend

            check_backend()
        except ValueError as err:
            raise cc.UsageError(cc.one_line(err)) from None
    import polestar
    from polestar.threads import apply_thread_flag

    apply_thread_flag(args)
    start = time.perf_counter()
    with cc.working(f"loading model {args.model}"):
        model = polestar.load(args.model, dtype=args.dtype, device=args.device)
    cc.check_finite_weights(model, args.model)
    title = args.title or f"{' vs '.join(names)} · {args.model} · {label}"
    with cc.working("tracing"):
        result = trace(model, prompt, names, out, title=title, reference=reference, png=args.png, **decoding, **sets)
    for f in result.figures:
        print(f"[{f.policy}] {f.nfe} steps -> {f.text!r}")
    if len(result.figures) == 2:
        diff = result.first_difference
        print("outputs identical" if diff is None else
              f"first difference at generated position {diff - result.prompt_len} (column {diff})")
    for path in (result.html, result.json, *result.pngs):
        print(path)
    print(f"trace: {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return 0
