"""Eager vs compiled decoding on tiny-llada (``pytest bench -k compile --benchmark-only``): compare the two
groups' means as a ratio from one run."""

import pytest

import polestar
from polestar.bench.tasks import get_task
from polestar.bench.tasks.base import split

PROMPTS = [get_task("arith").format_prompt(p.input) for p in split(get_task("arith"), 8, "test", 0)]


@pytest.mark.parametrize("policy", ["baseline", "fast-dllm", "polestar"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_compile_speed(benchmark, tiny_llada, policy, compiled):
    kw = dict(policy=policy, gen_length=64, block_length=16, compile=compiled)
    polestar.generate(tiny_llada, PROMPTS, **kw)  # warm-up (compiles)
    benchmark.group = f"compile/{policy}"
    out = benchmark.pedantic(lambda: polestar.generate(tiny_llada, PROMPTS, **kw), rounds=5, iterations=1)
    benchmark.extra_info.update(tps=out.stats.tps, tpf=out.stats.tpf, nfe=out.stats.nfe)
