"""Every Triton kernel the decoding step launches, compiled ahead of time for sm_80 (A100) and sm_90 (H100 / H200)
on this CPU-only machine with Triton's own compiler, at the launches a real ``polestar`` decode makes: no register
spills (see :mod:`polestar.bench.kernel_aot`).

The launches come from decodes run under :func:`~polestar.bench.kernel_aot.shadow_kernels`, so a kernel added to the
step is compiled here without a list to edit. Compiling runs in a child process without ``TRITON_INTERPRET`` (set
for this folder by its conftest); Triton's cache keeps the compiled kernels between runs.
"""

import json
import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: there is no Triton kernel to compile")

import polestar  # noqa: E402
from polestar.bench import kernel_aot as aot  # noqa: E402
from polestar.kernels import _backend, drift  # noqa: E402

#: dynamic shared memory one program may request: sm_80 163 KiB, sm_90 227 KiB
MAX_SHARED = {80: 163 * 1024, 90: 227 * 1024}
#: the kernels a polestar decode with NVFP4 row stores and the kl drift launches (a plain store's decode launches
#: packet_write_kernel and member_rows_kernel instead of the NVFP4 kernels and the centroid shift)
STEP_KERNELS = {"proxy_attention_kernel", "kl_rows_kernel", "drift_keep_kernel", "assign_kernel",
                "nvfp4_quant_kernel", "nvfp4_dequant_kernel", "cluster_members_kernel", "centroid_shift_kernel"}


def run_aot(tmp_path_factory, runs: str) -> dict:
    """``python -m polestar.bench.kernel_aot --runs <runs>`` in a child process; its JSON (the table goes to stdout,
    shown with ``pytest -s``)."""
    out = tmp_path_factory.mktemp("aot") / f"{runs}.json"
    proc = aot.compile_in_subprocess(["--runs", runs, "--json", str(out)], timeout=1200)
    print(proc.stdout)
    assert proc.returncode in (0, 1) and out.exists(), proc.stderr[-4000:]  # 1: spills or unlaunched kernels
    return json.loads(out.read_text())


def kernel_names() -> set[str]:
    return {name.rsplit(".", 1)[1] for name in aot.launchable_kernels()}


def check_rows(result: dict) -> None:
    """Every kernel of the package compiled for both targets, none spilling, within the registers and shared memory
    a program may have."""
    assert result["uncovered"] == []
    rows = result["rows"]
    for arch in aot.ARCHS:
        assert {r["kernel"] for r in rows if r["arch"] == arch} == kernel_names(), arch
    for r in rows:
        where = f"{r['kernel']} sm_{r['arch']} {r['constexprs']}"
        assert r["n_spills"] == 0, f"{where} spills {r['n_spills']} registers"
        assert 0 < r["n_regs"] <= 255 and 0 <= r["shared"] <= MAX_SHARED[r["arch"]], where


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return run_aot(tmp_path_factory, "tiny")


def test_shadowed_decode_keeps_its_tokens_and_records_every_launch(tmp_path):
    """Under shadow_kernels a CPU decode gives the tokens of a plain one, records the launches of the step's kernels
    with every argument (nothing runs: the interpreter would take minutes), and afterwards everything is back."""
    model = aot.model_for("tiny-llada")
    kw = dict(policy="polestar", gen_length=32, block_length=16, stop_at_eos=False, quant="nvfp4",
              cluster_layers_together=False)
    prompts = [[5, 17, 3], [9, 1, 22, 30, 4, 11, 2]]
    plain = polestar.generate(model, prompts, **kw)
    with aot.shadow_kernels() as launches:
        shadowed = polestar.generate(model, prompts, **kw)
    assert torch.equal(plain.tokens, shadowed.tokens)
    assert {launch.name for launch in launches} == STEP_KERNELS
    for launch in launches:
        assert len(launch.args) + len(launch.kwargs) == len(launch.kernel.arg_names), launch.name
        assert launch.site.endswith("_triton") and launch.site in aot.triton_wrappers()
    # restored: the dispatch tables hold the wrappers again, and auto picks the reference on the CPU
    assert drift._KL["triton"] is drift.kl_drift_triton is aot.triton_wrappers()["kl_drift_triton"][0]
    assert drift._KL["fused"] is torch.ops.polestar_fused.kl_drift
    assert _backend.resolve_backend("auto", torch.zeros(1)) == "reference"


def test_recording_launches_nothing(kdev):
    """Inside recording() a launch is recorded with its grid and arguments and the kernel does not run (its output
    keeps what it held); outside, the same launch runs (under the interpreter on a CPU)."""
    from polestar.kernels import _drift_kernels

    p = torch.full((3, 40), 1 / 40, device=kdev)
    out = torch.full((3,), 7.0, device=kdev)

    def launch():
        _drift_kernels.kl_rows_kernel[(3,)](p, p, out, 40, 40, 40, 1e-12, BLOCK=64)

    with aot.recording("direct") as launches:
        launch()
    assert [(x.name, x.grid, x.site, x.kwargs) for x in launches] == [("kl_rows_kernel", (3,), "direct", {"BLOCK": 64})]
    assert launches[0].args[2] is out and torch.equal(out, torch.full((3,), 7.0, device=kdev))
    launch()
    assert torch.equal(out.cpu(), torch.zeros(3))  # KL(p || p) = 0


def test_compiling_needs_the_kernels_built_by_triton_jit():
    """In this process (TRITON_INTERPRET=1) the kernels are interpreter objects: compiling says where to do it."""
    with aot.recording() as launches:
        drift.kl_drift_triton(torch.rand(2, 8), torch.rand(2, 8))
    if os.environ.get("TRITON_INTERPRET") == "1":
        with pytest.raises(TypeError, match="compile_in_subprocess"):
            aot.specialize(launches[0], 80)
        assert aot.main(["--runs", "tiny"]) == 2
    else:  # a GPU run with TRITON_INTERPRET=0: the kernels are triton.jit functions and specialise here
        signature, constexprs, _attrs, _options = aot.specialize(launches[0], 80)
        assert signature["p_ptr"] == "*fp32" and (7,) in constexprs


def test_every_kernel_compiles_for_sm80_and_sm90_without_spills_at_tiny_shapes(tiny):
    check_rows(tiny)
    sites = "; ".join(site for r in tiny["rows"] for site in r["sites"])
    assert "tiny-llada" in sites and "tiny-dream" in sites
    # tiny-dream has GQA (2 query heads per K/V head): its proxy kernel is not specialised on GROUP == 1
    proxy = [r for r in tiny["rows"] if r["kernel"] == "proxy_attention_kernel"]
    assert {"GROUP" in r["constexprs"] for r in proxy} == {True, False}


@pytest.mark.slow
def test_every_kernel_compiles_for_sm80_and_sm90_without_spills_at_llada_8b_and_dream_7b_shapes(tmp_path_factory):
    """The published geometries (head dim 128; LLaDA-8B 32 heads, d_model 4096; Dream-7B 28 heads over 4 K/V heads,
    d_model 3584) at 320 and 1,089 key columns."""
    result = run_aot(tmp_path_factory, "published")
    check_rows(result)
    rows = result["rows"]
    proxy = [r for r in rows if r["kernel"] == "proxy_attention_kernel"]
    assert {r["constexprs"]["BLOCK_D"] for r in proxy} == {128} and {r["constexprs"]["BLOCK_T"] for r in proxy} == {64}
    llada = [r for r in proxy if any(s.startswith("llada-8b") for s in r["sites"])]
    dream = [r for r in proxy if any(s.startswith("dream-7b") for s in r["sites"])]
    assert llada and dream and all(r["constexprs"].get("GROUP") == 1 for r in llada)
    assert not any("GROUP" in r["constexprs"] for r in dream)  # 7 query heads per K/V head
    assert {r["constexprs"]["BLOCK"] for r in rows if r["kernel"] == "drift_keep_kernel"} == {512, 2048}
    assert {r["constexprs"]["BLOCK"] for r in rows if r["kernel"] == "kl_rows_kernel"} == {2048}  # a commit's drift
    assert {r["constexprs"]["BLOCK_D"] for r in rows if r["kernel"] == "assign_kernel"} == {256}
    entropy = [r for r in rows if r["kernel"] == "entropy_rows_kernel"]
    assert entropy and all(r["constexprs"]["BLOCK"] == 2048 for r in entropy)  # vocabulary 126,464
