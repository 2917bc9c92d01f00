"""Compile cost against depth: CPU seconds of one compiled decode with a cold compiler cache, and warm step times.

Each measurement runs in a child process of its own, with an empty Inductor cache directory, one compile thread and
one intra-op thread, so it starts cold and counts what compiling costs: the CPU seconds of the process and of its
children (the C++ compiler runs as a child), and dynamo's own compile timer (``stats.compile_s``). The decode is
one of :mod:`polestar.bench.step_ops` (``--setting short``: two prompts, 32 tokens in blocks of 8; ``paper``: one
prompt of 64 ids, 128 tokens in blocks of 32, two tokens per step) on a random model of the tiny test width and the
given depth; its tokens and counters are checked against an eager decode, and every step must have run compiled.
With ``--warm`` the child then times three more compiled decodes and reports milliseconds per step.

``python -m polestar.bench.compile_cost --policies fast-dllm,polestar --layers 2,8,32 --setting paper`` prints a
table; ``--compile`` takes ``true`` (inductor, what ``compile=True`` means) or a ``torch.compile`` backend name
(``aot_eager``, ``eager``) for the layer regions.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

import torch

import polestar
from polestar.testing import tiny_model

from .step_ops import SETTINGS


class CompileCost(NamedTuple):
    """One cold compiled decode: ``cpu_s`` (process and children), ``compile_cpu_s`` (``cpu_s`` less the CPU seconds
    of the same compiled decode run again warm: what compiling cost, without the decode), ``compile_s`` (dynamo's
    timer), ``warm_ms``
    (milliseconds per step of a warm compiled decode, or None) and whether its tokens and counters equal eager
    decoding's with every step compiled."""

    policy: str
    layers: int
    compile: str
    cpu_s: float
    compile_cpu_s: float
    compile_s: float
    warm_ms: float | None
    equal: bool


def compile_value(text: str) -> bool | str:
    """``--compile``'s value as ``polestar.generate`` takes it (``true`` → True)."""
    return True if text.lower() == "true" else text


def measure(policy: str, layers: int, compile: str, warm: bool = False, setting: str = "short",
            plugin: str | None = None, **overrides) -> CompileCost:
    """One cold compiled decode in this process (see the module docstring; the caller provides the cold cache).
    ``plugin``: a stage file loaded first (its stage chosen by ``overrides``, e.g. ``drift="hellinger"``)."""
    torch.set_num_threads(1)
    if plugin:
        from polestar.plugins import load_plugin

        load_plugin(plugin)
    model = tiny_model("llada", seed=3, n_layers=layers)
    chosen = SETTINGS[setting]
    options = chosen.generate_kwargs(policy=policy, **overrides)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.process_time()
    out = polestar.generate(model, chosen.prompts, compile=compile_value(compile), **options)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = time.process_time() - start + (after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime)
    start = time.process_time()
    polestar.generate(model, chosen.prompts, compile=compile_value(compile), **options)  # warm: the decode alone
    decode_cpu = time.process_time() - start
    eager = polestar.generate(model, chosen.prompts, **options)
    warm_ms = None
    if warm:
        steps, t0 = 0, time.perf_counter()
        for _ in range(3):
            steps += polestar.generate(model, chosen.prompts, compile=compile_value(compile), **options).stats.nfe
        warm_ms = 1e3 * (time.perf_counter() - t0) / steps
    counters = ("nfe", "token_layer_evals", "proxy_query_evals", "weight_bytes", "kv_bytes")
    equal = (torch.equal(out.tokens, eager.tokens) and out.stats.compiled_steps == out.stats.nfe
             and all(getattr(out.stats, c) == getattr(eager.stats, c) for c in counters))
    return CompileCost(policy, layers, compile, cpu, cpu - decode_cpu, out.stats.compile_s, warm_ms, equal)


def measure_cold(policy: str, layers: int, compile: str, warm: bool = False, timeout: float = 1800,
                 setting: str = "short", plugin: str | None = None, sets: tuple[str, ...] = ()) -> CompileCost:
    """:func:`measure` in a child process with an empty Inductor cache, one compile thread and one thread
    (``sets``: ``name=value`` stage options)."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_COMPILE_THREADS="1", OMP_NUM_THREADS="1")
        args = [sys.executable, "-m", "polestar.bench.compile_cost", "--one", "--policies", policy, "--layers",
                str(layers), "--compile", compile, "--setting", setting, *(["--warm"] if warm else []),
                *(["--plugin", plugin] if plugin else []), *(a for kv in sets for a in ("--set", kv))]
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{policy} at {layers} layers failed:\n{proc.stderr[-3000:]}")
    return CompileCost(**json.loads(proc.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default="fast-dllm,polestar")
    parser.add_argument("--layers", default="2,8", help="depths, comma-separated")
    parser.add_argument("--compile", default="true", help="true (inductor) or a torch.compile backend name")
    parser.add_argument("--setting", default="short", choices=sorted(SETTINGS), help="the decode (default short)")
    parser.add_argument("--plugin", default=None, help="a stage file to load first")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME=VALUE",
                        help="a stage option or stage, e.g. drift=hellinger (repeatable)")
    parser.add_argument("--warm", action="store_true", help="also time three warm compiled decodes")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: measure, print JSON
    args = parser.parse_args(argv)
    depths = [int(d) for d in args.layers.split(",")]
    policies = args.policies.split(",")
    sets = dict(kv.split("=", 1) for kv in args.sets)
    if args.one:
        print(json.dumps(measure(policies[0], depths[0], args.compile, args.warm, args.setting, args.plugin,
                                 **sets)._asdict()))
        return
    print(f"{'policy':<16}{'layers':>7}{'compile':>10}{'CPU s':>9}{'compile CPU s':>15}{'compile s':>11}"
          f"{'warm ms':>9}  tokens")
    for policy in policies:
        base = None
        for depth in depths:
            r = measure_cold(policy, depth, args.compile, args.warm, setting=args.setting, plugin=args.plugin,
                             sets=tuple(args.sets))
            base = base or r.compile_cpu_s
            warm = f"{r.warm_ms:9.2f}" if r.warm_ms is not None else f"{'-':>9}"
            print(f"{policy:<16}{depth:>7}{args.compile:>10}{r.cpu_s:>9.1f}{r.compile_cpu_s:>15.1f}{r.compile_s:>11.1f}"
                  f"{warm}  {'= eager' if r.equal else 'DIFFER'} ({r.compile_cpu_s / base:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
