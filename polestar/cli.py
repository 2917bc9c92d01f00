"""Command line: ``polestar generate``, ``polestar policies``, ``polestar trace``, ``polestar lm-eval``, and the
subcommands other packages register in the ``polestar.commands`` entry-point group (:func:`add_commands`): the
benchmark's ``polestar bench``, ``polestar agree`` and ``polestar anatomy``.

Bad input is answered before any work with one ``error: ...`` line naming the problem and the fix (exit code 2);
a failure while working is one line too (exit code 1); ``--debug`` adds the traceback. The checks live in
:mod:`polestar.cli_checks`. ``polestar lm-eval`` hands its arguments to lm-eval (:mod:`polestar.evaluation.cli`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any

import attrs

from .cli_checks import (
    RuntimeFailure,
    UsageError,
    check_device,
    check_finite_weights,
    check_generation_config,
    check_model,
    check_positive,
    check_task_prompts,
    check_utf8_prompts,
    get_task_or_usage,
    one_line,
    parse_sets,
    working,
)
from .overrides import Overrides
from .plugins import load_plugins
from .threads import apply_thread_flag
from .tracing.cli import add_trace_args

__all__ = ["build_parser", "main", "parse_sets"]


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one ``error: ...`` line (exit code 2) instead of usage + error."""

    #: set when no package registered a subcommand (:func:`add_commands`): the install's metadata is out of date
    hint: str = ""

    def error(self, message: str):
        rank, world_size = launcher_rank()
        if world_size > 1 and rank != 0:  # the same usage error on every rank of a launch: rank 0 prints it
            self.exit(2)
        self.exit(2, f"error: {self.prog}: {message}; see `{self.prog} --help`{self.hint}\n")


def launcher_rank() -> tuple[int, int]:
    """``(rank, world_size)`` of this process under a launcher (``torchrun`` sets ``RANK`` / ``WORLD_SIZE``),
    ``(0, 1)`` without one."""
    return int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)


def _package_version() -> str:
    """The installed distribution's version (``polestar-dllm``), else ``polestar.__version__``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("polestar-dllm")
    except PackageNotFoundError:  # a source tree that is not installed
        from polestar import __version__

        return __version__


def add_plugin_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE_OR_FILE",
                   help="import a module (dotted name) or a .py file that registers stages or policies before the "
                        "command runs (repeatable; see polestar.plugins)")


def add_decoding_args(p: argparse.ArgumentParser, policy: bool = True) -> None:
    if policy:
        p.add_argument("--policy", default="fast-dllm", help="policy name (see `polestar policies`)")
    else:  # bench / anatomy take --policies; a --policy is answered with a pointer to it, never ignored
        p.add_argument("--policy", default=None, help=argparse.SUPPRESS)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="stage option or stage swap, e.g. threshold=0.8, commit=factor, refresh.refresh_interval=2")
    p.add_argument("--gen-length", type=int, default=64)
    p.add_argument("--block-length", type=int, default=16)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-stop-at-eos", dest="stop_at_eos", action="store_false",
                   help="decode every block even after a sequence has committed its EOS (as LLaDA's and Fast-dLLM's "
                        "reference loops do); by default a sequence stops there")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights' dtype (default: the checkpoint's torch_dtype)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", action="store_true",
                   help="compile the layer regions with torch.compile, once whatever the depth (compile time is "
                        "reported apart from TPS; tokens are the same as without)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch intra-op threads (default: OMP_NUM_THREADS when set, else 1 for a model narrower "
                        "than d_model 1024, else torch's default; see docs/cli.md)")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="on an error, print the traceback too")
    add_plugin_arg(p)


def decoding_from_args(args) -> dict[str, Any]:
    """The keyword arguments of :func:`polestar.generate` set by :func:`add_decoding_args` (less dtype/device)."""
    return dict(gen_length=args.gen_length, block_length=args.block_length, steps=args.steps,
                temperature=args.temperature, seed=args.seed, stop_at_eos=args.stop_at_eos, compile=args.compile)


def _check_policy(policy: str, sets: Overrides) -> None:
    """The policy exists and every ``--set`` applies to one of its stages with a valid value. Strict: one policy
    was asked for, so an option none of its stages has is an error, never silently ignored."""
    import polestar

    try:
        polestar.assemble(policy, sets)
    except (ValueError, TypeError) as err:
        raise UsageError(f"--policy {policy}: {one_line(err)}") from None


def _load_checked(args):
    """Load ``--model`` (a failure is a runtime failure naming it) and refuse non-finite weights."""
    import polestar
    from polestar.inspection import announce_model

    announce_model(args.model, args.dtype)
    with working(f"loading model {args.model}"):
        model = polestar.load(args.model, dtype=args.dtype, device=args.device)
    check_finite_weights(model, args.model)
    return model


def _check_prompts_fit(model, prompts: list[str], gen_length: int, chat: bool = False,
                       system: str | None = None) -> None:
    """Each prompt encodes to ≥ 1 in-vocabulary token (after the chat template with ``chat``) and fits the model's
    context with ``gen_length``."""
    import polestar

    try:
        _, mask = polestar.encode_prompts(model, prompts, chat=chat, system=system)
    except ValueError as err:
        raise UsageError(one_line(err)) from None
    limit = model.spec.max_seq_len
    for i, n in enumerate(mask.sum(dim=1).tolist()):
        if n + gen_length > limit:
            raise UsageError(f"prompt #{i + 1} has {n} tokens; with --gen-length {gen_length} that is "
                             f"{n + gen_length} > the model's context ({limit}); "
                             "shorten the prompt or lower --gen-length")


class BatchProgress:
    """One stderr line per finished batch (``generate: batch 2/5 · 64/150 prompts · 3.1s · ETA 4.6s``), shown only
    when there is more than one batch and ``--quiet`` is not given."""

    def __init__(self, n_prompts: int, n_batches: int, quiet: bool):
        self.n_prompts, self.n_batches = n_prompts, n_batches
        self.show = n_batches > 1 and not quiet
        self.done = self.batches = 0
        self.start = time.perf_counter()

    def update(self, n: int) -> None:
        self.done += n
        self.batches += 1
        if not self.show:
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * (self.n_prompts - self.done)
        print(f"generate: batch {self.batches}/{self.n_batches} · {self.done}/{self.n_prompts} prompts · "
              f"{elapsed:.1f}s · ETA {eta:.1f}s", file=sys.stderr, flush=True)


#: settings of `generate` a preset gives when the flag is absent, and their values without a preset (temperature
#: None: generation_config.json's, else 0; steps stay None = one step per token, the paper's steps = gen length)
_PRESET_FLAGS = {"policy": "fast-dllm", "gen_length": 64, "block_length": 16, "temperature": None}


def _preset_for(args):
    """`--preset NAME`, or with `--preset auto` the preset recognised from the checkpoint's config.json (read
    before the weights are loaded, so every setting is checked first)."""
    from polestar import presets
    from polestar.models.loading import read_config, resolve_checkpoint

    if args.preset == "none":
        return None
    if args.preset != "auto":
        return presets.get_preset(args.preset)
    directory = resolve_checkpoint(args.model)
    return presets.preset_for_config(read_config(directory), directory)


def cmd_generate(args) -> int:
    import polestar
    from polestar import presets
    from polestar.models.loading import dtype_name
    from polestar.stats import RunStats

    if args.preset not in ("auto", "none"):
        try:
            presets.get_preset(args.preset)
        except ValueError as err:
            raise UsageError(one_line(err)) from None
    check_positive("--batch-size", args.batch_size)
    check_device(args.device)
    check_model(args.model)
    preset = _preset_for(args)
    given = {"policy": preset.policy, **preset.decoding} if preset is not None else {}
    for key, fallback in _PRESET_FLAGS.items():  # explicit flags win over the preset
        if getattr(args, key) is None:
            setattr(args, key, given.get(key, fallback))
    sets = Overrides.parse(preset.options if preset is not None else {}).merge(parse_sets(args.set))
    decoding = decoding_from_args(args)
    # temperature None: generation_config.json's value, known once the model is loaded
    check_generation_config({k: v for k, v in decoding.items() if v is not None})
    check_utf8_prompts("--prompt", args.prompt)
    if args.system is not None:
        check_utf8_prompts("--system", [args.system])
    check_task_prompts(args.task, args.prompt)
    _check_policy(args.policy, sets)
    if args.system is not None and not args.chat:
        raise UsageError("--system is the system turn of a chat prompt; add --chat")
    if preset is not None:
        print(f"[preset {preset.name}] {preset.description}", file=sys.stderr)
    prompts = list(args.prompt)
    if args.task:
        task = get_task_or_usage(args.task)
        prompts = [task.format_prompt(p) for p in prompts]
    apply_thread_flag(args)
    model = _load_checked(args)
    _check_prompts_fit(model, prompts, args.gen_length, args.chat, args.system)
    size = args.batch_size
    batches = [list(range(i, min(i + size, len(prompts)))) for i in range(0, len(prompts), size)]
    progress = BatchProgress(len(prompts), len(batches), args.quiet)
    outs = []
    for rows in batches:
        first_compile = args.compile and not outs
        if first_compile and not args.quiet:
            print(f"compiling {args.policy}: its layer regions, at the first steps of each step phase...",
                  file=sys.stderr, flush=True)
        with working("decoding"):
            out = polestar.generate(model, [prompts[i] for i in rows], policy=args.policy, chat=args.chat,
                                    system=args.system, **decoding, **sets.as_dict())
        if first_compile and not args.quiet:
            print(f"compiled in {out.stats.compile_s:.1f} s", file=sys.stderr, flush=True)
        outs.append((rows, out))
        progress.update(len(rows))
    for rows, out in outs:
        if args.json:  # one JSON object per batch (one line each)
            print(json.dumps({
                "policy": args.policy,
                "dtype": dtype_name(model.dtype),
                "stages": out.pipeline.describe(),
                "tokens": out.tokens.tolist(),
                "prompt_ids": out.prompt_ids,
                "prompt_len": out.prompt_len,
                "texts": out.texts,
                "stats": out.stats.as_dict(),
            }))
            continue
        texts = out.texts or [str(row) for row in out.generations.tolist()]
        for i, text in zip(rows, texts):
            print(f"{args.prompt[i]!r} -> {text!r}")
    errors = [(rows[i], err) for rows, out in outs for i, err in out.stats.errors]
    if errors:
        first, err = errors[0]
        more = f" (and {len(errors) - 1} more prompt(s))" if len(errors) > 1 else ""
        raise RuntimeFailure(f"prompt #{first + 1} {args.prompt[first]!r} stopped early: {err}{more}; its output is "
                             "incomplete (a float32 run may avoid it: --dtype float32)")
    s = RunStats.merge([out.stats for _, out in outs])
    compiled = f" compile={s.compile_s:.2f}s compiled_steps={s.compiled_steps}" if args.compile else ""
    drift = outs[0][1].pipeline.describe().get("drift") if outs else None  # the metric a drift policy runs on
    label = args.policy + (f" drift={drift['name']}" if drift else "")
    print(f"[{label}] nfe={s.nfe} tpf={s.tpf:.2f} tps={s.tps:.1f} wall={s.wall_s:.2f}s{compiled} "
          f"token_layer_evals={s.token_layer_evals} proxy_query_evals={s.proxy_query_evals} "
          f"weight_bytes/token={s.weight_bytes_per_token:.0f} weight_bytes/step={s.weight_bytes_per_step:.0f} "
          f"kv_bytes={s.kv_bytes}" + (f" revoked={s.revoked}" if s.revoked else ""), file=sys.stderr)
    return 0


def cmd_presets(args) -> int:
    from polestar import presets

    info = {name: presets.get_preset(name).as_dict() for name in presets.preset_names()}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for name, p in info.items():
        decoding = ", ".join(f"{k}={v}" for k, v in p["decoding"].items())
        options = ", ".join(f"{k}={v}" for k, v in Overrides.parse(p["options"]).items())
        print(f"{name:22s} policy={p['policy']} {decoding}\n{'':22s} {options}\n{'':22s} {p['description']}")
    return 0


def cmd_policies(args) -> int:
    from polestar import policy, presets, registry

    info = {
        "policies": {
            name: {"stages": policy.composition(name), "description": policy.get_policy(name).description}
            for name in policy.policy_names()
        },
        "stages": {
            kind: {
                name: {k: (v if not isinstance(v, attrs.Factory) else None)
                       for k, v in registry.config_fields(kind, name).items()}
                for name in registry.names(kind)
            }
            for kind in registry.KINDS
        },
        "presets": {name: presets.get_preset(name).as_dict() for name in presets.preset_names()},
        # stages from outside the package (plugins), by kind and name: the file each was loaded from
        "plugins": {
            kind: {name: registry.source_file(registry.lookup(kind, name)) or registry.lookup(kind, name).__module__
                   for name in registry.names(kind) if not registry.is_builtin(registry.lookup(kind, name))}
            for kind in registry.KINDS
        },
    }
    info["plugins"] = {kind: found for kind, found in info["plugins"].items() if found}
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    plugins = info["plugins"]
    print("policies:")
    for name, p in info["policies"].items():
        stages = ", ".join(f"{k}={v}" + (" [plugin]" if v in plugins.get(k, {}) else "")
                           for k, v in p["stages"].items())
        print(f"  {name:18s} {stages}\n  {'':18s} {p['description']}")
    print("stages:")
    for kind, stages in info["stages"].items():
        for name, cfg in stages.items():
            opts = ", ".join(f"{k}={v}" for k, v in cfg.items()) or "-"
            where = f"  [plugin: {plugins[kind][name]}]" if name in plugins.get(kind, {}) else ""
            print(f"  {kind:8s} {name:14s} {opts}{where}")
    print("presets (`polestar presets` for their settings):")
    for name, p in info["presets"].items():
        print(f"  {name:22s} {p['description']}")
    return 0


def cmd_trace(args) -> int:
    from polestar.tracing.cli import run_trace_cli

    return run_trace_cli(args, parse_sets(args.set), decoding_from_args(args))


def cmd_inspect(args) -> int:
    from polestar.inspection import inspect_checkpoint

    check_model(args.model, "inspect MODEL_DIR")
    check_positive("--batch-size", args.batch_size)
    if args.length is not None:
        check_positive("--length", args.length)
    report = inspect_checkpoint(args.model, batch_size=args.batch_size, length=args.length)
    print(json.dumps(report.as_dict(), indent=1) if args.json else "\n".join(report.lines()))
    if report.refused:  # the facts are printed; the exit code says the checkpoint does not load
        more = f" (and {len(report.refused) - 1} more, listed above)" if len(report.refused) > 1 else ""
        raise RuntimeFailure(f"{args.model} does not load: {report.refused[0]}{more}")
    return 0


#: Entry-point group of the subcommands other packages add to ``polestar``: each entry is a function that takes
#: argparse's subparsers and adds its subparser with a ``func`` default (the benchmark adds ``bench``, ``anatomy``
#: and ``agree`` this way, :mod:`polestar.bench.commands`).
COMMANDS_GROUP = "polestar.commands"


def add_commands(sub) -> int:
    """Add the subcommands registered under :data:`COMMANDS_GROUP`, so the command line imports no package that
    contributes one; returns how many there were (0: the metadata of the install predates the group)."""
    from importlib.metadata import entry_points

    entries = list(entry_points(group=COMMANDS_GROUP))
    for entry in entries:
        entry.load()(sub)
    return len(entries)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="polestar", description="Fast decoding for diffusion language models")
    parser.add_argument("--version", action="version", version=f"polestar {_package_version()}")
    parser.add_argument("--debug", action="store_true", default=False, help="on an error, print the traceback too")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="decode prompts with a policy")
    g.add_argument("--model", default="tiny-llada",
                   help="checkpoint directory or shipped name (tiny-llada, tiny-dream)")
    g.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    g.add_argument("--task", default=None, help="format each prompt with this task's prompt layout (e.g. arith)")
    g.add_argument("--chat", action="store_true",
                   help="wrap each prompt as a user turn in the checkpoint's chat template (instruct models)")
    g.add_argument("--system", default=None, help="system turn before the prompt (with --chat)")
    g.add_argument("--batch-size", type=int, default=32, help="prompts decoded together (default 32)")
    g.add_argument("--quiet", action="store_true", help="no progress lines on stderr (shown when >1 batch)")
    add_decoding_args(g)
    g.add_argument("--preset", default="auto",
                   help="decoding settings of a published model (see `polestar presets`); 'auto' picks one from the "
                        "checkpoint's config.json when it is a published model, 'none' never; flags override it")
    g.add_argument("--json", action="store_true", help="print one JSON object per batch with tokens, texts and stats")
    g.set_defaults(func=cmd_generate, policy=None, gen_length=None, block_length=None, temperature=None)
    ins = sub.add_parser("inspect", help="what a checkpoint directory is and needs (reads headers only, no weights)")
    ins.add_argument("model", metavar="MODEL_DIR", help="checkpoint directory or shipped name")
    ins.add_argument("--batch-size", type=int, default=1, help="sequences for the K/V figure (default 1)")
    ins.add_argument("--length", type=int, default=None,
                     help="tokens per sequence for the K/V figure (default: the preset's generation length, else 256)")
    ins.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    ins.set_defaults(func=cmd_inspect)
    pr = sub.add_parser("presets", help="list the presets of the published models (paper settings)")
    pr.add_argument("--json", action="store_true")
    pr.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    pr.set_defaults(func=cmd_presets)
    p = sub.add_parser("policies", help="list policies and stages with their options")
    p.add_argument("--json", action="store_true")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    add_plugin_arg(p)
    p.set_defaults(func=cmd_policies)
    if add_commands(sub) == 0:  # bench, anatomy, agree: see add_commands
        parser.hint = (f" (no command of the {COMMANDS_GROUP!r} entry points is installed, so bench, anatomy and "
                       "agree are missing: reinstall the package, e.g. `pip install -e .`)")
    tr = sub.add_parser("trace", help="draw what one or two policies did, step by step, for one prompt (HTML + PNG)")
    add_trace_args(tr)
    add_decoding_args(tr, policy=False)
    tr.set_defaults(func=cmd_trace)
    # `polestar lm-eval ...` is dispatched in main() before this parser: every argument goes to lm-eval untouched
    sub.add_parser("lm-eval", add_help=False,
                   help="lm-evaluation-harness with the polestar model registered (takes lm-eval's arguments, "
                        "plus --preset table1)")
    return parser


def interrupted_line(args) -> str:
    """What Ctrl-C left behind and how to continue: a command that keeps its work says so through its parser's
    ``on_interrupt`` default (``bench --json`` keeps its finished items for ``--resume``); any other command has
    nothing to continue."""
    on_interrupt = getattr(args, "on_interrupt", None)
    return "interrupted" if on_interrupt is None else on_interrupt(args)


#: Exceptions raised by validation (argument, option and configuration checks) before any work: usage errors.
_USAGE_ERRORS = (UsageError, ValueError, KeyError, TypeError, FileNotFoundError, NotADirectoryError)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 runtime failure, 2 usage error, 130 interrupted)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lm-eval"]:  # every argument goes to lm-eval (polestar.evaluation.cli), not to this parser
        from polestar.evaluation.cli import run_lm_eval

        rest = [a for a in argv[1:] if a != "--debug"]
        args = argparse.Namespace(command="lm-eval", debug=len(rest) < len(argv) - 1)
        return _run(args, lambda: run_lm_eval(rest))
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:  # --help, --version, or an argparse usage error (already printed in one line)
        return done.code if isinstance(done.code, int) else 2

    def work() -> int:
        load_plugins(getattr(args, "plugin", ()))  # before any check: a plugin's stages are valid names
        return args.func(args)

    return _run(args, work)


def _run(args, work) -> int:
    """``work()``'s exit code; a failure is one ``error:`` line (the traceback too with ``--debug``). Under a
    launcher (``torchrun``: ``WORLD_SIZE`` > 1) a failing rank names itself, and a usage error, the same on every
    rank, is reported by rank 0 alone."""
    try:
        return work()
    except RuntimeFailure as err:
        code, line, error = 1, one_line(err), err
    except _USAGE_ERRORS as err:
        code, line, error = 2, one_line(err), err
    except KeyboardInterrupt as err:
        code, line, error = 130, interrupted_line(args), err
    except Exception as err:  # an unexpected failure: still one line; --debug shows where
        code, line, error = 1, f"{type(err).__name__}: {one_line(err)} (rerun with --debug for the traceback)", err
    rank, world_size = launcher_rank()
    if world_size > 1:
        if code == 2 and rank != 0:
            return code
        line = f"[rank {rank}] {line}"
    if args.debug:
        traceback.print_exception(type(error), error, error.__traceback__)
    print(f"error: {line}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
