"""pytest-benchmark suite: ``pytest bench --benchmark-only``. Same problems for every registered policy (plugins'
included: ``-p polestar.testing --polestar-plugin mypolicy.py``), grouped by task; accuracy, TPF, token-layer
evaluations per token and the step-cost counters (weight and K/V bytes, proxy rows; see docs/performance.md,
"Counters") go to ``extra_info`` so methods compare as ratios of one run. The model is loaded once per session."""

import pytest

from polestar.bench.harness import load_problems, run_policy
from polestar.policy import policy_names
from polestar.tasks import get_task

TASKS = ["arith", "sudoku"]
DECODING = dict(gen_length=64, block_length=16, steps=None, temperature=0.0, seed=0)
N = 16
#: summary keys each benchmark records in ``extra_info``
EXTRA_INFO = ("accuracy", "tpf", "nfe", "token_layer_evals_per_token", "weight_bytes_per_token",
              "weight_bytes_per_step", "kv_bytes_per_token", "proxy_query_evals_per_token")


def pytest_generate_tests(metafunc):
    """The policies from the registry at collection time (after ``--polestar-plugin`` registered its own)."""
    if "policy" in metafunc.fixturenames:
        metafunc.parametrize("policy", policy_names())


@pytest.mark.parametrize("task_name", TASKS)
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
