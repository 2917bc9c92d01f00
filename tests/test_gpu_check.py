"""bench/gpu/check.sh and check.py on this CPU machine, offline: the install, every step the GPU run takes, the
fallback to the source tree, the CUDA-graph counters and the time budget.

The end-to-end runs use a Python without polestar (a venv that sees this environment's packages through one
``.pth`` line, which adds the folder but not the editable install's own ``.pth`` in it) and ``PIP_NO_INDEX=1``,
and a smaller variant of ``--tiny`` (batch 1, 4 prompt and 8 generated tokens, two policies) so that CI stays
short; ``bash bench/gpu/check.sh --tiny --device cpu`` with its defaults takes a few minutes here.
"""

import json
import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from bench.gpu import check, source_tree
from bench.gpu.check import Budget, GraphEvents, main
from polestar.models.published import published_model

ROOT = Path(__file__).resolve().parents[1]
CHECK_SH = ROOT / "bench" / "gpu" / "check.sh"
#: the smaller --tiny variant the end-to-end runs take
SMALL = ["--tiny", "--device", "cpu", "--batches", "1", "--prompt", "4", "--gen", "8",
         "--policies", "baseline,polestar", "--compile-policies", "polestar"]


@pytest.fixture
def bare_python(tmp_path):
    """A Python that has this environment's packages (torch, triton, transformers, pip, setuptools) but not
    polestar, as a fresh GPU machine has."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    parents = [p for p in [*site.getsitepackages(), sysconfig.get_paths()["purelib"]] if os.path.isdir(p)]
    Path(purelib, "_this_environment.pth").write_text("\n".join(dict.fromkeys(parents)) + "\n")
    probe = subprocess.run([python, "-c", "import importlib.util as u\n"
                            "assert all(map(u.find_spec, ('torch', 'triton', 'transformers', 'setuptools', 'pip')))\n"
                            "import polestar"], cwd=tmp_path, capture_output=True, text=True)
    assert "No module named 'polestar'" in probe.stderr, probe.stderr[-2000:]
    return python


def run_check_sh(python, tmp_path, *args, **env):
    """``bash check.sh ARGS`` with ``python``, offline (``PIP_NO_INDEX=1``, no proxy reachable), from ``tmp_path``."""
    env = {**os.environ, "PYTHON": str(python), "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "OMP_NUM_THREADS": "1", **env}
    run = subprocess.run(["bash", str(CHECK_SH), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


@pytest.mark.slow
def test_check_sh_installs_offline_and_runs_every_step(bare_python, tmp_path):
    out = tmp_path / "rows.json"
    printed = run_check_sh(bare_python, tmp_path, *SMALL, "--json", str(out), TRITON_INTERPRET="1")
    assert "# install: done" in printed and "pip failed" not in printed
    polestar_line = next(line for line in printed.splitlines() if line.startswith("# polestar from"))
    assert str(ROOT / "polestar" / "__init__.py") in polestar_line  # the editable install of this checkout
    for step in ("# step 1: wrote 2-layer", "# load (float32)", "# step 2: forward batch 1", "# step 3: eager",
                 "# step 4: compiled (eager) at 2 layers", "# step 5: quant='fp8' compiled", "# step 6: Triton"):
        assert step in printed, step
    rows = json.loads(out.read_text())
    assert [(r["policy"], r["mode"]) for r in rows["policies"]] == [
        ("baseline", "eager"), ("polestar", "eager"), ("polestar", "eager"), ("polestar", "compiled"),
        ("polestar+fp8", "compiled")]
    for r in rows["policies"]:
        assert r["nfe"] == 4 and r["tps"] > 0 and r["layers"] == 2  # 8 tokens, two per step
        # off CUDA: every step of a compiled row went through the captured step, and no CUDA-graph figure is made up
        assert r["compiled_steps"] == (r["nfe"] if r["mode"] == "compiled" else 0)
        assert r["graph_replays"] is None and r["bound_ms"] is None
    assert rows["skipped"] == []
    kernels = {k["kernel"]: k for k in rows["kernels"]}
    assert set(kernels) == {"proxy_attention", "kl_drift", "kmeans_assign", "nvfp4_quantize", "nvfp4_dequantize",
                            "drift_keep", "packet_write", "member_rows"}
    assert set(check.EXACT_KERNELS) < set(kernels) and rows["kernel_mismatches"] == []
    assert all(kernels[name]["max_abs_diff"] == 0 for name in check.EXACT_KERNELS)
    assert kernels["proxy_attention"]["max_abs_diff"] < 1e-5 and kernels["kl_drift"]["max_abs_diff"] < 1e-5
    assert kernels["drift_keep"]["max_abs_diff"] < 1e-5 and kernels["packet_write"]["max_abs_diff"] < 0.1


@pytest.mark.slow
@pytest.mark.parametrize("how", ["POLESTAR_INSTALL=source", "pip fails"])
def test_check_sh_runs_from_the_source_tree_when_nothing_is_installed(bare_python, tmp_path, how):
    """Asked to, or when pip cannot install the checkout (here: a constraint no version meets), check.sh runs the
    checkout through a package tree of links: check.py imports every module it uses from there (``--help`` stops it
    after its imports; the full run is the test above) and nothing is installed."""
    constraint = tmp_path / "constraints.txt"
    constraint.write_text("polestar-dllm<0\n")
    env = {"POLESTAR_INSTALL": "source"} if how == "POLESTAR_INSTALL=source" else {"PIP_CONSTRAINT": str(constraint)}
    printed = run_check_sh(bare_python, tmp_path, "--help", **env)
    assert ("pip failed (its last lines above); running from the source tree" in printed) == (how == "pip fails")
    polestar_line = next(line for line in printed.splitlines() if line.startswith("# polestar from"))
    assert "/src/polestar/__init__.py" in polestar_line and "usage: check.py" in printed
    probe = subprocess.run([bare_python, "-c", "import polestar"], cwd=tmp_path, capture_output=True, text=True)
    assert probe.returncode != 0


def test_source_tree_lays_out_the_installed_package(tmp_path):
    links = source_tree.build(ROOT, tmp_path / "src")
    tree = tmp_path / "src" / "polestar"
    assert (tree / "policies").resolve() == ROOT / "policies" and (tree / "kernels").resolve() == ROOT / "kernels"
    assert (tree / "bench" / "tasks").resolve() == ROOT / "bench" / "tasks"  # inside the bench link
    assert (tree / "api.py").resolve() == ROOT / "polestar" / "api.py"
    assert not tree.is_symlink() and (tree / "policies").is_symlink()  # a folder of links: nothing written in ROOT
    assert all(link.is_symlink() for link in links) and not any(p.is_symlink() for p in ROOT.iterdir())
    found = subprocess.run([sys.executable, "-c", "import polestar.kernels.drift as d, polestar.policies as p; "
                            "print(d.__file__); print(p.__file__)"], cwd=tmp_path, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(tmp_path / "src")})
    assert found.stdout.split() == [str(tree / "kernels" / "drift.py"), str(tree / "policies" / "__init__.py")]


def test_check_sh_stops_at_the_first_failing_command(tmp_path):
    env = dict(os.environ, PYTHON="false")
    run = subprocess.run(["bash", str(CHECK_SH), "--tiny"], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode != 0 and "load" not in run.stdout
    script = CHECK_SH.read_text()
    assert "set -euo pipefail" in script and "|| true" not in script and "2>/dev/null" not in script


def test_cuda_run_without_cuda_is_one_clear_error(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_graph_events_count_replays_recordings_and_skips(monkeypatch):
    """Replays and recordings go through torch.cuda.CUDAGraph's methods (whatever they are: stand-ins here, as
    this machine has no CUDA), skips through Inductor's logger; everything is restored afterwards."""
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees, cudagraph_utils

    calls = []
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: calls.append(("replay", graph)))
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", lambda graph, *a, **k: calls.append(("capture", graph)))
    replay, capture, logger = torch.cuda.CUDAGraph.replay, torch.cuda.CUDAGraph.capture_begin, \
        cudagraph_trees.log_cudagraph_skip_and_bump_counter
    skips_before = counters["inductor"]["cudagraph_skips"]
    with GraphEvents() as events:
        for graph in ("g1", "g2", "g1"):
            torch.cuda.CUDAGraph.replay(graph)
        torch.cuda.CUDAGraph.capture_begin("g3", pool=None)
        cudagraph_trees.log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (2 instances)")
    assert (events.replays, events.recordings, events.skips) == (3, 1, 1)
    assert events.reasons == ["skipping cudagraphs due to mutated inputs (2 instances)"]
    assert calls == [("replay", "g1"), ("replay", "g2"), ("replay", "g1"), ("capture", "g3")]
    assert counters["inductor"]["cudagraph_skips"] == skips_before + 1
    assert (torch.cuda.CUDAGraph.replay, torch.cuda.CUDAGraph.capture_begin) == (replay, capture)
    assert (cudagraph_trees.log_cudagraph_skip_and_bump_counter is logger
            is cudagraph_utils.log_cudagraph_skip_and_bump_counter)


def test_an_exact_kernel_that_differs_from_its_reference_is_named():
    rows = [{"kernel": "proxy_attention", "max_abs_diff": 8.9e-8}, {"kernel": "kmeans_assign", "max_abs_diff": 0.0},
            {"kernel": "nvfp4_quantize", "max_abs_diff": 17.0}]
    assert check.kernel_mismatches(rows) == [
        "nvfp4_quantize: the Triton kernel and its torch reference differ by up to 17 (they must be equal)"]


def test_budget_skips_rows_once_spent(capsys):
    budget = Budget(limit=0.0)
    assert not budget.allows("polestar compiled b16")
    assert budget.skipped == ["polestar compiled b16"] and "# skipped polestar compiled b16" in capsys.readouterr().out
    roomy = Budget(limit=60.0)
    assert roomy.allows("baseline eager b1") and not roomy.allows("polestar compiled b1", reserve=61.0)
    assert roomy.skipped == ["polestar compiled b1"]


def test_tiny_cpu_defaults_compile_without_codegen_in_float32():
    args = check.parse_args(["--tiny", "--device", "cpu"])
    assert (args.layers, args.compile_layers, args.compile_backend, args.dtype) == (2, 2, "eager", "float32")
    full = check.parse_args([])
    # compiled at the published depth: a layer is one compiled region, reused by every layer
    assert (full.layers, full.compile_layers, full.compile_backend, full.dtype) == (32, 32, "inductor", "bfloat16")
    assert full.modes == ["eager", "graphs", "compiled"] and not full.profile
    assert full.batches == [1, 16] and full.compile_policies == ["fast-dllm", "polestar"] and full.budget == 450
    assert set(check.POLICIES) == {"baseline", "fast-dllm", "elastic-cache", "dllm-cache", "polestar"}


def test_eager_rows_are_truly_eager_and_profile_lists_the_costliest_operations(capsys):
    args = check.parse_args(["--tiny", "--device", "cpu", "--batches", "1"])
    model = published_model("llada", 2, check.TINY_WIDTH, dtype=torch.float32, device="cpu")
    row = check.decode_row(model, args, torch.device("cpu"), "fast-dllm", 1, "eager", 2)
    assert row["mode"] == "eager" and row["compiled_steps"] == 0 and "POLESTAR_EAGER" not in os.environ
    rows = check.profile_policy(model, args, torch.device("cpu"), "fast-dllm")
    assert len(rows) == 10 and rows[0][1] >= rows[-1][1] > 0
    assert "# profile fast-dllm b1" in capsys.readouterr().out


@pytest.mark.parametrize("backend, passed", [("inductor", True), ("aot_eager", "aot_eager"), ("eager", "eager")])
def test_compile_backend_names_what_a_compiled_row_passes(backend, passed):
    # inductor: what compile=True means (the layer regions' backend); another name is passed as it is
    args = type("Args", (), {"compile_backend": backend})()
    assert check.compile_arg(args) == passed
