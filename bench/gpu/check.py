"""GPU check (one H100/H200, no download, < 8 minutes), run by ``bench/gpu/check.sh``.

1. Writes an LLaDA-8B-Instruct-shaped checkpoint (the published config.json and tokenizer files, random bf16
   weights, sharded) and loads it with ``polestar.load`` straight onto the device: load time and peak device
   memory against the weights (bound 1.05x).
2. One full forward per batch size against the weight-bandwidth bound (weight bytes / HBM bandwidth).
3. Step time and tokens per second of ``baseline``, ``fast-dllm`` and ``polestar``, eager and compiled, batch 1
   and 16, with the peak device memory of each run. Random weights make confidences meaningless, so every
   policy runs with the same fixed commit schedule (``commit=topk``, two tokens per step); only the refresh
   differs.
4. Triton kernels against their references (optional: skipped, with the reason and what to install, when
   triton is missing, or off CUDA without ``TRITON_INTERPRET=1``; checked before step 1).

``--tiny`` runs the same steps at a narrow width and depth on any device (the CPU test in tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import polestar
from polestar.bench.item_log import write_atomic
from polestar.fixtures import write_published_checkpoint
from polestar.kernels.drift import kl_drift, reference_kl_drift
from polestar.kernels.kmeans import kmeans_assign, reference_kmeans_assign
from polestar.kernels.quant import nvfp4_quantize, reference_nvfp4_quantize

HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}
#: device-memory bound of loading, as a multiple of the weights
LOAD_BOUND = 1.05
#: --tiny: a narrow LLaDA (the published config with these keys replaced)
TINY_WIDTH = {"d_model": 64, "n_heads": 4, "n_kv_heads": 4, "mlp_hidden_size": 128}
POLICIES = ("baseline", "fast-dllm", "elastic-cache", "polestar")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options, with the full-size or --tiny defaults filled in."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="narrow width, 2 layers, short sequences (CPU-testable)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=None, help="depth (default 32, --tiny 2)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 256, --tiny 8)")
    ap.add_argument("--gen", type=int, default=None, help="generated tokens (default 128, --tiny 16)")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,16; --tiny 1,2)")
    ap.add_argument("--modes", default="eager,compiled", help="eager and/or compiled")
    ap.add_argument("--workdir", default=None, help="where to write the checkpoint (default: a temporary dir)")
    ap.add_argument("--json", dest="json_out", default=None, metavar="OUT.json", help="also write the rows")
    args = ap.parse_args(argv)
    args.layers = args.layers or (2 if args.tiny else 32)
    args.prompt = args.prompt or (8 if args.tiny else 256)
    args.gen = args.gen or (16 if args.tiny else 128)
    args.batches = [int(b) for b in (args.batches or ("1,2" if args.tiny else "1,16")).split(",")]
    args.modes = [m.strip() for m in args.modes.split(",")]
    bad = [m for m in args.modes if m not in ("eager", "compiled")]
    if bad:
        ap.error(f"--modes takes eager and/or compiled, got {bad}")
    if args.gen % 32 and not args.tiny:
        ap.error("--gen must be a multiple of the block length 32")
    return args


def kernel_step_blocker(device: torch.device) -> str | None:
    """Why step 4 (Triton kernels) cannot run here, with what to do about it; None when it can."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed; pip install triton (or pip install -e '.[triton]') to run it"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"Triton kernels need a CUDA device, or TRITON_INTERPRET=1 on {device.type}"
    return None


def synced(device: torch.device) -> Callable[[], None]:
    """A function that waits for ``device``'s queued work (no-op off CUDA)."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def peak_memory(device: torch.device) -> int:
    """Peak allocated device bytes since the last reset (0 off CUDA)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def reset_peak(device: torch.device) -> None:
    """Reset the peak-memory counter of ``device`` (no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def bandwidth(device: torch.device) -> float | None:
    """HBM bytes per second of the CUDA device by its name (H100 figure when unknown); None off CUDA."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in HBM_BYTES_PER_S.items() if k in name), 3.35e12)


def load_checkpoint(directory: Path, device: torch.device) -> tuple[torch.nn.Module, dict]:
    """Load onto ``device``; returns the model and the load facts (seconds, weight bytes, peak device bytes)."""
    sync = synced(device)
    reset_peak(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    start = time.perf_counter()
    model = polestar.load(directory, device=device)
    sync()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    facts = {"load_s": time.perf_counter() - start, "weight_bytes": weights, "peak_bytes": peak_memory(device) - before}
    return model, facts


def time_forward(model, ids: torch.Tensor, reps: int = 3) -> float:
    """Seconds of one full forward over ``ids [B, L]`` (after one warm-up)."""
    sync = synced(ids.device)
    with torch.inference_mode():
        model(ids)
        sync()
        start = time.perf_counter()
        for _ in range(reps):
            model(ids)
        sync()
    return (time.perf_counter() - start) / reps


def policy_rows(model, args, device: torch.device) -> list[dict]:
    """Step time, TPS, NFE and peak memory of each policy, mode and batch size (printed and returned)."""
    rows = []
    block = min(32, args.gen)
    for batch in args.batches:
        prompts = torch.randint(0, 126000, (batch, args.prompt), generator=torch.Generator().manual_seed(batch))
        for policy in POLICIES:
            for mode in args.modes:
                kw = dict(policy=policy, gen_length=args.gen, block_length=block, steps=args.gen // 2,
                          commit="topk", stop_at_eos=False, compile=mode == "compiled")
                polestar.generate(model, prompts, **kw)  # warm-up / compile
                reset_peak(device)
                out = polestar.generate(model, prompts, **kw)
                s = out.stats
                rows.append({"policy": policy, "batch": batch, "mode": mode, "ms_per_step": 1e3 * s.wall_s / s.nfe,
                             "tps": batch * args.gen / s.wall_s, "nfe": s.nfe, "peak_gb": peak_memory(device) / 1e9,
                             "eager_steps": s.nfe - s.compiled_steps, "graph_replays": s.compiled_steps})
                r = rows[-1]
                print(f"{policy:10s} {batch:5d} {mode:>9s} {r['ms_per_step']:9.2f} {r['tps']:9.1f} {r['nfe']:5d} "
                      f"{r['peak_gb']:8.2f} {r['eager_steps']:6d} {r['graph_replays']:7d}", flush=True)
    return rows


def kernel_rows(args, device: torch.device) -> list[dict]:
    """Milliseconds of each Triton kernel and its reference on inputs shaped like one step's."""
    scale = 1 if args.tiny else 32
    L, d = args.prompt + args.gen, 64 if args.tiny else 4096
    p = torch.rand(scale * scale * scale, L, device=device).softmax(-1)
    q = torch.rand_like(p).softmax(-1)
    x = torch.randn(scale * 96, d, device=device, dtype=torch.bfloat16)
    c = torch.randn(scale, 8, d, device=device, dtype=torch.bfloat16)
    xg = x.view(scale, 96, d)
    rows = []
    for label, fast, ref in (
        ("kl_drift", lambda: kl_drift(p, q, backend="triton"), lambda: reference_kl_drift(p, q)),
        ("kmeans_assign", lambda: kmeans_assign(xg, c, backend="triton"), lambda: reference_kmeans_assign(xg, c)),
        ("nvfp4_quantize", lambda: nvfp4_quantize(x, backend="triton"), lambda: reference_nvfp4_quantize(x)),
    ):
        rows.append({"kernel": label, "triton_ms": 1e3 * timed(fast, device), "reference_ms": 1e3 * timed(ref, device)})
        print(f"{label:16s} triton {rows[-1]['triton_ms']:8.3f}  reference {rows[-1]['reference_ms']:8.3f}", flush=True)
    return rows


def timed(fn, device: torch.device, reps: int = 3) -> float:
    """Mean seconds of ``fn()`` over ``reps`` calls after one warm-up."""
    sync = synced(device)
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - start) / reps


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns the exit status (1 when loading broke the memory bound, 2 without CUDA)."""
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available; run on the GPU machine or pass --tiny --device cpu",
              file=sys.stderr)
        return 2
    blocker = kernel_step_blocker(device)
    if blocker is not None:
        print(f"# step 4 (Triton kernels) will be skipped: {blocker}", flush=True)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="polestar-gpu-check-"))
    try:
        start = time.perf_counter()
        directory = write_published_checkpoint(workdir / "llada-8b-shaped", "llada", args.layers,
                                               TINY_WIDTH if args.tiny else None)
        disk = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
        print(f"# wrote {args.layers}-layer LLaDA-8B-{'narrow' if args.tiny else 'shaped'} checkpoint, "
              f"{disk / 1e9:.2f} GB, in {time.perf_counter() - start:.1f} s", flush=True)
        model, load = load_checkpoint(directory, device)
        ratio = load["peak_bytes"] / load["weight_bytes"]
        print(f"# load: {load['load_s']:.1f} s, weights {load['weight_bytes'] / 1e9:.2f} GB, peak device memory "
              f"{load['peak_bytes'] / 1e9:.2f} GB = {ratio:.3f}x weights (bound {LOAD_BOUND}x)", flush=True)
        if device.type == "cuda" and ratio > LOAD_BOUND:
            print(f"error: loading peaked at {ratio:.3f}x the weights, above {LOAD_BOUND}x", file=sys.stderr)
            return 1
        bw = bandwidth(device)
        forwards = []
        for batch in args.batches:
            ids = torch.randint(0, 126000, (batch, args.prompt + args.gen), device=device)
            t = time_forward(model, ids)
            bound = load["weight_bytes"] / bw if bw else None
            forwards.append({"batch": batch, "forward_ms": 1e3 * t, "bound_ms": 1e3 * bound if bound else None})
            tail = f"bound {1e3 * bound:.2f} ms ({t / bound:.2f}x)" if bound else "bound n/a (no HBM figure)"
            print(f"# forward batch {batch}: {1e3 * t:.2f} ms, {tail}", flush=True)
        print(f"{'policy':10s} {'batch':>5s} {'mode':>9s} {'ms/step':>9s} {'TPS':>9s} {'nfe':>5s} {'peak GB':>8s} "
              f"{'eager':>6s} {'replays':>7s}")
        rows = policy_rows(model, args, device)
        kernels: list[dict] = []
        if blocker is None:
            print("\n# kernels: triton vs reference (ms)")
            kernels = kernel_rows(args, device)
        else:
            print(f"\n# kernels: skipped ({blocker})")
        if args.json_out:
            write_atomic(args.json_out, json.dumps({"load": load, "forwards": forwards, "policies": rows,
                                                    "kernels": kernels, "kernels_skipped": blocker}, indent=1))
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
