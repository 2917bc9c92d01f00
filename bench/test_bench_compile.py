"""Eager vs compiled decoding of every registered policy on tiny-llada, batch 1 and 16
(``pytest bench -k compile --benchmark-only``): compare the groups' means as ratios from one run.

The warm-up generation compiles (its time is recorded as ``compile_s`` in the row's extra info, apart from the
timed rounds); each timed round is one generation of the same prompts, 64 tokens in blocks of 16, no stop at EOS.
``eager_steps`` / ``graph_replays`` in the extra info say how each step ran.
"""

import pytest

import polestar
from polestar.policy import policy_names
from polestar.tasks import get_task
from polestar.tasks.base import split

PROBLEMS = split(get_task("arith"), 16, "test", 0)
PROMPTS = [get_task("arith").format_prompt(p.input) for p in PROBLEMS]


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("policy", policy_names())
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_compile_speed(benchmark, tiny_llada, policy, compiled, batch):
    kw = dict(policy=policy, gen_length=64, block_length=16, compile=compiled, stop_at_eos=False)
    prompts = PROMPTS[:batch]
    warm = polestar.generate(tiny_llada, prompts, **kw)  # warm-up (compiles)
    benchmark.group = f"compile/{policy}/batch{batch}"
    out = benchmark.pedantic(lambda: polestar.generate(tiny_llada, prompts, **kw), rounds=5, iterations=1)
    s = out.stats
    benchmark.extra_info.update(tps=s.tps, tpf=s.tpf, nfe=s.nfe, compile_s=warm.stats.compile_s,
                                eager_steps=s.nfe - s.compiled_steps, graph_replays=s.compiled_steps)
