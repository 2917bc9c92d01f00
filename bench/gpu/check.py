"""GPU check, run by ``bench/gpu/check.sh``: one offline command on a machine
with one H100 / H200 (or A100), < 8 minutes.

0. The device: its name, compute capability and HBM bandwidth figure and whether step 6 (Triton kernels) can run.
1. Writes an LLaDA-8B-Instruct-shaped checkpoint (the published config.json and tokenizer files, random bf16
   weights, sharded) and loads it with ``polestar.load`` straight onto the device: load time and peak device
   memory against the weights (bound 1.05x).
2. One full forward per batch size against the weight-bandwidth bound (weight bytes / HBM bandwidth).
3. Eager rows: every policy of :data:`POLICIES` at batch 1 and 16 on that model, truly eager (``POLESTAR_EAGER=1``),
   and beside each on CUDA its ``graphs`` row: the same uncompiled step replayed as one captured CUDA graph per step
   phase (:mod:`polestar.step_graphs`, the default of an uncompiled decode on CUDA). Random weights make confidences
   meaningless, so every policy commits on the same fixed schedule (``commit=topk``, two tokens per step); only the
   refresh differs. Each row gives ms per step against the step's weight-bandwidth bound (the weight bytes the step
   reads, as the engine counts them, over the HBM bandwidth), tokens per second and peak device memory.
4. Compiled rows: the ``--compile-policies`` (default ``fast-dllm`` and ``polestar``), eager and compiled side by
   side, on a model of the same width with ``--compile-layers`` layers (default: the checkpoint's depth; a smaller
   one is built in memory on the device). Each layer's model work is one compiled region reused by every layer, so
   the compile is measured at the published depth. Each compiled row counts, during its timed run, the real
   CUDA-graph replays (calls of ``torch.cuda.CUDAGraph.replay``, through which cudagraph trees replay a recorded
   graph) and graph recordings (``CUDAGraph.capture_begin``), and over its warm-up and run Inductor's cudagraph
   skips (``torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]``) with the reasons Inductor gave.
5. ``quant='fp8'`` compiled: one ``polestar`` row (the fp8 row store runs in the step, outside the compiled layer
   regions, so any GPU runs it).

``--profile``: after step 3, the ten most expensive operations of one decode per policy (``torch.profiler``, by
self device time on CUDA, self CPU time elsewhere).

6. Triton kernels against their torch references at the shapes one step launches them with: milliseconds and the
   largest difference (optional: skipped, with the reason and what to install, when triton is missing, or off
   CUDA without ``TRITON_INTERPRET=1``).

A row that would start after ``--budget`` seconds (default 450), or a compiled row with less than
:data:`COMPILE_RESERVE` seconds of it left, is skipped with a line saying so.

``--tiny`` runs the same steps at a narrow width and depth on any device (tests/test_gpu_check.py); on a CPU its
compiled rows use the ``"eager"`` compile backend (dynamo captures each layer region, no code is generated) unless
``--compile-backend`` says otherwise.
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
from typing import NamedTuple

import torch

import polestar
from polestar.fixtures import write_published_checkpoint
from polestar.kernels.drift import DEFAULT_EPS, kl_drift, reference_kl_drift
from polestar.kernels.drift_keep import METRICS, drift_keep, reference_drift_keep
from polestar.kernels.kmeans import kmeans_assign, reference_kmeans_assign
from polestar.kernels.member_rows import member_rows, packet_write, reference_member_rows, reference_packet_write
from polestar.kernels.proxy_attention import proxy_attention, reference_proxy_attention
from polestar.kernels.quant import (
    nvfp4_dequantize,
    nvfp4_quantize,
    reference_nvfp4_dequantize,
    reference_nvfp4_quantize,
)
from polestar.models.published import published_model
from polestar.output_files import write_atomic

HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}
#: device-memory bound of loading, as a multiple of the weights
LOAD_BOUND = 1.05
#: --tiny: a narrow LLaDA (the published config with these keys replaced)
TINY_WIDTH = {"d_model": 64, "n_heads": 4, "n_kv_heads": 4, "mlp_hidden_size": 128}
POLICIES = ("baseline", "fast-dllm", "elastic-cache", "dllm-cache", "polestar")
#: how a row runs its steps: truly eager, uncompiled and replayed as CUDA graphs, or compiled
MODES = ("eager", "graphs", "compiled")
#: compiled by default (step 4): the cache baseline the goals compare with and the project's own
COMPILE_POLICIES = ("fast-dllm", "polestar")
#: seconds a compiled row is expected to take at most (its compiles included): no compiled row starts later than
#: this before the budget ends, so that check.sh's timeout does not cut one short. Measured on an H200 (torch 2.11,
#: 4 layers, cold caches): Polestar's graphs compiled in 76 s at batch 1 and 150 s at batch 16, the baseline's in
#: 14 s and 21 s
COMPILE_RESERVE = 160.0
#: step 6's kernels whose results must equal their references' bit for bit (labels, codes, scales, dequantized
#: values); the others compute in a different order and are compared by their largest difference alone
EXACT_KERNELS = ("kmeans_assign", "nvfp4_quantize", "nvfp4_dequantize", "member_rows")
#: Polestar's defaults the kernel shapes of step 6 follow: clusters per layer, window blocks (2 before, 1 after)
N_CLUSTERS, WINDOW_BLOCKS = 8, 3
HEADER = (f"{'policy':13s} {'batch':>5s} {'layers':>6s} {'mode':>8s} {'ms/step':>8s} {'bound':>7s} {'x bound':>7s} "
          f"{'TPS':>8s} {'nfe':>4s} {'compiled':>8s} {'replays':>7s} {'recorded':>8s} {'skips':>5s} {'peak GB':>7s}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options, with the full-size or --tiny defaults filled in."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="narrow width, 2 layers, short sequences (CPU-testable)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=None, help="depth of the checkpoint (default 32, --tiny 2)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 256, --tiny 8)")
    ap.add_argument("--gen", type=int, default=None, help="generated tokens (default 128, --tiny 16)")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,16; --tiny 1,2)")
    ap.add_argument("--modes", default="eager,graphs,compiled",
                    help="any of eager, graphs (uncompiled steps replayed as CUDA graphs; CUDA only), compiled")
    ap.add_argument("--profile", action="store_true",
                    help="after step 3, the ten most expensive operations of one decode per policy")
    ap.add_argument("--policies", default=",".join(POLICIES), help="eager rows of step 3 (comma-separated)")
    ap.add_argument("--compile-policies", default=",".join(COMPILE_POLICIES), help="policies of step 4")
    ap.add_argument("--compile-layers", type=int, default=None,
                    help="depth of step 4's model (default and at most --layers)")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend of step 4's layer regions (default inductor: what compile=True "
                         "means; --tiny on a CPU: eager)")
    ap.add_argument("--dtype", default=None, choices=("bfloat16", "float32", "float16"),
                    help="dtype the checkpoint loads in (default bfloat16; --tiny on a CPU: float32, as bf16 matmuls "
                         "are emulated there)")
    ap.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=True,
                    help="step 5: a compiled polestar row with quant=fp8 where the device allows it")
    ap.add_argument("--budget", type=float, default=450.0,
                    help="seconds after which no further row starts (default 450: check.sh allows 480)")
    ap.add_argument("--workdir", default=None, help="where to write the checkpoint (default: a temporary dir)")
    ap.add_argument("--json", dest="json_out", default=None, metavar="OUT.json", help="also write the rows")
    args = ap.parse_args(argv)
    args.layers = args.layers or (2 if args.tiny else 32)
    args.prompt = args.prompt or (8 if args.tiny else 256)
    args.gen = args.gen or (16 if args.tiny else 128)
    args.batches = [int(b) for b in (args.batches or ("1,2" if args.tiny else "1,16")).split(",")]
    args.modes = [m.strip() for m in args.modes.split(",")]
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    args.compile_policies = [p.strip() for p in args.compile_policies.split(",") if p.strip()]
    args.compile_layers = min(args.compile_layers or args.layers, args.layers)
    if args.dtype is None:
        args.dtype = "float32" if args.tiny and torch.device(args.device).type == "cpu" else "bfloat16"
    if args.compile_backend is None:
        args.compile_backend = "eager" if args.tiny and torch.device(args.device).type == "cpu" else "inductor"
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        ap.error(f"--modes takes any of {', '.join(MODES)}, got {bad}")
    unknown = sorted(set(args.policies + args.compile_policies) - set(polestar.policy_names()))
    if unknown:
        ap.error(f"unknown policies {unknown}; known: {', '.join(polestar.policy_names())}")
    if args.gen % 32 and not args.tiny:
        ap.error("--gen must be a multiple of the block length 32")
    return args


def kernel_step_blocker(device: torch.device) -> str | None:
    """Why step 6 (Triton kernels) cannot run here, with what to do about it; None when it can."""
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


def describe_device(device: torch.device) -> str:
    """One line: the device's name, compute capability and HBM figure (CUDA), or its type."""
    if device.type != "cuda":
        return f"# device: {device.type} (no CUDA graphs, no bandwidth bound)"
    major, minor = torch.cuda.get_device_capability(device)
    return (f"# device: {torch.cuda.get_device_name(device)}, sm_{major}{minor}, HBM figure "
            f"{bandwidth(device) / 1e12:.2f} TB/s")


class GraphEvents:
    """Counts, while active, CUDA-graph replays (calls of ``torch.cuda.CUDAGraph.replay``, through which cudagraph
    trees replay a recorded graph), recordings (``CUDAGraph.capture_begin``) and Inductor's cudagraph skips (how
    much ``torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]`` grew, and the messages Inductor logged for
    them, in ``reasons``). Everything is counted from outside the library: torch's classes and functions are
    wrapped for the duration of the block and restored after it."""

    #: modules that import Inductor's skip logger by name (each binding is wrapped)
    SKIP_LOGGER_MODULES = ("torch._inductor.cudagraph_utils", "torch._inductor.cudagraph_trees",
                           "torch._inductor.output_code", "torch._dynamo.backends.cudagraphs")

    def __init__(self):
        self.replays = self.recordings = self.skips = 0
        self.reasons: list[str] = []
        self._undo: list[Callable[[], None]] = []

    def _wrap(self, owner, name: str, make: Callable[[Callable], Callable]) -> None:
        original = getattr(owner, name)
        setattr(owner, name, make(original))
        self._undo.append(lambda: setattr(owner, name, original))

    def __enter__(self) -> GraphEvents:
        from torch._dynamo.utils import counters

        def counting(field: str) -> Callable[[Callable], Callable]:
            def make(original):
                def wrapper(graph, *args, **kwargs):
                    setattr(self, field, getattr(self, field) + 1)
                    return original(graph, *args, **kwargs)
                return wrapper
            return make

        def logging_reason(original):
            def wrapper(msg, *args, **kwargs):
                self.reasons.append(str(msg))
                return original(msg, *args, **kwargs)
            return wrapper

        self._wrap(torch.cuda.CUDAGraph, "replay", counting("replays"))
        self._wrap(torch.cuda.CUDAGraph, "capture_begin", counting("recordings"))
        for name in self.SKIP_LOGGER_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:  # pragma: no cover - a torch without that module
                continue
            if hasattr(module, "log_cudagraph_skip_and_bump_counter"):
                self._wrap(module, "log_cudagraph_skip_and_bump_counter", logging_reason)
        self._counters = counters
        self._skips_before = counters["inductor"]["cudagraph_skips"]
        return self

    def __exit__(self, *exc) -> None:
        self.skips = self._counters["inductor"]["cudagraph_skips"] - self._skips_before
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def load_checkpoint(directory: Path, device: torch.device, dtype: str = "bfloat16") -> tuple[torch.nn.Module, dict]:
    """Load onto ``device`` in ``dtype``; returns the model and the load facts (seconds, weight bytes, peak device
    bytes)."""
    sync = synced(device)
    reset_peak(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    start = time.perf_counter()
    model = polestar.load(directory, dtype=dtype, device=device)
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


def compile_arg(args) -> bool | str:
    """What a compiled row passes as ``compile``: True for inductor (what ``compile=True`` means), else the
    backend's name (the layer regions' backend, :func:`polestar.step.region_backend`)."""
    return True if args.compile_backend == "inductor" else args.compile_backend


def decode_row(model, args, device: torch.device, policy: str, batch: int, mode: str, layers: int,
               **options) -> dict:
    """One warm-up decode (it compiles when ``compiled``; two on CUDA, as cudagraph trees record a graph on its
    second call) and one timed decode of ``policy`` at ``batch``; the row of figures (see :data:`HEADER`), printed.
    Compiled rows count CUDA-graph events (:class:`GraphEvents`): a timed run that records a graph or replays fewer
    graphs than it ran compiled steps is reported. ``mode``: one of :data:`MODES` (an ``eager`` row sets
    ``POLESTAR_EAGER=1`` for its decodes)."""
    compiled = mode == "compiled"
    prompts = torch.randint(0, 126000, (batch, args.prompt), generator=torch.Generator().manual_seed(batch))
    kw = dict(policy=policy, gen_length=args.gen, block_length=min(32, args.gen), steps=args.gen // 2,
              commit="topk", stop_at_eos=False, compile=compile_arg(args) if compiled else False,
              **options)
    eager_env = os.environ.pop("POLESTAR_EAGER", None)
    if mode == "eager":
        os.environ["POLESTAR_EAGER"] = "1"
    try:
        return _decode_row(model, args, device, policy, batch, mode, layers, prompts, kw, options)
    finally:
        os.environ.pop("POLESTAR_EAGER", None)
        if eager_env is not None:
            os.environ["POLESTAR_EAGER"] = eager_env


def _decode_row(model, args, device, policy, batch, mode, layers, prompts, kw, options) -> dict:
    """:func:`decode_row`'s decodes and row, with its environment set."""
    compiled = mode == "compiled"
    graphs = compiled or mode == "graphs"
    with GraphEvents() as warm:
        first = polestar.generate(model, prompts, **kw)
        if graphs and device.type == "cuda":
            # cudagraph trees run a graph's first call without recording it and record it on the second (and an
            # uncompiled phase is captured at its second step): a graph called once per generation is recorded
            # during the second generation
            polestar.generate(model, prompts, **kw)
    reset_peak(device)
    with GraphEvents() as timed:
        out = polestar.generate(model, prompts, **kw)
    s = out.stats
    bw = bandwidth(device)
    bound_ms = 1e3 * s.weight_bytes / s.nfe / bw if bw and s.nfe else None
    ms = 1e3 * s.wall_s / s.nfe
    cuda = device.type == "cuda"
    label = policy + ("+fp8" if options.get("quant") == "fp8" else "")
    row = {"policy": label, "batch": batch, "layers": layers, "mode": mode,
           "ms_per_step": ms, "bound_ms": bound_ms, "x_bound": ms / bound_ms if bound_ms else None,
           "tps": batch * args.gen / s.wall_s, "nfe": s.nfe, "compiled_steps": s.compiled_steps,
           "compile_s": first.stats.compile_s, "peak_gb": peak_memory(device) / 1e9,
           "compile_mode": str(kw["compile"]) if compiled else None,
           "graph_replays": timed.replays if graphs and cuda else None,
           "graph_recordings": timed.recordings if graphs and cuda else None,
           "cudagraph_skips": warm.skips + timed.skips if graphs and cuda else None,
           "skip_reasons": list(dict.fromkeys(warm.reasons + timed.reasons))}

    def show(v, fmt):
        return format(v, fmt) if v is not None else format("n/a", ">" + fmt.rstrip("dfe").split(".")[0])

    print(f"{label:13s} {batch:5d} {layers:6d} {row['mode']:>8s} {ms:8.2f} {show(bound_ms, '7.2f')} "
          f"{show(row['x_bound'], '7.2f')} {row['tps']:8.1f} {s.nfe:4d} {s.compiled_steps:8d} "
          f"{show(row['graph_replays'], '7d')} {show(row['graph_recordings'], '8d')} "
          f"{show(row['cudagraph_skips'], '5d')} {row['peak_gb']:7.2f}", flush=True)
    if graphs and cuda:
        steps = s.compiled_steps if compiled else s.nfe
        verdict = (f"every {mode} step replayed a CUDA graph" if timed.replays >= steps > 0
                   and not row["cudagraph_skips"] and not timed.recordings
                   else f"{timed.replays} graph replays for {steps} {mode} steps")
        how = f" ({row['compile_mode']})" if compiled else ""
        print(f"#   {label} b{batch}: compiled{how} in {first.stats.compile_s:.1f} s; {verdict}", flush=True)
        for reason in row["skip_reasons"][:3]:
            print(f"#   cudagraph skip: {reason.splitlines()[0][:160]}", flush=True)
    return row


def profile_policy(model, args, device: torch.device, policy: str, top: int = 10) -> list[tuple[str, float]]:
    """The ``top`` operations of one eager decode of ``policy`` at the first batch size by self time (device time on
    CUDA, CPU time elsewhere; ``torch.profiler``), printed as ``# profile`` lines; → ``(name, ms)`` pairs."""
    from torch.profiler import ProfilerActivity, profile

    batch = args.batches[0]
    prompts = torch.randint(0, 126000, (batch, args.prompt), generator=torch.Generator().manual_seed(batch))
    kw = dict(policy=policy, gen_length=args.gen, block_length=min(32, args.gen), steps=args.gen // 2,
              commit="topk", stop_at_eos=False)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        out = polestar.generate(model, prompts, **kw)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:top]
    rows = [(e.key, getattr(e, key) / 1e3 / out.stats.nfe) for e in events]
    print(f"# profile {policy} b{batch} ({'device' if cuda else 'CPU'} ms per step, self time):", flush=True)
    for name, ms in rows:
        print(f"#   {ms:9.3f}  {name[:90]}", flush=True)
    return rows


def kernel_rows(args, device: torch.device) -> list[dict]:
    """Milliseconds of each Triton kernel and its torch reference, and their largest difference, on inputs shaped
    as one step of Polestar gives them (the checkpoint's heads and width, the cache's key columns, the window's
    clusters and rows, batch ``args.batches[0]``)."""
    width = TINY_WIDTH if args.tiny else {"d_model": 4096, "n_heads": 32}
    d, heads = width["d_model"], width["n_heads"]
    hd, batch, keys_len = d // heads, args.batches[0], args.prompt + args.gen + 1
    block = min(32, args.gen)
    part = min(2 * block, keys_len)  # the window's prefix part: two blocks
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    q = randn(batch, heads, N_CLUSTERS, hd, dtype=torch.bfloat16)
    keys = randn(batch, heads, keys_len, hd, dtype=torch.bfloat16)
    valid = torch.ones(batch, keys_len, dtype=torch.bool, device=device)
    p = reference_proxy_attention(q, keys, valid, hd ** -0.5)
    p_prev = reference_proxy_attention(q, keys.roll(1, dims=2), valid, hd ** -0.5)
    x, centroids = randn(2 * batch, part, d), randn(2 * batch, 5, d)
    rows = randn(batch, WINDOW_BLOCKS * block + 1, d, dtype=torch.bfloat16)
    packed = reference_nvfp4_quantize(rows, per_row=True)
    update = update_case(batch, heads, hd, d, block, WINDOW_BLOCKS * block, randn, device)
    due = torch.ones(batch, dtype=torch.bool, device=device)
    cases = (
        ("proxy_attention", lambda: proxy_attention(q, keys, valid, hd ** -0.5, backend="triton"),
         lambda: reference_proxy_attention(q, keys, valid, hd ** -0.5)),
        ("kl_drift", lambda: kl_drift(p, p_prev, backend="triton"), lambda: reference_kl_drift(p, p_prev)),
        ("kmeans_assign", lambda: kmeans_assign(x, centroids, backend="triton"),
         lambda: reference_kmeans_assign(x, centroids)),
        ("nvfp4_quantize", lambda: nvfp4_quantize(rows, backend="triton", per_row=True).packed,
         lambda: reference_nvfp4_quantize(rows, per_row=True).packed),
        ("nvfp4_dequantize", lambda: nvfp4_dequantize(packed, backend="triton"),
         lambda: reference_nvfp4_dequantize(packed)),
        ("drift_keep", lambda: drift_keep(p, p_prev.clone(), due, METRICS["kl"], backend="triton"),
         lambda: reference_drift_keep(p, p_prev.clone(), due, METRICS["kl"], DEFAULT_EPS)),
        ("packet_write", lambda: update.packet_write(lambda *a: packet_write(*a, backend="triton")),
         lambda: update.packet_write(reference_packet_write)),
        ("member_rows", lambda: update.member_rows(lambda *a: member_rows(*a, backend="triton")),
         lambda: update.member_rows(reference_member_rows)),
    )
    out = []
    for label, fast, ref in cases:
        diff = (fast().double() - ref().double()).abs().max().item()
        out.append({"kernel": label, "triton_ms": 1e3 * timed(fast, device), "reference_ms": 1e3 * timed(ref, device),
                    "max_abs_diff": diff})
        r = out[-1]
        print(f"{label:17s} triton {r['triton_ms']:8.3f}  torch {r['reference_ms']:8.3f}  "
              f"x{r['reference_ms'] / max(r['triton_ms'], 1e-9):6.2f}  max |diff| {diff:.3g}", flush=True)
    return out


class UpdateCase(NamedTuple):
    """One sparse-update layer's row operations on a window of ``n`` rows (plus the trash row): a packet of ``m``
    distinct rows written into the store with the centroid shift, then ``m`` members' rows joined behind the block's
    rows (half of them packet rows). Each call works on fresh copies of the stores and returns what it wrote and
    gave back, flattened to fp32."""

    store: torch.Tensor
    qstore: torch.Tensor
    centroids: torch.Tensor
    labels: torch.Tensor
    counts: torch.Tensor
    rows: torch.Tensor
    new: torch.Tensor
    q_plan: torch.Tensor
    h: torch.Tensor
    q_packet: torch.Tensor
    row_slot: torch.Tensor

    def packet_write(self, op: Callable) -> torch.Tensor:
        store, centroids = self.store.clone(), self.centroids.clone()
        valid = torch.ones_like(self.rows, dtype=torch.bool)
        op(store, centroids, self.labels, self.counts, self.rows, valid, self.new)
        return torch.cat([store.float().flatten(), centroids.float().flatten()])

    def member_rows(self, op: Callable) -> torch.Tensor:
        members = self.rows.roll(self.rows.shape[1] // 2, dims=1)
        q_att, resid, slots = op(self.qstore.clone(), self.store, self.q_plan, self.h, members, self.row_slot,
                                 self.rows, self.q_packet)
        return torch.cat([q_att.float().flatten(), resid.float().flatten(), slots.float().flatten()])


def update_case(batch: int, heads: int, hd: int, d: int, block: int, n: int, randn, device) -> UpdateCase:
    """An :class:`UpdateCase` at one step's shapes: ``block`` packet rows and members out of ``n`` window rows,
    ``N_CLUSTERS`` clusters, bf16 stores."""
    gen = torch.Generator(device=device).manual_seed(1)
    m = min(block, n)
    labels = torch.randint(0, N_CLUSTERS, (batch, n), generator=gen, device=device)
    counts = torch.nn.functional.one_hot(labels, N_CLUSTERS).sum(1)
    rows = torch.stack([torch.randperm(n, generator=gen, device=device)[:m] for _ in range(batch)])
    bf16 = torch.bfloat16
    return UpdateCase(randn(batch, n + 1, d, dtype=bf16), randn(batch, n + 1, heads * hd, dtype=bf16),
                      randn(batch, N_CLUSTERS, d, dtype=bf16), labels, counts, rows, randn(batch, m, d, dtype=bf16),
                      randn(batch, heads, block, hd, dtype=bf16), randn(batch, block, d, dtype=bf16),
                      randn(batch, heads, m, hd, dtype=bf16), torch.arange(n + 1, device=device))


def kernel_mismatches(rows: list[dict]) -> list[str]:
    """One line per row of step 6 whose kernel is in :data:`EXACT_KERNELS` and differs from its reference."""
    return [f"{r['kernel']}: the Triton kernel and its torch reference differ by up to {r['max_abs_diff']:.3g} "
            "(they must be equal)" for r in rows if r["kernel"] in EXACT_KERNELS and r["max_abs_diff"] != 0]


def timed(fn, device: torch.device, reps: int | None = None) -> float:
    """Mean seconds of ``fn()`` over ``reps`` calls (default 3 on CUDA, 1 elsewhere) after one warm-up."""
    reps = reps or (3 if device.type == "cuda" else 1)
    sync = synced(device)
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - start) / reps


class Budget:
    """Seconds since the check started, against ``limit``: :meth:`allows` says whether a row may still start."""

    def __init__(self, limit: float):
        self.limit, self.start, self.skipped = limit, time.perf_counter(), []

    def elapsed(self) -> float:
        """Seconds since the check started."""
        return time.perf_counter() - self.start

    def allows(self, what: str, reserve: float = 0.0) -> bool:
        """True while ``reserve`` seconds (what ``what`` is expected to take) still fit under the limit; else prints
        and records that ``what`` was skipped."""
        if self.elapsed() + reserve < self.limit:
            return True
        self.skipped.append(what)
        print(f"# skipped {what}: {self.elapsed():.0f} s spent of the {self.limit:.0f} s budget", flush=True)
        return False


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns the exit status (1 when loading broke the memory bound, 2 without CUDA, 3 when a
    kernel of :data:`EXACT_KERNELS` differed from its reference)."""
    args = parse_args(argv)
    budget = Budget(args.budget)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available; run on the GPU machine or pass --tiny --device cpu",
              file=sys.stderr)
        return 2
    print(describe_device(device), flush=True)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # a CPU run is a test of the script: on a shared machine torch's default pool (a thread per core) spins on
        # cores it does not get, and the tiny steps take ten times longer
        torch.set_num_threads(1)
        print("# cpu: 1 intra-op thread (set OMP_NUM_THREADS to choose)", flush=True)
    blocker = kernel_step_blocker(device)
    if blocker is not None:
        print(f"# step 6 (Triton kernels) will be skipped: {blocker}", flush=True)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="polestar-gpu-check-"))
    result: dict = {"device": describe_device(device)[2:],
                    "kernels_skipped": blocker, "policies": [], "kernels": []}
    try:
        start = time.perf_counter()
        width = TINY_WIDTH if args.tiny else None
        directory = write_published_checkpoint(workdir / "llada-8b-shaped", "llada", args.layers, width)
        disk = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
        print(f"# step 1: wrote {args.layers}-layer LLaDA-8B-{'narrow' if args.tiny else 'shaped'} checkpoint, "
              f"{disk / 1e9:.2f} GB, in {time.perf_counter() - start:.1f} s", flush=True)
        model, load = load_checkpoint(directory, device, args.dtype)
        result["load"] = load
        ratio = load["peak_bytes"] / load["weight_bytes"]
        print(f"# load ({args.dtype}): {load['load_s']:.1f} s, weights {load['weight_bytes'] / 1e9:.2f} GB, "
              f"peak device memory {load['peak_bytes'] / 1e9:.2f} GB = {ratio:.3f}x weights (bound {LOAD_BOUND}x)",
              flush=True)
        if device.type == "cuda" and ratio > LOAD_BOUND:
            print(f"error: loading peaked at {ratio:.3f}x the weights, above {LOAD_BOUND}x", file=sys.stderr)
            return 1
        bw = bandwidth(device)
        result["forwards"] = []
        for batch in args.batches:
            ids = torch.randint(0, 126000, (batch, args.prompt + args.gen), device=device)
            t = time_forward(model, ids)
            bound = load["weight_bytes"] / bw if bw else None
            result["forwards"].append({"batch": batch, "forward_ms": 1e3 * t,
                                       "bound_ms": 1e3 * bound if bound else None})
            tail = f"bound {1e3 * bound:.2f} ms ({t / bound:.2f}x)" if bound else "bound n/a (no HBM figure)"
            print(f"# step 2: forward batch {batch}: {1e3 * t:.2f} ms, {tail}", flush=True)
        rows = result["policies"]

        def keep(row: dict) -> None:
            # written after every row, so that the rows done survive check.sh's timeout
            rows.append(row)
            if args.json_out:
                write_atomic(args.json_out, json.dumps(result, indent=1))
        if "eager" in args.modes:
            print(f"\n# step 3: eager, {args.layers} layers (bound: the step's weight bytes / HBM bandwidth)\n{HEADER}")
            row_modes = ["eager"] + (["graphs"] if "graphs" in args.modes and device.type == "cuda" else [])
            if "graphs" in args.modes and device.type != "cuda":
                print("# graphs rows (uncompiled steps replayed as CUDA graphs) run on CUDA only")
            for batch in args.batches:
                for policy in args.policies:
                    for mode in row_modes:
                        if budget.allows(f"{policy} {mode} b{batch}"):
                            keep(decode_row(model, args, device, policy, batch, mode, args.layers))
            if args.profile:
                for policy in args.policies:
                    profile_policy(model, args, device, policy)
        small = model
        if "compiled" in args.modes and args.compile_policies:
            if args.compile_layers != args.layers:
                small = published_model("llada", args.compile_layers, width, dtype=getattr(torch, args.dtype),
                                        device=device)
            print(f"\n# step 4: compiled ({args.compile_backend}) at {args.compile_layers} layers "
                  f"({'fewer than the checkpoint: each graph holds every layer' if small is not model else 'all'}); "
                  f"eager beside it\n{HEADER}")
            for batch in args.batches:
                for policy in args.compile_policies:
                    for compiled in (False, True):
                        what = f"{policy} {'compiled' if compiled else 'eager'} b{batch} ({args.compile_layers} layers)"
                        if budget.allows(what, COMPILE_RESERVE if compiled else 0.0):
                            keep(decode_row(small, args, device, policy, batch,
                                            "compiled" if compiled else "eager", args.compile_layers))
        if "compiled" in args.modes and args.fp8:
            if budget.allows("polestar+fp8 compiled", COMPILE_RESERVE):
                print(f"\n# step 5: quant='fp8' compiled at {args.compile_layers} layers\n{HEADER}")
                keep(decode_row(small, args, device, "polestar", args.batches[0], "compiled", args.compile_layers,
                                quant="fp8"))
        if blocker is None:
            print("\n# step 6: Triton kernels against torch at one step's shapes (ms)")
            result["kernels"] = kernel_rows(args, device)
            result["kernel_mismatches"] = kernel_mismatches(result["kernels"])
        else:
            print(f"\n# step 6: kernels skipped ({blocker})")
        result["skipped"] = budget.skipped
        result["elapsed_s"] = budget.elapsed()
        print(f"\n# done in {budget.elapsed():.0f} s" + (f"; {len(budget.skipped)} rows skipped for the budget"
                                                        if budget.skipped else ""), flush=True)
        if args.json_out:
            write_atomic(args.json_out, json.dumps(result, indent=1))
        mismatches = result.get("kernel_mismatches", [])
        for line in mismatches:
            print(f"error: {line}", file=sys.stderr)
        if mismatches:
            return 3
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
