"""Tests for backend selection and for importing ``polestar.kernels`` without Triton."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from polestar.kernels import _backend as be


def test_resolve_backend():
    cpu = torch.zeros(2)
    assert be.resolve_backend("auto", cpu) == "reference"
    assert be.resolve_backend("reference", cpu) == "reference"
    assert be.resolve_backend("auto") == "reference"
    with pytest.raises(ValueError):
        be.resolve_backend("cuda", cpu)
    if be.HAS_TRITON:
        assert be.resolve_backend("triton", cpu) == "triton"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_picks_triton_on_cuda():
    x = torch.zeros(2, device="cuda")
    assert be.resolve_backend("auto", x) == ("triton" if be.HAS_TRITON else "reference")
    assert be.resolve_backend("auto", x, torch.zeros(2)) == "reference"  # mixed devices


def test_pick_and_next_pow2():
    table = {"reference": "r", "triton": "t"}
    assert be.pick(table, "auto", torch.zeros(1)) == "r"
    assert [be.next_pow2(n) for n in (0, 1, 2, 3, 16, 17)] == [1, 1, 2, 4, 16, 32]


def test_modules_import_and_run_without_triton():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        sys.modules["triton.language"] = None
        import torch
        from polestar.kernels import _library, drift, kmeans, proxy_attention, quant
        assert not (drift.HAS_TRITON or kmeans.HAS_TRITON or quant.HAS_TRITON or proxy_attention.HAS_TRITON)
        assert not _library.is_registered("kl_drift")  # no torch.library ops without triton
        p = torch.softmax(torch.randn(2, 8), -1)
        assert drift.kl_drift(p, p).abs().max() == 0
        assert kmeans.spherical_kmeans(torch.randn(1, 6, 3), 2).labels.shape == (1, 6)
        assert quant.nvfp4_dequantize(quant.nvfp4_quantize(torch.randn(3, 16))).shape == (3, 16)
        q, k, valid = torch.randn(1, 2, 3, 4), torch.randn(1, 1, 5, 4), torch.ones(1, 5, dtype=torch.bool)
        assert proxy_attention.proxy_attention(q, k, valid, 0.5).shape == (1, 2, 3, 5)
        for fn, args in [
            (drift.kl_drift_triton, (p, p)),
            (quant.nvfp4_quantize_triton, (p,)),
            (proxy_attention.proxy_attention_triton, (q, k, valid, 0.5)),
        ]:
            try:
                fn(*args)
            except RuntimeError:
                pass
            else:
                raise AssertionError("expected RuntimeError without triton")
        print("OK")
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("OK")
