"""GPU check (one H100/H200, no download, < 8 minutes): eager vs compiled step time of baseline, fast-dllm and
polestar on an LLaDA-8B-shaped model with random bf16 weights, Triton kernels vs references, and the
memory-bandwidth bound of one forward (weight bytes / HBM bandwidth).

Random weights make confidences meaningless, so every policy runs with the same fixed commit schedule
(``commit=topk`` with two tokens per step); only the refresh differs.
"""

from __future__ import annotations

import argparse
import time

import torch

import polestar
from polestar.kernels.drift import kl_drift, reference_kl_drift
from polestar.kernels.kmeans import kmeans_assign, reference_kmeans_assign
from polestar.kernels.quant import nvfp4_quantize, reference_nvfp4_quantize
from polestar.models.loading import FAMILIES
from polestar.models.spec import ModelSpec

HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}


def llada_8b(device: str, layers: int) -> torch.nn.Module:
    spec = ModelSpec(family="llada", n_layers=layers, d_model=4096, n_heads=32, n_kv_heads=32, mlp_hidden=12288,
                     vocab_size=126464, embedding_size=126464, rope_theta=500000.0, norm_eps=1e-5,
                     max_seq_len=4096, mask_id=126336, eos_id=126081, pad_id=126081)
    with torch.device("meta"):
        model = FAMILIES["llada"][1](spec)
    model = model.to_empty(device=device).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, spec.head_dim, 2, dtype=torch.float32) / spec.head_dim))
    model.rotary.inv_freq = inv.to(device)
    return model.eval()


def cuda_time(fn, reps: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--batches", default="1,32")
    args = ap.parse_args()
    device = "cuda"
    name = torch.cuda.get_device_name()
    bw = next((v for k, v in HBM_BYTES_PER_S.items() if k in name), 3.35e12)
    model = llada_8b(device, args.layers)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bound_ms = 1e3 * weight_bytes / bw
    print(f"# {name}: {weight_bytes / 1e9:.1f} GB of weights, bandwidth bound {bound_ms:.2f} ms per forward")
    print(f"{'policy':12s} {'batch':>5s} {'mode':>9s} {'ms/step':>9s} {'bound ms':>9s} {'x bound':>8s} {'nfe':>5s}")
    steps = args.gen // 2
    for batch in map(int, args.batches.split(",")):
        prompts = torch.randint(0, 126000, (batch, args.prompt))
        for policy in ("baseline", "fast-dllm", "polestar"):
            for compiled in (False, True):
                kw = dict(policy=policy, gen_length=args.gen, block_length=32, steps=steps, commit="topk",
                          stop_at_eos=False, compile=compiled)
                polestar.generate(model, prompts, **kw)  # warm-up / compile
                torch.cuda.synchronize()
                t = time.perf_counter()
                out = polestar.generate(model, prompts, **kw)
                torch.cuda.synchronize()
                ms = 1e3 * (time.perf_counter() - t) / out.stats.nfe
                print(f"{policy:12s} {batch:5d} {'compiled' if compiled else 'eager':>9s} {ms:9.2f} {bound_ms:9.2f} "
                      f"{ms / bound_ms:8.2f} {out.stats.nfe:5d}", flush=True)
    print("\n# kernels: triton vs reference (ms)")
    p = torch.rand(32 * 32 * 32, args.prompt + args.gen, device=device).softmax(-1)
    q = torch.rand_like(p).softmax(-1)
    x = torch.randn(32 * 96, 4096, device=device, dtype=torch.bfloat16)
    c = torch.randn(32, 8, 4096, device=device, dtype=torch.bfloat16)
    xg = x.view(32, 96, 4096)
    for label, fast, ref in (
        ("kl_drift", lambda: kl_drift(p, q, backend="triton"), lambda: reference_kl_drift(p, q)),
        ("kmeans_assign", lambda: kmeans_assign(xg, c, backend="triton"), lambda: reference_kmeans_assign(xg, c)),
        ("nvfp4_quantize", lambda: nvfp4_quantize(x, backend="triton"), lambda: reference_nvfp4_quantize(x)),
    ):
        print(f"{label:16s} triton {1e3 * cuda_time(fast):8.3f}  reference {1e3 * cuda_time(ref):8.3f}")


if __name__ == "__main__":
    main()
