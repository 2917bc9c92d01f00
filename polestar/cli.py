"""Command line: ``polestar generate``, ``polestar policies``, ``polestar bench``, ``polestar agree``,
``polestar anatomy``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import attrs


def _parse_value(text: str) -> Any:
    """``--set`` values: JSON scalars when they parse (0.9, 4, true, null), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_sets(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"error: --set expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        out[key.strip()] = _parse_value(value.strip())
    return out


def _add_decoding_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="fast-dllm", help="policy name (see `polestar policies`)")
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
    p.add_argument("--compile", action="store_true", help="compile each step with torch.compile")


def decoding_from_args(args) -> dict[str, Any]:
    """The keyword arguments of :func:`polestar.generate` set by :func:`_add_decoding_args` (less dtype/device)."""
    return dict(gen_length=args.gen_length, block_length=args.block_length, steps=args.steps,
                temperature=args.temperature, seed=args.seed, stop_at_eos=args.stop_at_eos, compile=args.compile)


def _add_problem_args(p: argparse.ArgumentParser, policies: str, n: int, batch_size: int) -> None:
    """Model, task, policies and problems of `bench` and `anatomy`."""
    p.add_argument("--model", default="tiny-llada")
    p.add_argument("--task", default="arith")
    p.add_argument("--policies", default=policies)
    p.add_argument("--n", type=int, default=n)
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--data", default=None, help="JSONL with {input, output} records instead of generated problems")
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT.json")


#: settings of `generate` a preset gives when the flag is absent, and their values without a preset (temperature
#: None: generation_config.json's, else 0; steps stay None = one step per token, the paper's steps = gen length)
_PRESET_FLAGS = {"policy": "fast-dllm", "gen_length": 64, "block_length": 16, "temperature": None}


def _preset_for(args, model):
    """`--preset NAME`, or with `--preset auto` the preset recognised from the checkpoint's config.json."""
    from polestar import presets
    from polestar.models.loading import read_config

    if args.preset == "none":
        return None
    if args.preset != "auto":
        return presets.get_preset(args.preset)
    directory = Path(model.name_or_path)
    return presets.preset_for_config(read_config(directory), directory)


def cmd_generate(args) -> int:
    import polestar
    from polestar import presets

    if args.preset not in ("auto", "none"):
        presets.get_preset(args.preset)  # an unknown name fails before the (slow) load
    model = polestar.load(args.model, dtype=args.dtype, device=args.device)
    preset = _preset_for(args, model)
    given = {"policy": preset.policy, **preset.decoding} if preset is not None else {}
    for key, fallback in _PRESET_FLAGS.items():  # explicit flags win over the preset
        if getattr(args, key) is None:
            setattr(args, key, given.get(key, fallback))
    user = parse_sets(args.set)
    mine = {k.rstrip("?") for k in user}
    options = {k: v for k, v in (preset.options.items() if preset is not None else ()) if k.rstrip("?") not in mine}
    options.update(user)
    if preset is not None:
        print(f"[preset {preset.name}] {preset.description}", file=sys.stderr)
    prompts = args.prompt
    if args.task:
        from polestar.bench.tasks import get_task

        prompts = [get_task(args.task).format_prompt(p) for p in args.prompt]
    out = polestar.generate(model, prompts, policy=args.policy, chat=args.chat, system=args.system,
                            **decoding_from_args(args), **options)
    if args.json:
        print(json.dumps({
            "policy": args.policy,
            "stages": out.pipeline.describe(),
            "tokens": out.tokens.tolist(),
            "prompt_ids": out.prompt_ids,
            "prompt_len": out.prompt_len,
            "texts": out.texts,
            "stats": out.stats.as_dict(),
        }))
        return 0
    texts = out.texts or [str(row) for row in out.generations.tolist()]
    for prompt, text in zip(args.prompt, texts):
        print(f"{prompt!r} -> {text!r}")
    s = out.stats
    print(f"[{args.policy}] nfe={s.nfe} tpf={s.tpf:.2f} tps={s.tps:.1f} wall={s.wall_s:.2f}s "
          f"token_layer_evals={s.token_layer_evals}", file=sys.stderr)
    return 0


def cmd_presets(args) -> int:
    from polestar import presets

    info = {name: presets.get_preset(name).as_dict() for name in presets.preset_names()}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for name, p in info.items():
        decoding = ", ".join(f"{k}={v}" for k, v in p["decoding"].items())
        options = ", ".join(f"{k.rstrip('?')}={v}" for k, v in p["options"].items())
        print(f"{name:22s} policy={p['policy']} {decoding}\n{'':22s} {options}\n{'':22s} {p['description']}")
    return 0


def cmd_policies(args) -> int:
    from polestar import policy, presets, registry

    info = {
        "policies": {
            name: {"stages": policy.get_policy(name).stages, "description": policy.get_policy(name).description}
            for name in policy.policy_names()
        },
        "stages": {
            kind: {
                name: {k: (v if not isinstance(v, attrs.Factory) else None) for k, v in registry.config_fields(kind, name).items()}
                for name in registry.names(kind)
            }
            for kind in registry.KINDS
        },
        "presets": {name: presets.get_preset(name).as_dict() for name in presets.preset_names()},
    }
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    print("policies:")
    for name, p in info["policies"].items():
        stages = ", ".join(f"{k}={v}" for k, v in p["stages"].items())
        print(f"  {name:18s} {stages}\n  {'':18s} {p['description']}")
    print("stages:")
    for kind, stages in info["stages"].items():
        for name, cfg in stages.items():
            opts = ", ".join(f"{k}={v}" for k, v in cfg.items()) or "-"
            print(f"  {kind:8s} {name:14s} {opts}")
    print("presets (`polestar presets` for their settings):")
    for name, p in info["presets"].items():
        print(f"  {name:22s} {p['description']}")
    return 0


def cmd_bench(args) -> int:
    from polestar.bench.harness import run_bench_cli

    return run_bench_cli(args, parse_sets(args.set), decoding_from_args(args))


def cmd_agree(args) -> int:
    from polestar.bench.agreement import agree_cli

    return agree_cli(args.a, args.b, args.policy_a, args.policy_b)


def cmd_anatomy(args) -> int:
    from polestar.bench.anatomy import commit_anatomy, format_anatomy

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    result = commit_anatomy(args.model, args.task, policies, args.n, parse_sets(args.set), decoding_from_args(args),
                            args.batch_size, args.data, args.dtype, args.device)
    title = f"{args.model} / {args.task} / n={args.n} / commit anatomy" + ("" if args.stop_at_eos else " / no stop at EOS")
    print(format_anatomy(result, title))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polestar", description="Fast decoding for diffusion language models")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="decode prompts with a policy")
    g.add_argument("--model", default="tiny-llada", help="checkpoint directory or shipped name (tiny-llada, tiny-dream)")
    g.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    g.add_argument("--task", default=None, help="format each prompt with this task's prompt layout (e.g. arith)")
    g.add_argument("--chat", action="store_true",
                   help="wrap each prompt as a user turn in the checkpoint's chat template (instruct models)")
    g.add_argument("--system", default=None, help="system turn before the prompt (with --chat)")
    _add_decoding_args(g)
    g.add_argument("--preset", default="auto",
                   help="decoding settings of a published model (see `polestar presets`); 'auto' picks one from the "
                        "checkpoint's config.json when it is a published model, 'none' never; flags override it")
    g.add_argument("--json", action="store_true", help="print one JSON object with tokens, texts and stats")
    g.set_defaults(func=cmd_generate, policy=None, gen_length=None, block_length=None, temperature=None)
    pr = sub.add_parser("presets", help="list the presets of the published models (paper settings)")
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(func=cmd_presets)
    p = sub.add_parser("policies", help="list policies and stages with their options")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_policies)
    b = sub.add_parser("bench", help="accuracy / throughput of policies on a task")
    _add_problem_args(b, "baseline,parallel,fast-dllm", n=200, batch_size=1)
    b.add_argument("--plot", default=None, metavar="OUT.png")
    b.add_argument("--profile", action="store_true", help="report the share of step time per stage")
    _add_decoding_args(b)
    b.set_defaults(func=cmd_bench)
    an = sub.add_parser("anatomy", help="where a policy's commits come from, by confidence (diagnostic)")
    _add_problem_args(an, "fast-dllm,polestar", n=100, batch_size=50)
    _add_decoding_args(an)
    an.set_defaults(func=cmd_anatomy)
    a = sub.add_parser("agree", help="token mismatch between two `polestar bench --json` runs of the same problems")
    a.add_argument("a", metavar="A.json")
    a.add_argument("b", metavar="B.json")
    a.add_argument("--policy-a", help="compare only this policy of A ... (needs --policy-b)")
    a.add_argument("--policy-b", help="... with this policy of B")
    a.set_defaults(func=cmd_agree)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
