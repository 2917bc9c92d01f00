"""The lm-eval model ``polestar`` through lm-eval's own command line, on local task files over the project's
tasks (nothing downloaded), against ``polestar bench`` on the same problems."""

import glob
import json
import os

import pytest
from lm_eval.api.instance import Instance

import polestar
from polestar.bench.harness import run_bench
from polestar.evaluation import lm_eval_model
from polestar.evaluation.cli import run_lm_eval
from polestar.evaluation.lm_eval_model import PolestarLM
from polestar.evaluation.tasks import write_task_dir
from polestar.tasks import get_task

DECODING = dict(gen_length=64, block_length=16, steps=None, temperature=0.0, seed=0, stop_at_eos=True, compile=False)
N = 8


@pytest.fixture(scope="module")
def offline_env(tmp_path_factory):
    saved = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_DATASETS_CACHE")}
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_DATASETS_CACHE"] = str(tmp_path_factory.mktemp("hf_datasets"))
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def harness_run(tmp_path_factory, offline_env):
    """One `polestar lm-eval` run of the generation and the multiple-choice arith tasks."""
    root = tmp_path_factory.mktemp("lm_eval")
    write_task_dir(root / "tasks", "arith", n=N)
    out = root / "out"
    code = run_lm_eval([
        "--include_path", str(root / "tasks"), "--tasks", "polestar_arith,polestar_arith_choice",
        "--model_args", "pretrained=tiny-llada,policy=polestar,gen_length=64,block_length=16,mc_num=16",
        "--batch_size", "8", "--device", "cpu", "--output_path", str(out), "--log_samples",
    ])
    assert code == 0
    results = json.loads(open(glob.glob(f"{out}/*/results_*.json")[0]).read())
    samples = {}
    for path in glob.glob(f"{out}/*/samples_*.jsonl"):
        task = os.path.basename(path).split("_2")[0][len("samples_"):]
        samples[task] = sorted((json.loads(line) for line in open(path)), key=lambda r: r["doc_id"])
    counters = json.loads(open(glob.glob(f"{out}/polestar_counters_*.json")[0]).read())
    return {"results": results, "samples": samples, "counters": counters, "model": lm_eval_model.LAST_MODEL}


@pytest.fixture(scope="module")
def bench_run():
    return run_bench("tiny-llada", "arith", ["polestar"], N, {}, DECODING, batch_size=8, show_progress=False)


@pytest.mark.slow
def test_generation_task_equals_bench(harness_run, bench_run):
    samples = harness_run["samples"]["polestar_arith"]
    assert len(samples) == N
    for sample, item in zip(samples, bench_run["items"]):
        assert sample["doc"]["input"] == item["input"]
        assert sample["resps"][0][0] == item["generation"]
        assert bool(sample["acc"]) == item["correct"]
    acc = harness_run["results"]["results"]["polestar_arith"]["acc,none"]
    assert acc == pytest.approx(bench_run["summary"]["polestar"]["accuracy"])


@pytest.mark.slow
def test_counters_written_beside_results(harness_run, bench_run):
    c = harness_run["counters"]
    assert c["policy"] == "polestar" and c["world_size"] == 1
    assert c["counters"]["sequences"] == N
    s = bench_run["summary"]["polestar"]
    assert c["counters"]["tpf"] == pytest.approx(s["tpf"])
    # lm-eval hands the requests over in its own order, so batches (and their padding and frozen rows) differ from
    # the bench's: the sequences' own counts agree, the computed totals are at least those
    own = c["counters"]["sequence_token_layer_evals_per_token"]
    assert own == pytest.approx(s["sequence_token_layer_evals_per_token"])
    assert c["counters"]["token_layer_evals_per_token"] >= own
    assert c["counters"]["loglikelihood_forwards"] == N * 4  # 4 choices, mc_num 16 = one batch of 16
    assert set(c["counters"]) >= {"proxy_query_evals", "weight_bytes", "weight_bytes_per_token",
                                  "weight_bytes_per_step", "kv_bytes", "kv_bytes_per_token"}


@pytest.mark.slow
def test_multiple_choice_task_uses_the_mc_loglikelihood(harness_run):
    lm = harness_run["model"]
    samples = harness_run["samples"]["polestar_arith_choice"]
    assert len(samples) == N
    hits = []
    for s in samples:
        doc = s["doc"]
        reqs = [Instance("loglikelihood", doc, (doc["prompt"], c), i) for i, c in enumerate(doc["choices"])]
        scores = [ll for ll, _ in lm.loglikelihood(reqs)]
        assert [float(r[0][0]) for r in s["resps"]] == pytest.approx(scores)  # same estimate, whatever the order
        hits.append(float(max(range(len(scores)), key=scores.__getitem__) == doc["gold"]))
    acc = harness_run["results"]["results"]["polestar_arith_choice"]["acc,none"]
    assert acc == pytest.approx(sum(hits) / len(hits))
    assert acc > 1 / 4  # the trained checkpoint beats chance on its own task


@pytest.fixture(scope="module")
def lm():
    return PolestarLM(pretrained="tiny-llada", policy="parallel", gen_length=64, block_length=16, device="cpu")


def _gen(prompt, **kwargs):
    return Instance("generate_until", {}, (prompt, kwargs), 0, ("polestar_arith", 0, 1))


def test_until_and_max_gen_toks(lm):
    prompt = get_task("arith").format_prompt("3+4*2-5")
    full, cut, short = lm.generate_until([_gen(prompt, until=[]), _gen(prompt, until=[","]),
                                          _gen(prompt, until=[], max_gen_toks=3)])
    assert "," in full
    assert cut == full.split(",")[0]
    assert short == full[:3]


def test_stage_overrides_reach_the_pipeline():
    prompt = get_task("arith").format_prompt("7*3-2+8")
    lm = PolestarLM.create_from_arg_string(
        "pretrained=tiny-llada,policy=fast-dllm,gen_length=64,block_length=16,set.commit=factor,set.factor=2.0",
        {"device": "cpu"})
    got = lm.generate_until([_gen(prompt, until=[])])[0]
    model = polestar.load("tiny-llada")
    ref = polestar.generate(model, [prompt], policy="fast-dllm", gen_length=64, block_length=16, commit="factor",
                            factor=2.0)
    assert got == ref.texts[0]
    with pytest.raises(ValueError, match="factor"):
        PolestarLM.create_from_arg_string("pretrained=tiny-llada,policy=fast-dllm,set.factor=2.0")


@pytest.mark.parametrize("policy", polestar.policy_names())
def test_every_policy_generates_through_lm_eval_as_generate_does(policy):
    """Each registered policy answers an lm-eval request with the tokens `polestar.generate` gives the same prompt."""
    prompt = get_task("arith").format_prompt("7*3-2+8")
    lm = PolestarLM(pretrained="tiny-llada", policy=policy, gen_length=32, block_length=16, device="cpu")
    got = lm.generate_until([_gen(prompt, until=[])])[0]
    ref = polestar.generate(lm.model, [prompt], policy=policy, gen_length=32, block_length=16)
    assert got == ref.texts[0]


def test_bad_arguments_fail_before_loading():
    with pytest.raises(ValueError, match="pretrained is required"):
        PolestarLM(policy="parallel")
    with pytest.raises(ValueError, match=r"unknown model arguments \['topk'\].*set\."):
        PolestarLM(pretrained="tiny-llada", topk=2)
    with pytest.raises(ValueError, match="batch_size auto"):
        PolestarLM(pretrained="tiny-llada", batch_size="auto")
    with pytest.raises(ValueError, match="multiple of block_length"):
        PolestarLM(pretrained="tiny-llada", gen_length=60, block_length=16)


def test_rolling_loglikelihood_is_refused(lm):
    with pytest.raises(NotImplementedError, match="masked diffusion LM"):
        lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("some text",), 0)])


def test_single_process_rank(lm):
    assert (lm.rank, lm.world_size) == (0, 1)
    assert lm.gather_object({"a": 1}) == [{"a": 1}]


@pytest.mark.parametrize("task", ["arith", "sudoku", "countdown"])
def test_task_files_score_with_the_task_checker(task, tmp_path):
    from polestar.bench.harness import load_problems
    from polestar.evaluation.tasks import process_results

    paths = write_task_dir(tmp_path, task, n=6, choices=3)
    assert sorted(paths) == [f"polestar_{task}", f"polestar_{task}_choice"]
    assert all(p.is_file() for p in paths.values())
    records = [json.loads(line) for line in (tmp_path / f"polestar_{task}.jsonl").read_text().splitlines()]
    assert [r["input"] for r in records] == [p.input for p in load_problems(task, 6)]  # bench's problems
    for r in records:
        assert r["prompt"] == get_task(task).format_prompt(r["input"])
        assert process_results(r, [r["output"]]) == {"acc": 1.0}
        assert process_results(r, ["<|endoftext|>"]) == {"acc": 0.0}
        assert len(r["choices"]) == 3 and r["choices"][r["gold"]] == r["output"]
    with pytest.raises(ValueError, match="choices must be between 2 and n"):
        write_task_dir(tmp_path, task, n=2, choices=4)


@pytest.mark.slow
def test_import_polestar_does_not_import_lm_eval():
    import subprocess
    import sys

    code = "import sys, polestar, polestar.cli, polestar.bench.harness, polestar.evaluation.tasks; " \
           "print('lm_eval' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_model_args_are_converted_and_checked():
    from polestar.evaluation.lm_eval_model import ModelArgs

    args, stage = ModelArgs.parse({"pretrained": "d", "gen_length": "64", "compile": "false", "cfg": "0.5",
                                   "set.refresh.topk": 2})
    assert (args.gen_length, args.compile, args.cfg, stage) == (64, False, 0.5, {"refresh.topk": 2})
    with pytest.raises(ValueError, match="model argument steps: expected an integer, got 'many'"):
        ModelArgs.parse({"pretrained": "d", "steps": "many"})
    with pytest.raises(ValueError, match="mc_num .* multiple of mc_batch_size"):
        ModelArgs.parse({"pretrained": "d", "mc_num": 48, "mc_batch_size": 32})
    with pytest.raises(ValueError, match="unknown evaluation preset"):
        ModelArgs.parse({"pretrained": "d", "preset": "table9"})
