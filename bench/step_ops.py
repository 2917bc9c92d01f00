"""Torch operations per decoding step: what an uncompiled step launches, counted on a CPU.

On a GPU at small batch an uncompiled step is launch-bound (each operation costs a kernel launch, tens of
microseconds on the largest GPUs), so the number of operations a step issues is the figure that predicts its eager
time and the size of the graph a compiler has to trace. :class:`OpCounter` counts every ATen operation dispatched
while it is on, views excluded (they launch nothing); :func:`step_ops` decodes with a policy on a random model of
the given depth (the tiny test width) and returns the operations of the whole decode (steps, the loop's
bookkeeping between them) per step. ``python -m polestar.bench.step_ops --layers 32`` prints a table of every
registered policy.
"""

from __future__ import annotations

import argparse
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import polestar
from polestar.policy import policy_names
from polestar.testing import tiny_model

#: prompts of two lengths (left padding on), below the tiny model's special ids
PROMPTS = [[5, 17, 3, 8, 9, 1, 2], [9, 1, 22, 30, 4, 11, 2, 7]]


class OpCounter(TorchDispatchMode):
    """Counts the ATen operations dispatched while on (``count``), views and ``detach`` excluded."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func is not torch.ops.aten.detach.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


class StepOps(NamedTuple):
    """``policy``; ``layers``; ``steps`` (steps decoded); ``per_step`` operations per step (decode total / steps);
    ``per_layer``: ``per_step / layers``."""

    policy: str
    layers: int
    steps: int
    per_step: float
    per_layer: float


def step_ops(policy: str, layers: int, family: str = "llada", gen_length: int = 32, block_length: int = 8,
             **overrides: Any) -> StepOps:
    """Operations per step of an eager decode of :data:`PROMPTS` with ``policy`` on a random ``family`` model of the
    tiny test width and ``layers`` layers (``overrides``: stage options, as for :func:`polestar.generate`); counted
    on a second decode (the first fills the generation pool and imports what decoding imports lazily)."""
    model = tiny_model(family, seed=3, n_layers=layers)
    options = dict(policy=policy, gen_length=gen_length, block_length=block_length, **overrides)
    polestar.generate(model, PROMPTS, **options)
    with OpCounter() as counter:
        out = polestar.generate(model, PROMPTS, **options)
    steps = out.stats.nfe
    return StepOps(policy, layers, steps, counter.count / steps, counter.count / steps / layers)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--family", default="llada", choices=("llada", "dream"))
    parser.add_argument("--policies", default=",".join(policy_names()))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [step_ops(p, args.layers, args.family) for p in args.policies.split(",")]
    base = next((r.per_step for r in rows if r.policy == "fast-dllm"), None)
    print(f"{'policy':<18}{'ops/step':>10}{'ops/layer':>11}{'x fast-dllm':>13}")
    for r in rows:
        ratio = f"{r.per_step / base:.2f}" if base else "-"
        print(f"{r.policy:<18}{r.per_step:>10.1f}{r.per_layer:>11.2f}{ratio:>13}")


if __name__ == "__main__":
    main()
