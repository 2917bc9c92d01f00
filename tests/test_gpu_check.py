"""bench/gpu/check.py and check.sh at a narrow width on the CPU: every step the GPU run takes, in seconds."""

import json
import os
import subprocess
from pathlib import Path

from bench.gpu.check import POLICIES, main

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_check_runs_every_step(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["--tiny", "--device", "cpu", "--batches", "1", "--gen", "8", "--prompt", "4", "--modes", "eager",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "# load:" in printed and "# forward batch 1:" in printed
    rows = json.loads(out.read_text())
    assert [r["policy"] for r in rows["policies"]] == list(POLICIES)
    assert all(r["nfe"] == 4 and r["tps"] > 0 for r in rows["policies"])  # 8 tokens, two per step
    assert rows["load"]["weight_bytes"] > 0 and {k["kernel"] for k in rows["kernels"]} == {
        "kl_drift", "kmeans_assign", "nvfp4_quantize"}


def test_check_sh_stops_at_the_first_failing_command():
    env = dict(os.environ, POLESTAR_SKIP_INSTALL="1", PYTHON="false")
    run = subprocess.run(["bash", str(ROOT / "bench/gpu/check.sh"), "--tiny"], env=env, capture_output=True, text=True)
    assert run.returncode != 0 and "load:" not in run.stdout
    script = (ROOT / "bench/gpu/check.sh").read_text()
    assert "set -euo pipefail" in script and "|| true" not in script and "2>/dev/null" not in script


def test_cuda_run_without_cuda_is_one_clear_error(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
