"""Ahead-of-time compilation of the package's Triton kernels for a GPU target, on a machine without a GPU.

What the decoding step launches is found by running it: :func:`shadow_kernels` makes ``backend="auto"`` pick
Triton on any device and turns every ``*_triton`` wrapper of :mod:`polestar.kernels` into one that *records* the
launches it would make (``kernel[grid](...)``, nothing runs) and returns its ``reference_*`` twin's result (the
package's naming rule: each ``X_triton`` has a ``reference_X`` with the same signature). A CPU decode under it
(:func:`step_launches`) therefore computes the usual tokens while collecting every kernel launch the step would
make on CUDA, with the real arguments. A new kernel called from the step is found the same way; nothing lists
the kernels.

:func:`compile_launch` specialises a recorded launch the way ``JITFunction.run`` does on a GPU (Triton's own
binder: argument dtypes, integers equal to 1 and 16-divisible integers and pointers), compiles it with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` (ptxas ships with Triton) and reads the
cubin's resource usage: registers per thread, spills (local memory / 4 bytes, the figure ``CompiledKernel.n_spills``
reports on a GPU) and the shared memory Triton requests at launch.

Compiling needs the kernels built as ``triton.jit`` functions: under ``TRITON_INTERPRET=1`` (the CPU test-suite)
they are interpreter objects, so :func:`compile_in_subprocess` runs :func:`main` in a child process without that
variable. ``python -m polestar.bench.kernel_aot`` prints the table (``--json`` writes it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import inspect
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import torch

from polestar.kernels import _backend

#: GPU targets checked by default: A100 (sm_80) and H100 / H200 (sm_90)
ARCHS: tuple[int, ...] = (80, 90)


@dataclasses.dataclass
class Launch:
    """One recorded ``kernel[grid](*args, **kwargs)``: the ``@triton.jit`` object, its grid and arguments, and
    ``site``, where it was recorded (the wrapper and the run)."""

    kernel: Any
    grid: Any
    args: tuple
    kwargs: dict
    site: str = ""

    @property
    def name(self) -> str:
        """The kernel's function name (``kl_rows_kernel``)."""
        return self.kernel.fn.__name__

    def key(self) -> tuple:
        """What the compiled code depends on, target aside: the kernel, each argument's dtype (tensors) or
        specialisation class (integers: 1, a multiple of 16, other; floats; bools) and the keyword arguments
        (constexprs and launch options)."""
        return (f"{self.kernel.fn.__module__}.{self.name}", tuple(_arg_class(a) for a in self.args),
                tuple(sorted((k, repr(v)) for k, v in self.kwargs.items())))


def _arg_class(a: Any) -> str:
    if isinstance(a, torch.Tensor):
        return f"*{a.dtype}" + ("" if a.data_ptr() % 16 == 0 else ":unaligned")
    if isinstance(a, bool):
        return f"bool={a}"
    if isinstance(a, int):
        return "1" if a == 1 else "i16" if a % 16 == 0 else "i"
    if isinstance(a, float):
        return "f"
    return type(a).__name__


@contextlib.contextmanager
def recording(site: str = "") -> Iterator[list[Launch]]:
    """Inside the block every Triton launch ``kernel[grid](...)`` is appended to the yielded list instead of run
    (works for ``triton.jit`` functions and for interpreter ones). Outputs the kernels would write stay as
    allocated (``torch.empty``)."""
    from triton.runtime.jit import KernelInterface

    launches: list[Launch] = []
    original = KernelInterface.__getitem__

    def record(kernel, grid):
        return lambda *args, **kwargs: launches.append(Launch(kernel, grid, args, kwargs, site))

    KernelInterface.__getitem__ = record
    try:
        yield launches
    finally:
        KernelInterface.__getitem__ = original


def kernel_modules() -> list[ModuleType]:
    """The public modules of :mod:`polestar.kernels` (those holding the ``*_triton`` wrappers), imported."""
    package = importlib.import_module("polestar.kernels")
    names = [m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_")]
    return [importlib.import_module(f"polestar.kernels.{n}") for n in sorted(names)]


def triton_wrappers() -> dict[str, tuple[Callable, Callable]]:
    """``X_triton`` name → (the wrapper, its ``reference_X`` twin), over :func:`kernel_modules`; ValueError for a
    wrapper without a twin (the naming rule of the package)."""
    pairs: dict[str, tuple[Callable, Callable]] = {}
    for module in kernel_modules():
        for name, fn in vars(module).items():
            if not (name.endswith("_triton") and callable(fn) and fn.__module__ == module.__name__):
                continue
            ref = getattr(module, "reference_" + name.removesuffix("_triton"), None)
            if ref is None:
                raise ValueError(f"{module.__name__}.{name} has no reference_{name.removesuffix('_triton')}")
            pairs[name] = (fn, ref)
    return pairs


@contextlib.contextmanager
def shadow_kernels(results: str = "reference") -> Iterator[list[Launch]]:
    """Inside the block ``backend="auto"`` resolves to Triton on any device and every ``*_triton`` wrapper records
    its launches (into the yielded list; ``site`` is the wrapper's name) and returns its reference's result, so
    a decode on the CPU gives its usual tokens and the list holds every launch the same decode makes on CUDA.
    ``results="zeros"``: the wrappers return their own outputs zero-filled instead (no reference is computed; for
    decodes whose values do not matter, see :func:`cheap_matmuls`)."""
    if results not in ("reference", "zeros"):
        raise ValueError(f"results is 'reference' or 'zeros', got {results!r}")
    launches: list[Launch] = []
    original_resolve = _backend.resolve_backend

    def resolve(backend: str, *tensors: torch.Tensor) -> str:
        return "triton" if backend == "auto" and _backend.HAS_TRITON else original_resolve(backend, *tensors)

    def shadow(name: str, wrapper: Callable, reference: Callable) -> Callable:
        def run(*args, **kwargs):
            with recording(name) as got:
                out = wrapper(*args, **kwargs)
            launches.extend(got)
            return _zeroed(out) if results == "zeros" else reference(*args, **kwargs)

        return run

    swaps = {id(w): shadow(name, w, r) for name, (w, r) in triton_wrappers().items()}
    undo: list[Callable[[], None]] = []

    def swap(table: dict, key: Any, new: Any) -> None:
        old = table[key]
        table[key] = new
        undo.append(lambda: table.__setitem__(key, old))

    for module in [_backend, *kernel_modules()]:
        space = vars(module)
        for name, value in list(space.items()):
            if value is original_resolve:
                swap(space, name, resolve)
            elif id(value) in swaps:
                swap(space, name, swaps[id(value)])
            elif isinstance(value, dict):  # dispatch tables {"reference": fn, "triton": fn, "fused": op}
                wrapper = swaps.get(id(value.get("triton")))
                for key, fn in list(value.items()):
                    if id(fn) in swaps:
                        swap(value, key, swaps[id(fn)])
                    elif key == "fused" and wrapper is not None:  # what "auto" calls: shadowed too
                        swap(value, key, wrapper)
    try:
        yield launches
    finally:
        for restore in reversed(undo):
            restore()


def _zeroed(out: Any) -> Any:
    """``out`` (a tensor, or a tuple / NamedTuple holding tensors) with every tensor zero-filled in place."""
    if isinstance(out, torch.Tensor):
        one_byte_float = out.dtype.is_floating_point and out.element_size() == 1  # float8: zero its bytes
        (out.view(torch.uint8) if one_byte_float else out).zero_()
        return out
    if isinstance(out, tuple):
        return type(out)(*map(_zeroed, out)) if hasattr(out, "_fields") else tuple(map(_zeroed, out))
    return out


def unique(launches: Sequence[Launch]) -> list[Launch]:
    """One launch per :meth:`Launch.key`, first seen first; ``site`` joins the sites that made it."""
    by_key: dict[tuple, Launch] = {}
    for launch in launches:
        key = launch.key()
        if key in by_key:
            kept = by_key[key]
            if launch.site not in kept.site.split(", "):
                kept.site = f"{kept.site}, {launch.site}"
        else:
            by_key[key] = dataclasses.replace(launch)
    return list(by_key.values())


# ----------------------------------------------------------------------------- the decodes whose launches are recorded

#: model name → (family, published checkpoint whose attention geometry it takes, or None for the tiny test model)
MODELS: dict[str, tuple[str, str | None]] = {
    "tiny-llada": ("llada", None),
    "tiny-dream": ("dream", None),
    "llada-8b": ("llada", "llada-8b-instruct"),
    "dream-7b": ("dream", "dream-v0-instruct-7b"),
}


@dataclasses.dataclass(frozen=True)
class StepRun:
    """One ``polestar`` decode whose launches are recorded: ``model`` (a :data:`MODELS` name), batch size, prompt
    and generation length, block length and stage options (``polestar.generate`` overrides)."""

    model: str
    batch: int
    prompt: int
    gen: int
    block: int = 32
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        """``llada-8b b1 T320 quant=nvfp4``: model, batch, key columns of the cache (prompt + generation + the
        trash slot) and options."""
        opts = " ".join(f"{k}={v}" for k, v in self.options)
        return f"{self.model} b{self.batch} T{self.prompt + self.gen + 1} {opts}".rstrip()


def _runs(model: str, batch: int, lengths: Sequence[tuple[int, int]], drifts: Sequence[str]) -> list[StepRun]:
    """At each ``(prompt, gen)`` length the kl drift with NVFP4 row stores; at the first one also each drift of
    ``drifts`` without. Each layer is clustered inside its pass (``cluster_layers_together=False``: the k-means
    kernels' launches of the default route, all layers in one call, differ only in their grid)."""
    gpu = (("cluster_layers_together", False),)
    runs = [StepRun(model, batch, p, g, options=(("quant", "nvfp4"), ("drift", "kl"), *gpu)) for p, g in lengths]
    p0, g0 = lengths[0]
    return runs + [StepRun(model, batch, p0, g0, options=(("drift", d), *gpu)) for d in drifts]


#: tiny models (real weights and values, the policy's own commit rule): two rows of different prompt lengths. The
#: drift kernels read rows of any model alike, so js and cosine run on one family.
TINY_RUNS: tuple[StepRun, ...] = (*_runs("tiny-llada", 2, [(7, 64)], ("js", "cosine")),
                                  *_runs("tiny-dream", 2, [(7, 64)], ()))
#: the published geometries: a prompt of 1,024 (1,089 key columns: the drift kernels' widest block, 2,048) and one of
#: 255 (320 columns, a multiple of 16)
PUBLISHED_RUNS: tuple[StepRun, ...] = (*_runs("llada-8b", 1, [(1024, 64), (255, 64)], ("js", "cosine")),
                                       *_runs("dream-7b", 1, [(1024, 64), (255, 64)], ()))


#: options every run of a model takes: the published geometries decode zeros (:func:`cheap_matmuls`), so they commit
#: on a fixed schedule (8 tokens a step, the last layer refreshing no rows: no commit rule reads its packet)
RUN_DEFAULTS: dict[str, tuple[tuple[str, Any], ...]] = {
    "tiny-llada": (), "tiny-dream": (), "llada-8b": (("commit", "topk"), ("steps", 8)),
    "dream-7b": (("commit", "topk"), ("steps", 8)),
}


def model_for(name: str) -> torch.nn.Module:
    """The bf16 model a :class:`StepRun` decodes with. Tiny models: :func:`polestar.testing.tiny_model`. Published
    ones: the published ``config.json``'s geometry (``d_model``, heads, K/V heads, head dim, RoPE) with 3 layers (the
    middle one takes a sparse update's every operation: the packet written, the members gathered), a
    64-token vocabulary and a 64-wide MLP (neither reaches a Triton kernel), zero weights (they are never read:
    :func:`cheap_matmuls`)."""
    from polestar import testing
    from polestar.models.layers import Rotary
    from polestar.models.loading import FAMILIES, build_on_meta
    from polestar.models.published import published

    family, checkpoint = MODELS[name]
    if checkpoint is None:
        return testing.tiny_model(family).to(torch.bfloat16)
    spec_fn, cls, _ = FAMILIES[family]
    spec = attrs.evolve(spec_fn(published(checkpoint).config), n_layers=3, mlp_hidden=64, vocab_size=64,
                        embedding_size=64, mask_id=63, eos_id=62, pad_id=62)
    model = build_on_meta(cls, spec).to(dtype=torch.bfloat16).to_empty(device="cpu")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in pname or pname.endswith("ln_f.weight")):
                p.fill_(1.0)
            else:
                p.zero_()
    model.rotary = Rotary(spec.head_dim, spec.rope_theta)
    return model.eval()


@contextlib.contextmanager
def cheap_matmuls() -> Iterator[None]:
    """Inside the block ``F.linear`` and ``F.scaled_dot_product_attention`` return zeros of their output's shape
    without computing it: a CPU decode at a published width then takes seconds. Kernel launches depend on shapes
    and dtypes only (the step has no data-dependent shape), so the launches recorded are the real ones."""
    import torch.nn.functional as F

    linear, sdpa = F.linear, F.scaled_dot_product_attention

    def zeros_linear(x, weight, bias=None):
        return x.new_zeros(*x.shape[:-1], weight.shape[0])

    def zeros_attention(q, k, v, *args, **kwargs):
        return q.new_zeros(*q.shape[:-1], v.shape[-1])

    F.linear, F.scaled_dot_product_attention = zeros_linear, zeros_attention
    try:
        yield
    finally:
        F.linear, F.scaled_dot_product_attention = linear, sdpa


def step_launches(run: StepRun, model: torch.nn.Module | None = None) -> list[Launch]:
    """The launches of one ``polestar`` decode (:func:`polestar.generate`, eager, on the CPU) under
    :func:`shadow_kernels`; ``site`` is ``"<run label>: <wrapper>"``. Published geometries run under
    :func:`cheap_matmuls`."""
    import polestar

    model = model_for(run.model) if model is None else model
    gen = torch.Generator().manual_seed(run.batch * 1000 + run.prompt)
    vocab = model.spec.mask_id
    prompts = [torch.randint(0, vocab, (run.prompt - (i % 2),), generator=gen).tolist() for i in range(run.batch)]
    published = MODELS[run.model][1] is not None
    cheap = cheap_matmuls() if published else contextlib.nullcontext()
    with cheap, shadow_kernels("zeros" if published else "reference") as launches:
        polestar.generate(model, prompts, policy="polestar", gen_length=run.gen, block_length=run.block,
                          stop_at_eos=False, **dict(run.options), **dict(RUN_DEFAULTS[run.model]))
    for launch in launches:
        launch.site = f"{run.label}: {launch.site}"
    return launches


#: key columns of the drift calls below: a prompt of 1,024, 64 generated tokens and the trash slot
DRIFT_COLUMNS = 1089

#: wrappers no built-in stage calls, with the arguments a step would give them: ``spec`` (the model's
#: :class:`~polestar.models.spec.ModelSpec`, the published vocabulary for a published geometry), batch, block
#: length → positional arguments. Every other wrapper must be reached by the recorded decodes.
EXTRA_CALLS: dict[str, Callable[[Any, int, int], tuple]] = {
    # a commit rule scoring the entropy of one block of logits over the vocabulary
    "entropy_triton": lambda spec, batch, block: (torch.zeros(batch, block, spec.vocab_size, dtype=torch.bfloat16),),
    # a commit rule scoring the drift of the block's attention rows (the refresh selector's drift is drift_keep):
    # 1,089 key columns, the drift kernels' widest block
    **{f"{name}_drift_triton": lambda spec, batch, block: (
        *(torch.full((batch, spec.n_heads, block, DRIFT_COLUMNS), 1 / DRIFT_COLUMNS) for _ in range(2)),)
       for name in ("kl", "js", "cosine")},
}


def extra_launches(model: str, batch: int = 1, block: int = 32) -> list[Launch]:
    """The launches of :data:`EXTRA_CALLS` at ``model``'s shapes (the published vocabulary for a published
    geometry); ``site`` is ``"<model> b<batch>: <wrapper>"``."""
    from polestar.models.loading import FAMILIES
    from polestar.models.published import published

    family, checkpoint = MODELS[model]
    spec = model_for(model).spec if checkpoint is None else FAMILIES[family][0](published(checkpoint).config)
    wrappers = triton_wrappers()
    launches = []
    for name, make_args in EXTRA_CALLS.items():
        with recording(f"{model} b{batch}: {name}") as got:
            wrappers[name][0](*make_args(spec, batch, block))
        launches += got
    return launches


# ----------------------------------------------------------------------------- compiling


@dataclasses.dataclass
class CompiledKernel:
    """One specialisation of a kernel compiled for ``sm_<arch>``: registers per thread, spilled registers (local
    memory bytes / 4, the figure ``triton.compiler.CompiledKernel.n_spills`` reports on a GPU), shared memory per
    program requested at launch (bytes), warps, the signature, constexprs and arguments specialised as multiples of
    16 (pointers aligned to 16 bytes) that Triton's binder gave, compile seconds (about 0 when Triton's cache had
    it) and the sites that launch it."""

    kernel: str
    arch: int
    n_regs: int
    n_spills: int
    shared: int
    num_warps: int
    signature: dict
    constexprs: dict
    divisible_by_16: list[str]
    compile_s: float
    sites: list[str]


#: the compilation knobs ``JITFunction.run`` adds to a launch's options before binding, across Triton versions
#: (``instrumentation_mode`` in 3.6 to 3.9, ``fpsan_homomorphic_casts`` from 3.9); see :func:`run_knobs`
RUN_KNOBS: tuple[str, ...] = ("instrumentation_mode", "fpsan_homomorphic_casts")


def run_knobs(backend: Any) -> dict[str, Any]:
    """The values of :data:`RUN_KNOBS` (``triton.knobs.compilation``) that ``JITFunction.run`` passes as options
    with this Triton: each knob the installed ``triton.knobs`` has and ``backend``'s options accept (an option it
    does not know would be refused as an unrecognised keyword). The knobs are private and change between versions,
    so one missing on either side is left out rather than read."""
    from triton import knobs

    accepted = backend.parse_options({}).__dict__
    missing = object()
    values = {name: getattr(knobs.compilation, name, missing) for name in RUN_KNOBS if name in accepted}
    return {name: value for name, value in values.items() if value is not missing}


def specialize(launch: Launch, arch: int) -> tuple[dict, dict, dict, dict]:
    """``(signature, constexprs, attrs, options)`` of ``launch`` for ``sm_<arch>``, from Triton's own binder (what
    ``JITFunction.run`` computes before compiling on a GPU). Needs a ``triton.jit`` kernel (not interpreted)."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    if not isinstance(launch.kernel, JITFunction):
        raise TypeError(f"{launch.name} is {type(launch.kernel).__name__}, not a triton.jit function: AOT compiling "
                        "needs the kernels imported without TRITON_INTERPRET=1 (see compile_in_subprocess)")
    kernel = launch.kernel
    backend = make_backend(GPUTarget("cuda", arch, 32))
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs.update(run_knobs(backend))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return signature, constexprs, attrs, options.__dict__


def resource_usage(cubin: bytes) -> dict[str, int]:
    """``REG``, ``STACK``, ``SHARED``, ``LOCAL`` ... of the one function in ``cubin``, read by the ``cuobjdump``
    that ships with Triton (``--dump-resource-usage``)."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", path], check=True,
                             capture_output=True, text=True).stdout
    usage = dict(re.findall(r"\b([A-Z]+(?:\[\d+\])?):(\d+)", out.split("Function", 1)[-1]))
    return {k: int(v) for k, v in usage.items()}


def compile_launch(launch: Launch, arch: int) -> CompiledKernel:
    """Compile ``launch`` for ``sm_<arch>`` with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch,
    32))`` (no GPU needed; kept in Triton's cache directory like any compile) and read its resource usage."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs, options = specialize(launch, arch)
    start = time.perf_counter()
    compiled = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs),
                              target=GPUTarget("cuda", arch, 32), options=options)
    seconds = time.perf_counter() - start
    usage = resource_usage(compiled.kernel)
    names = launch.kernel.arg_names
    return CompiledKernel(
        kernel=launch.name, arch=arch, n_regs=usage["REG"], n_spills=usage["LOCAL"] // 4,
        shared=compiled.metadata.shared, num_warps=compiled.metadata.num_warps,
        signature=signature, constexprs={names[k[0]]: v for k, v in constexprs.items()},
        divisible_by_16=[names[k[0]] for k, v in attrs.items() if ["tt.divisibility", 16] in v],
        compile_s=seconds, sites=launch.site.split(", "),
    )


def compile_all(launches: Sequence[Launch], archs: Sequence[int] = ARCHS) -> list[CompiledKernel]:
    """Every distinct specialisation among ``launches`` (Triton's binder decides what is distinct: the same key
    is one compiled kernel on a GPU) compiled for each arch of ``archs``; ``sites`` lists every site launching it."""
    rows = []
    for arch in archs:
        groups: dict[str, Launch] = {}
        for launch in unique(launches):
            signature, constexprs, attrs, _ = specialize(launch, arch)
            key = repr((launch.kernel.fn.__module__, launch.name, signature, sorted(constexprs.items()),
                        sorted(attrs.items())))
            if key in groups:
                groups[key].site += ", " + launch.site
            else:
                groups[key] = dataclasses.replace(launch)
        for launch in groups.values():
            row = compile_launch(launch, arch)
            row.sites = list(dict.fromkeys(row.sites))
            rows.append(row)
    return rows


def launchable_kernels() -> dict[str, Any]:
    """Every ``@triton.jit`` kernel of the package, that is every jit function of a ``polestar.kernels._*_kernels``
    module that reads ``tl.program_id`` (the others are helpers compiled into the kernels that call them):
    qualified name → function."""
    from triton.runtime.jit import KernelInterface

    package = importlib.import_module("polestar.kernels")
    found = {}
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_") and info.name.endswith("_kernels"):
            module = importlib.import_module(f"polestar.kernels.{info.name}")
            for name, fn in vars(module).items():
                if (isinstance(fn, KernelInterface) and fn.fn.__module__ == module.__name__
                        and "program_id" in inspect.getsource(fn.fn)):
                    found[f"{module.__name__}.{name}"] = fn
    return found


def uncovered(launches: Sequence[Launch]) -> list[str]:
    """The :func:`launchable_kernels` that no launch of ``launches`` runs (qualified names)."""
    launched = {f"{launch.kernel.fn.__module__}.{launch.name}" for launch in launches}
    return sorted(set(launchable_kernels()) - launched)


def record_all(runs: Sequence[StepRun], extra_models: Sequence[str] = ()) -> list[Launch]:
    """The launches of every run (one model built per model name) and of :data:`EXTRA_CALLS` at ``extra_models``."""
    models: dict[str, torch.nn.Module] = {}
    launches: list[Launch] = []
    for run in runs:
        if run.model not in models:
            models[run.model] = model_for(run.model)
        launches += step_launches(run, models[run.model])
    for model in extra_models:
        launches += extra_launches(model)
    return launches


# ----------------------------------------------------------------------------- command line / subprocess

#: ``--runs`` choices: the decodes recorded and the models :data:`EXTRA_CALLS` are made at
RUN_SETS: dict[str, tuple[tuple[StepRun, ...], tuple[str, ...]]] = {
    "tiny": (TINY_RUNS, ("tiny-llada",)),
    "published": (PUBLISHED_RUNS, ("llada-8b",)),
    "all": (TINY_RUNS + PUBLISHED_RUNS, ("tiny-llada", "llada-8b")),
}


def format_rows(rows: Sequence[CompiledKernel]) -> str:
    """The table :func:`main` prints: one line per kernel specialisation and arch."""
    lines = [f"{'kernel':24s} {'sm':>3s} {'regs':>5s} {'spills':>6s} {'shared B':>8s} {'warps':>5s} {'div16':>5s} "
             f"{'compile s':>9s}  constexprs | sites"]
    for r in rows:
        sites = "; ".join(r.sites[:3]) + (f"; +{len(r.sites) - 3} more" if len(r.sites) > 3 else "")
        lines.append(f"{r.kernel:24s} {r.arch:3d} {r.n_regs:5d} {r.n_spills:6d} {r.shared:8d} {r.num_warps:5d} "
                     f"{len(r.divisible_by_16):5d} {r.compile_s:9.2f}  {r.constexprs} | {sites}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Record, compile, print the table (``--json`` also writes the rows, the runs and the kernels no launch
    reached); exit status 1 when a kernel spills or is never launched, 2 under ``TRITON_INTERPRET=1``."""
    ap = argparse.ArgumentParser(description="AOT-compile the Triton kernels the decoding step launches")
    ap.add_argument("--runs", choices=sorted(RUN_SETS), default="all", help="which decodes to record (default all)")
    ap.add_argument("--archs", default=",".join(map(str, ARCHS)), help="comma-separated compute capabilities")
    ap.add_argument("--json", dest="json_out", default=None, metavar="OUT.json")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("error: run without TRITON_INTERPRET=1 (the kernels must be triton.jit functions)", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    runs, extra = RUN_SETS[args.runs]
    start = time.perf_counter()
    launches = record_all(runs, extra)
    recorded_s = time.perf_counter() - start
    rows = compile_all(launches, [int(a) for a in args.archs.split(",")])
    total_s = time.perf_counter() - start
    missing = uncovered(launches)
    print(format_rows(rows))
    print(f"# {len(launches)} launches recorded in {recorded_s:.1f} s; {len(rows)} kernels compiled; "
          f"{total_s:.1f} s in all")
    if missing:
        print(f"# kernels no recorded launch runs: {', '.join(missing)}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({
            "rows": [dataclasses.asdict(r) for r in rows], "uncovered": missing, "runs": [r.label for r in runs],
            "launches": len(launches), "recorded_s": recorded_s, "total_s": total_s,
        }, indent=1, default=str))
    return 1 if missing or any(r.n_spills for r in rows) else 0


def compile_in_subprocess(argv: Sequence[str] = (), timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run :func:`main` with ``argv`` in a child Python without ``TRITON_INTERPRET`` (so the kernels are built as
    ``triton.jit`` functions whatever this process imported); returns the completed process (text output).
    ``TRITON_DEFAULT_FP_FUSION`` is set to Triton 3.9's default (1) unless given, which silences its warning."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return subprocess.run([sys.executable, "-m", __name__, *argv], env=env, capture_output=True, text=True,
                          timeout=timeout)


if __name__ == "__main__":
    sys.exit(main())
