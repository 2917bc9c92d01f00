"""The real-width step-cost benchmark (bench/real_width.py, bench/test_bench_real_width.py) on its tiny model
(d_model 64, a 512-token vocabulary, 2 layers, 16 tokens): the same code path as the 8B-wide run in seconds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polestar.bench import real_width as rw
from polestar.models.published import LLADA_8B_INSTRUCT_CONFIG, published_model

ROOT = Path(__file__).resolve().parents[1]
TINY = rw.Settings(layers=(2,), dtypes=("float32",), batches=(1, 2), prompt=8, gen=16, block=8,
                   width=rw.TINY_MODEL, rounds=2)


@pytest.fixture(scope="module")
def results():
    return rw.run_cells(TINY)


def test_every_forced_row_takes_one_step_per_token(results):
    assert [(r["batch"], r["row"]) for r in results] == [(b, k) for b in (1, 2) for k in rw.ROWS]
    for r in results:
        if r["forced_commit"]:
            assert r["nfe"] == TINY.gen
        assert r["ms_per_step_mean"] > 0 and 0 < r["ms_per_step_min"] <= r["ms_per_step_mean"] * 1.5
        assert r["rows_per_step_layer"] > 0
        assert r["weight_bytes_per_step"] >= 0 and r["kv_bytes_per_step"] >= 0 and r["proxy_rows_per_step_layer"] >= 0


def test_ratios_are_to_fast_dllm_of_the_same_cell(results):
    for r in results:
        ref = next(x for x in results if x["row"] == rw.REFERENCE and x["batch"] == r["batch"])
        assert r["ms_per_step_mean_ratio"] == pytest.approx(r["ms_per_step_mean"] / ref["ms_per_step_mean"])
        assert r["rows_per_step_layer_ratio"] == pytest.approx(r["rows_per_step_layer"] / ref["rows_per_step_layer"])
        if ref["proxy_rows_per_step_layer"] == 0:
            assert r["proxy_rows_per_step_layer_ratio"] is None


def test_markdown_table(results):
    lines = rw.markdown_table(results).splitlines()
    assert lines[0].startswith("| layers | dtype | batch | policy | steps | ms/step |")
    body = [line for line in lines[2:] if line.startswith("|")]
    assert len(body) == len(results)
    assert sum("polestar (own commit) †" in line for line in body) == 2
    assert all("(1.00×)" in line for line in body if "| fast-dllm |" in line)


def test_settings_from_environment():
    s = rw.settings_from_env({"POLESTAR_RW_LAYERS": "2", "POLESTAR_RW_DTYPES": "bfloat16", "POLESTAR_RW_BATCHES": "8",
                              "POLESTAR_RW_GEN": "64", "POLESTAR_RW_POLICIES": "fast-dllm,polestar",
                              "POLESTAR_RW_DEVICE": "cpu", "POLESTAR_RW_WIDTH": "tiny"})
    assert (s.layers, s.dtypes, s.batches, s.gen, s.block, s.rows) == ((2,), ("bfloat16",), (8,), 64, 16,
                                                                        ("fast-dllm", "polestar"))
    assert s.width == rw.TINY_MODEL and s.warmup == 0 and s.rounds == 3
    tiny = rw.settings_from_env({"POLESTAR_RW_WIDTH": "tiny", "POLESTAR_RW_DEVICE": "cpu"})
    assert (tiny.prompt, tiny.gen, tiny.block) == (16, 32, 16)  # the tiny layout unless set
    full = rw.settings_from_env({"POLESTAR_RW_DEVICE": "cpu"})
    assert full.width is None and full.layers == (2, 4) and full.batches == (1, 8) and full.prompt == 64
    with pytest.raises(ValueError, match="unknown rows"):
        rw.settings_from_env({"POLESTAR_RW_POLICIES": "nope", "POLESTAR_RW_DEVICE": "cpu"})


def test_combine_rounds():
    runs = [{"ms_per_step_mean": 4.0, "ms_per_step_min": 3.0, "nfe": 8},
            {"ms_per_step_mean": 2.0, "ms_per_step_min": 1.5, "nfe": 8}]
    assert rw.combine(runs) == {"ms_per_step_mean": 3.0, "ms_per_step_min": 1.5, "nfe": 8, "rounds": 2,
                                "ms_per_step_std": pytest.approx(2 ** 0.5), "ms_per_step_rounds": [4.0, 2.0]}


def test_ratio_spread_propagates_both_deviations():
    a = {"ms_per_step_mean": 4.0, "ms_per_step_std": 0.4}
    ref = {"ms_per_step_mean": 2.0, "ms_per_step_std": 0.2}
    assert rw.ratio_std(a, ref) == pytest.approx(2.0 * (0.1 ** 2 + 0.1 ** 2) ** 0.5)


def test_tiny_rows_have_a_spread_and_small_vocabulary(results):
    for r in results:
        assert r["rounds"] == 2 and len(r["ms_per_step_rounds"]) == 2 and r["ms_per_step_std"] >= 0
        if r["row"] != rw.REFERENCE:
            assert r["ms_per_step_mean_ratio_std"] is not None
    # the LM head reads 512 rows of 64, not the published 126k: a step's weight bytes stay under 1 MB
    assert all(r["weight_bytes_per_step"] < 1e6 * r["batch"] for r in results)


def test_published_model_has_the_published_shapes_but_depth():
    model = published_model("llada", 3, rw.TINY_WIDTH, torch.bfloat16)
    cfg = LLADA_8B_INSTRUCT_CONFIG
    assert model.spec.n_layers == 3 and model.dtype == torch.bfloat16
    assert model.spec.embedding_size == cfg["embedding_size"] and model.spec.mask_id == cfg["mask_token_id"]
    norms = [p for name, p in model.named_parameters() if p.dim() == 1]
    assert norms and all(bool((p == 1).all()) for p in norms)
    with torch.inference_mode():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]]))).all()


def test_bench_stays_out_of_the_main_run():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    assert (tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["testpaths"]
            == ["tests"])


@pytest.mark.slow
def test_one_cell_is_selectable():
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
                          "bench/test_bench_real_width.py", "-k", "fp32 and b1 and L2"],
                         capture_output=True, text=True, cwd=ROOT, env={"PATH": "", "OMP_NUM_THREADS": "1"})
    ids = [line.split("[", 1)[1].rstrip("]") for line in run.stdout.splitlines() if "::test_step_cost[" in line]
    assert ids == [f"L2-fp32-b1-{row}" for row in rw.ROWS], run.stdout + run.stderr


def test_the_first_row_is_not_silent(capsys):
    """The command's log (stderr) has a line before the model is built, before the first row's first generation
    and after each generation: at real width the first row takes minutes on a CPU."""
    one = rw.Settings(layers=(1,), dtypes=("float32",), batches=(1,), prompt=8, gen=16, block=8,
                      rows=("fast-dllm",), width=rw.TINY_MODEL, rounds=2, warmup=1)
    assert rw.run_and_report(one) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines[0].startswith("L1-fp32: building the model (tiny width, 1 layers, random weights, on cpu) ...")
    assert lines[1].startswith("L1-fp32: built in ")
    assert lines[2] == "L1-fp32 b1 fast-dllm: 1 warm-up + 2 measured generation(s) of 16 tokens ..."
    assert lines[3].startswith("L1-fp32 b1 fast-dllm: warm-up 1/1 done (")
    assert [line.split(" done")[0] for line in lines[4:6]] == [f"L1-fp32 b1 fast-dllm: round {i}/2" for i in (1, 2)]
    assert lines[6].startswith("L1-fp32 b1 fast-dllm: 16 steps, ")
    assert "| fast-dllm |" in captured.out  # the table on stdout
