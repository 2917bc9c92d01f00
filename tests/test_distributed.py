"""Data parallelism: two gloo processes under torchrun give, merged, the single-process results item for item
(``polestar bench`` and the lm-eval path)."""

import glob
import json
import os
import subprocess
import sys

import pytest

from polestar.bench.harness import run_bench
from polestar.evaluation import distributed
from polestar.evaluation.tasks import write_task_dir

N, BATCH = 8, 2
DECODING = dict(gen_length=64, block_length=16, steps=None, temperature=0.0, seed=0, stop_at_eos=True, compile=False)


def _torchrun(args, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_DATASETS_OFFLINE="1",
               HF_DATASETS_CACHE=str(tmp_path / "hf_datasets"))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "polestar.cli", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def single():
    return run_bench("tiny-llada", "arith", ["polestar"], N, {}, DECODING, batch_size=BATCH, show_progress=False)


def test_shard_round_robin():
    shards = [distributed.shard(7, r, 3) for r in range(3)]
    assert shards == [[0, 3, 6], [1, 4], [2, 5]]
    assert sorted(i for s in shards for i in s) == list(range(7))
    assert distributed.init_from_env("cpu") == (0, 1)  # no launcher, no process group


@pytest.mark.slow
def test_bench_two_processes_equal_one(tmp_path, single):
    out = tmp_path / "dp.json"
    proc = _torchrun(["bench", "--task", "arith", "--policies", "polestar", "--num-problems", str(N),
                      "--batch-size", str(BATCH), "--gen-length", "64", "--block-length", "16",
                      "--json", str(out)], tmp_path)
    result = json.loads(out.read_text())
    assert result["items"] == single["items"]
    for key in ("accuracy", "tpf", "nfe", "token_layer_evals_per_token", "n", "stages"):
        assert result["summary"]["polestar"][key] == single["summary"]["polestar"][key]
    assert proc.stdout.count("polestar ") == 1  # rank 0 alone prints the table
    assert sorted(p.name for p in tmp_path.glob("dp.items*.jsonl")) == ["dp.items.rank0.jsonl", "dp.items.rank1.jsonl"]


@pytest.mark.slow
def test_lm_eval_two_processes_equal_one(tmp_path, single):
    """Sharded by lm-eval itself (rank r takes docs r, r+2, ...), gathered through the model's gather_object;
    compared with the single-process items (test_lm_eval shows a one-process lm-eval run equals bench)."""
    write_task_dir(tmp_path / "tasks", "arith", n=N)
    out = tmp_path / "out"
    _torchrun(["lm-eval", "--include_path", str(tmp_path / "tasks"), "--tasks", "polestar_arith",
               "--model_args", "pretrained=tiny-llada,policy=polestar,gen_length=64,block_length=16",
               "--batch_size", str(BATCH), "--device", "cpu", "--output_path", str(out), "--log_samples"], tmp_path)
    samples = sorted((json.loads(line) for line in open(glob.glob(f"{out}/*/samples_polestar_arith_*.jsonl")[0])),
                     key=lambda r: r["doc_id"])
    assert [s["resps"][0][0] for s in samples] == [i["generation"] for i in single["items"]]
    assert [bool(s["acc"]) for s in samples] == [i["correct"] for i in single["items"]]
    results = json.loads(open(glob.glob(f"{out}/*/results_*.json")[0]).read())
    assert results["results"]["polestar_arith"]["acc,none"] == pytest.approx(single["summary"]["polestar"]["accuracy"])
    counters = json.loads(open(glob.glob(f"{out}/polestar_counters_*.json")[0]).read())
    assert counters["world_size"] == 2 and counters["counters"]["sequences"] == N  # summed over both ranks
