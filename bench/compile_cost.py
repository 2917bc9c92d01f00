"""Compile cost against depth: CPU seconds of one compiled decode with a cold compiler cache, and warm step times.

Each measurement runs in a child process of its own, with an empty Inductor cache directory, one compile thread and
one intra-op thread, so it starts cold and counts what compiling costs: the CPU seconds of the process and of its
children (the C++ compiler runs as a child), and dynamo's own compile timer (``stats.compile_s``). The decode is
that of :mod:`polestar.bench.step_ops` (two prompts of the tiny test width, 32 tokens in blocks of 8, a random model
of the given depth); its tokens are checked against an eager decode. With ``--warm`` the child then times three more
compiled decodes and reports milliseconds per step.

``python -m polestar.bench.compile_cost --policies fast-dllm,polestar --layers 2,8 --compile layers`` prints a
table; ``--compile`` takes ``true`` (what ``compile=True`` means on this device and torch), ``layers``, or a
``torch.compile`` backend name (``inductor``, ``aot_eager``, ``eager``).
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

from .step_ops import PROMPTS


class CompileCost(NamedTuple):
    """One cold compiled decode: ``cpu_s`` (process and children), ``compile_s`` (dynamo's timer), ``warm_ms``
    (milliseconds per step of a warm compiled decode, or None) and whether its tokens equal eager decoding's."""

    policy: str
    layers: int
    compile: str
    cpu_s: float
    compile_s: float
    warm_ms: float | None
    equal: bool


def compile_value(text: str) -> bool | str:
    """``--compile``'s value as ``polestar.generate`` takes it (``true`` → True)."""
    return True if text.lower() == "true" else text


def measure(policy: str, layers: int, compile: str, warm: bool = False) -> CompileCost:
    """One cold compiled decode in this process (see the module docstring; the caller provides the cold cache)."""
    torch.set_num_threads(1)
    model = tiny_model("llada", seed=3, n_layers=layers)
    options = dict(policy=policy, gen_length=32, block_length=8)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.process_time()
    out = polestar.generate(model, PROMPTS, compile=compile_value(compile), **options)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = time.process_time() - start + (after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime)
    eager = polestar.generate(model, PROMPTS, **options)
    warm_ms = None
    if warm:
        steps, t0 = 0, time.perf_counter()
        for _ in range(3):
            steps += polestar.generate(model, PROMPTS, compile=compile_value(compile), **options).stats.nfe
        warm_ms = 1e3 * (time.perf_counter() - t0) / steps
    return CompileCost(policy, layers, compile, cpu, out.stats.compile_s, warm_ms,
                       torch.equal(out.tokens, eager.tokens))


def measure_cold(policy: str, layers: int, compile: str, warm: bool = False, timeout: float = 1800) -> CompileCost:
    """:func:`measure` in a child process with an empty Inductor cache, one compile thread and one thread."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_COMPILE_THREADS="1", OMP_NUM_THREADS="1")
        args = [sys.executable, "-m", "polestar.bench.compile_cost", "--one", "--policies", policy, "--layers",
                str(layers), "--compile", compile, *(["--warm"] if warm else [])]
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{policy} at {layers} layers failed:\n{proc.stderr[-3000:]}")
    return CompileCost(**json.loads(proc.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default="fast-dllm,polestar")
    parser.add_argument("--layers", default="2,8", help="depths, comma-separated")
    parser.add_argument("--compile", default="true", help="true, layers, or a torch.compile backend name")
    parser.add_argument("--warm", action="store_true", help="also time three warm compiled decodes")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: measure, print JSON
    args = parser.parse_args(argv)
    depths = [int(d) for d in args.layers.split(",")]
    policies = args.policies.split(",")
    if args.one:
        print(json.dumps(measure(policies[0], depths[0], args.compile, args.warm)._asdict()))
        return
    print(f"{'policy':<16}{'layers':>7}{'compile':>10}{'CPU s':>9}{'compile s':>11}{'warm ms':>9}  tokens")
    for policy in policies:
        base = None
        for depth in depths:
            r = measure_cold(policy, depth, args.compile, args.warm)
            base = base or r.cpu_s
            warm = f"{r.warm_ms:9.2f}" if r.warm_ms is not None else f"{'-':>9}"
            print(f"{policy:<16}{depth:>7}{args.compile:>10}{r.cpu_s:>9.1f}{r.compile_s:>11.1f}{warm}  "
                  f"{'= eager' if r.equal else 'DIFFER'} ({r.cpu_s / base:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
