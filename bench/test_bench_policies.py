"""pytest-benchmark suite: ``pytest bench --benchmark-only``. Same problems for every policy, grouped by task;
accuracy, TPF, token-layer evaluations per token and the step-cost counters (weight and K/V bytes, proxy rows; see
docs/performance.md, "Counters") go to ``extra_info`` so methods compare as ratios of one run."""

import pytest

from polestar.bench.harness import load_problems, run_policy
from polestar.tasks import get_task

POLICIES = ["baseline", "parallel", "fast-dllm", "elastic-cache", "polestar-cache", "polestar-commit", "polestar"]
TASKS = ["arith", "sudoku"]
DECODING = dict(gen_length=64, block_length=16, steps=None, temperature=0.0, seed=0)
N = 16
#: summary keys each benchmark records in ``extra_info``
EXTRA_INFO = ("accuracy", "tpf", "nfe", "token_layer_evals_per_token", "weight_bytes_per_token",
              "weight_bytes_per_step", "kv_bytes_per_token", "proxy_query_evals_per_token")


@pytest.mark.parametrize("task_name", TASKS)
@pytest.mark.parametrize("policy", POLICIES)
def test_policy(benchmark, tiny_llada, task_name, policy):
    task = get_task(task_name)
    problems = load_problems(task_name, N)
    benchmark.group = f"tiny-llada/{task_name}"
    result = {}

    def run():
        result["items"], result["summary"] = run_policy(tiny_llada, task, problems, policy, {"threshold?": 0.9},
                                                        DECODING, batch_size=N)

    benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)
    summary = result["summary"]
    benchmark.extra_info.update({k: summary[k] for k in EXTRA_INFO})
    assert summary["n"] == N
