"""Torch operations per decoding step: what an uncompiled step launches, counted on a CPU.

On a GPU at small batch an uncompiled step is launch-bound (each operation costs a kernel launch, tens of
microseconds on the largest GPUs), so the number of operations a step issues is the figure that predicts its eager
time and the size of the graph a compiler has to trace. :class:`OpCounter` counts every ATen operation dispatched
while it is on, views excluded (they launch nothing); :func:`step_ops` decodes with a policy on a random model of
the given depth (the tiny test width) and returns the operations of the whole decode (steps, the loop's
bookkeeping between them) per step. ``python -m polestar.bench.step_ops --layers 32`` prints a table of every
registered policy in two settings side by side: the short one (:data:`SHORT`: two prompts, 32 tokens in blocks of 8,
the threshold rule) and the paper's shape (:data:`PAPER`: one prompt of 64 ids, 128 tokens in blocks of 32, two
tokens per step), where the per-block work of a cache policy shows as it does at the published settings;
``--gen-length`` / ``--block-length`` / ``--setting`` choose.
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


class Setting(NamedTuple):
    """A decode to count or compile: ``prompts`` (token ids), ``gen_length``, ``block_length`` and further
    :func:`polestar.generate` options (``options``: a tuple of ``(name, value)`` pairs)."""

    name: str
    prompts: list
    gen_length: int
    block_length: int
    options: tuple = ()

    def generate_kwargs(self, **overrides: Any) -> dict:
        return dict(gen_length=self.gen_length, block_length=self.block_length, **dict(self.options), **overrides)


def _paper_prompt(length: int = 64) -> list[int]:
    """``length`` ids drawn with a fixed seed below the tiny model's special ids."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(5, 36, (length,), generator=g).tolist()


#: the short setting: two prompts of two lengths, 32 tokens in blocks of 8, each policy's own commit rule
SHORT = Setting("short", PROMPTS, 32, 8)
#: the paper's shape: one prompt of 64 ids, 128 tokens in blocks of 32, 64 steps (two tokens per step, ``topk``),
#: every block decoded
PAPER = Setting("paper", [_paper_prompt()], 128, 32, (("steps", 64), ("commit", "topk"), ("stop_at_eos", False)))
SETTINGS = {s.name: s for s in (SHORT, PAPER)}


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


def step_ops(policy: str, layers: int, family: str = "llada", setting: Setting = SHORT, **overrides: Any) -> StepOps:
    """Operations per step of an eager decode of ``setting`` (default :data:`SHORT`) with ``policy`` on a random
    ``family`` model of the tiny test width and ``layers`` layers (``overrides``: stage options, as for
    :func:`polestar.generate`); counted on a second decode (the first fills the generation pool and imports what
    decoding imports lazily)."""
    model = tiny_model(family, seed=3, n_layers=layers)
    options = setting.generate_kwargs(policy=policy, **overrides)
    polestar.generate(model, setting.prompts, **options)
    with OpCounter() as counter:
        out = polestar.generate(model, setting.prompts, **options)
    steps = out.stats.nfe
    return StepOps(policy, layers, steps, counter.count / steps, counter.count / steps / layers)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--family", default="llada", choices=("llada", "dream"))
    parser.add_argument("--policies", default=",".join(policy_names()))
    parser.add_argument("--setting", default="short,paper",
                        help=f"settings side by side, comma-separated, of {', '.join(SETTINGS)} (default both)")
    parser.add_argument("--gen-length", type=int, default=None, help="replaces the first setting's gen_length")
    parser.add_argument("--block-length", type=int, default=None, help="replaces the first setting's block_length")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.setting.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown or not names:
        parser.error(f"--setting takes {', '.join(SETTINGS)}, got {args.setting!r}")
    settings = [SETTINGS[n] for n in names]
    if args.gen_length or args.block_length:
        first = settings[0]
        settings[0] = first._replace(name="custom", gen_length=args.gen_length or first.gen_length,
                                     block_length=args.block_length or first.block_length)
    torch.set_num_threads(1)
    policies = args.policies.split(",")
    table = {s.name: {p: step_ops(p, args.layers, args.family, s) for p in policies} for s in settings}
    header = "".join(f"{s.name + ' ops/step':>20}{'ops/layer':>11}{'x fast-dllm':>13}" for s in settings)
    print("  ".join(f"{s.name}: gen {s.gen_length}, block {s.block_length}, {len(s.prompts)} prompt(s)"
                    + "".join(f", {k}={v}" for k, v in s.options) for s in settings))
    print(f"{'policy':<18}{header}")
    for p in policies:
        cells = []
        for s in settings:
            r, base = table[s.name][p], table[s.name].get("fast-dllm")
            ratio = f"{r.per_step / base.per_step:.2f}" if base else "-"
            cells.append(f"{r.per_step:>20.1f}{r.per_layer:>11.2f}{ratio:>13}")
        print(f"{p:<18}{''.join(cells)}")


if __name__ == "__main__":
    main()
