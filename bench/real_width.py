"""Step cost at real width: ms per step, weight and K/V bytes per step, rows computed per step and layer, of
``fast-dllm``, ``polestar-cache`` and ``polestar`` on an LLaDA-8B-wide model with random weights, each as a ratio
to ``fast-dllm`` measured in the same run.

Random weights make confidences meaningless, so every policy runs with the same commit schedule: LLaDA's top-k
rule (``commit=topk``) with one token per step (steps = generation length, so steps per block = block length),
and the step counts match. With the commit forced, ``polestar`` differs from ``polestar-cache`` only in what its
own commit rule would have asked of the refresh; the row ``polestar (own commit)`` keeps Polestar's commit rule
and so has its own step count.

``python -m polestar.bench.real_width [--json OUT.json]`` runs every cell and prints a markdown table (with a
progress line on stderr before each model is built, before each row and after each of its generations);
``pytest bench/test_bench_real_width.py --benchmark-only`` runs the same cells under pytest-benchmark. The sizes
come from environment variables (defaults in brackets):

* ``POLESTAR_RW_LAYERS`` [2,4], ``POLESTAR_RW_DTYPES`` [float32,bfloat16], ``POLESTAR_RW_BATCHES`` [1,8]
* ``POLESTAR_RW_PROMPT`` [64], ``POLESTAR_RW_GEN`` [256], ``POLESTAR_RW_BLOCK`` [32]
* ``POLESTAR_RW_POLICIES`` [fast-dllm,polestar-cache,polestar,polestar-own-commit] (rows, see :data:`ROWS`)
* ``POLESTAR_RW_DEVICE`` [cuda when available, else cpu], ``POLESTAR_RW_ROUNDS`` [3] measured generations per
  row (each figure then has a spread: the standard deviation over rounds, carried into the ratios),
  ``POLESTAR_RW_WARMUP`` [1 on CUDA, else 0] generations before them
* ``POLESTAR_RW_WIDTH`` [published]: ``tiny`` for a narrow model that checks the code path in seconds per row: d_model
  64 and a 512-token vocabulary (:data:`TINY_MODEL`), and unless set, prompt 16, generation 32 and blocks of 16
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import attrs
import torch

import polestar
from polestar.bench.harness import si
from polestar.models.loading import resolve_dtype
from polestar.models.published import published_model
from polestar.output_files import check_outside_source, write_atomic

ENV_PREFIX = "POLESTAR_RW_"
#: the narrow width of ``POLESTAR_RW_WIDTH=tiny``
TINY_WIDTH = {"d_model": 64, "n_heads": 4, "n_kv_heads": 4, "mlp_hidden_size": 128}
#: the small vocabulary of ``POLESTAR_RW_WIDTH=tiny`` (the LM head of the published 126k vocabulary alone makes a
#: CPU step slow); its special tokens at the top
TINY_VOCAB = {"vocab_size": 512, "embedding_size": 512, "mask_token_id": 511, "eos_token_id": 510,
              "pad_token_id": 510}
#: the model of ``POLESTAR_RW_WIDTH=tiny``
TINY_MODEL = {**TINY_WIDTH, **TINY_VOCAB}
#: the layout of ``POLESTAR_RW_WIDTH=tiny`` unless its variables are set
TINY_LAYOUT = {"PROMPT": "16", "GEN": "32", "BLOCK": "16"}
#: prompts are random ids below this (clear of LLaDA's special tokens, which start at 126080)
PROMPT_VOCAB = 126000
DTYPE_IDS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@attrs.frozen
class Row:
    """One row of the table: ``policy`` with its commit rule forced to one token per step (``forced``) or not."""

    label: str
    policy: str
    forced: bool = True


#: row key (``POLESTAR_RW_POLICIES``) → row
ROWS: dict[str, Row] = {
    "fast-dllm": Row("fast-dllm", "fast-dllm"),
    "polestar-cache": Row("polestar-cache", "polestar-cache"),
    "polestar": Row("polestar", "polestar"),
    "polestar-own-commit": Row("polestar (own commit)", "polestar", forced=False),
}
#: the row every other row is a ratio to
REFERENCE = "fast-dllm"


@attrs.frozen
class Settings:
    """The grid of one run: models (layers × dtypes), batch sizes, sequence layout, rows and timing rounds."""

    layers: tuple[int, ...] = (2, 4)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    batches: tuple[int, ...] = (1, 8)
    prompt: int = 64
    gen: int = 256
    block: int = 32
    rows: tuple[str, ...] = tuple(ROWS)
    device: str = "cpu"
    rounds: int = 3
    warmup: int = 0
    width: dict[str, Any] | None = None  # None: the published width

    def __attrs_post_init__(self):
        unknown = [r for r in self.rows if r not in ROWS]
        if unknown:
            raise ValueError(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
        for dtype in self.dtypes:
            resolve_dtype(dtype)  # raises on an unknown dtype


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def settings_from_env(environ: Mapping[str, str] = os.environ) -> Settings:
    """:class:`Settings` from the ``POLESTAR_RW_*`` variables (see the module docstring)."""
    get = lambda key, default: environ.get(ENV_PREFIX + key, default)  # noqa: E731
    device = get("DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
    width = get("WIDTH", "published")
    if width not in ("published", "tiny"):
        raise ValueError(f"{ENV_PREFIX}WIDTH must be 'published' or 'tiny', got {width!r}")
    layout = TINY_LAYOUT if width == "tiny" else {"PROMPT": "64", "GEN": "256", "BLOCK": "32"}
    return Settings(
        layers=_ints(get("LAYERS", "2,4")), dtypes=_names(get("DTYPES", "float32,bfloat16")),
        batches=_ints(get("BATCHES", "1,8")), prompt=int(get("PROMPT", layout["PROMPT"])),
        gen=int(get("GEN", layout["GEN"])), block=int(get("BLOCK", layout["BLOCK"])),
        rows=_names(get("POLICIES", ",".join(ROWS))), device=device, rounds=int(get("ROUNDS", "3")),
        warmup=int(get("WARMUP", "1" if device.startswith("cuda") else "0")),
        width=TINY_MODEL if width == "tiny" else None,
    )


class Built(NamedTuple):
    """A model of the grid with its layer count and dtype name."""

    model: torch.nn.Module
    layers: int
    dtype: str


def model_id(layers: int, dtype: str) -> str:
    """The test id of a model of the grid, e.g. ``L2-fp32``."""
    return f"L{layers}-{DTYPE_IDS.get(dtype, dtype)}"


def build(settings: Settings, layers: int, dtype: str) -> Built:
    """An LLaDA-8B-wide (or ``settings.width``) model of ``layers`` layers with random weights."""
    model = published_model("llada", layers, settings.width, resolve_dtype(dtype), settings.device)
    return Built(model, layers, dtype)


def free(device: str) -> None:
    """Return freed model memory (after the last reference is dropped)."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def prompts(settings: Settings, batch: int) -> torch.Tensor:
    """``[batch, prompt]`` random token ids below the special tokens, the same for every row of a cell."""
    gen = torch.Generator().manual_seed(batch)
    top = min(PROMPT_VOCAB, (settings.width or {}).get("eos_token_id", PROMPT_VOCAB))
    return torch.randint(0, top, (batch, settings.prompt), generator=gen)


def decoding(settings: Settings, row: Row) -> dict[str, Any]:
    """Keyword arguments of :func:`polestar.generate` for ``row``: greedy, every block decoded (no stop at EOS),
    one token per step under the forced top-k commit."""
    kw = dict(policy=row.policy, gen_length=settings.gen, block_length=settings.block, steps=settings.gen,
              temperature=0.0, stop_at_eos=False)
    if row.forced:
        kw["commit"] = "topk"
    return kw


class StepTimer:
    """``on_step`` observer that records the wall time of each step (waits for the device first)."""

    def __init__(self, device: torch.device):
        self.sync: Callable[[], None] = ((lambda: torch.cuda.synchronize(device)) if device.type == "cuda"
                                         else (lambda: None))
        self.marks: list[float] = []

    def start(self) -> None:
        self.sync()
        self.marks = [time.perf_counter()]

    def __call__(self, _record) -> None:
        self.sync()
        self.marks.append(time.perf_counter())

    @property
    def durations(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def run_row(built: Built, ids: torch.Tensor, settings: Settings, key: str) -> dict[str, Any]:
    """One generation of row ``key``: its step count, ms per step (mean = wall / nfe, and the fastest step) and
    the step-cost counters per step (rows and proxy rows also per layer and sequence)."""
    row = ROWS[key]
    timer = StepTimer(built.model.device)
    timer.start()
    out = polestar.generate(built.model, ids.to(built.model.device), on_step=timer, **decoding(settings, row))
    s, batch = out.stats, ids.shape[0]
    per_step = max(s.nfe, 1)
    return {
        "row": key, "label": row.label, "forced_commit": row.forced, "layers": built.layers, "dtype": built.dtype,
        "batch": batch, "nfe": s.nfe, "wall_s": s.wall_s,
        "ms_per_step_mean": 1e3 * s.wall_s / per_step,
        "ms_per_step_min": 1e3 * min(timer.durations, default=0.0),
        "weight_bytes_per_step": s.weight_bytes / per_step,
        "kv_bytes_per_step": s.kv_bytes / per_step,
        "rows_per_step_layer": s.token_layer_evals / per_step / built.layers / batch,
        "proxy_rows_per_step_layer": s.proxy_query_evals / per_step / built.layers / batch,
    }


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of one row as one result: counters of the first round (decoding is deterministic), mean of the
    mean step times with their standard deviation over the rounds (``ms_per_step_std``, 0 for one round) and
    each round's value (``ms_per_step_rounds``), least of the fastest steps."""
    out = dict(runs[0])
    means = [r["ms_per_step_mean"] for r in runs]
    mean = sum(means) / len(means)
    out["rounds"] = len(runs)
    out["ms_per_step_mean"] = mean
    out["ms_per_step_std"] = (sum((m - mean) ** 2 for m in means) / (len(means) - 1)) ** 0.5 if len(means) > 1 else 0.0
    out["ms_per_step_rounds"] = means
    out["ms_per_step_min"] = min(r["ms_per_step_min"] for r in runs)
    return out


def measure(built: Built, ids: torch.Tensor, settings: Settings, key: str,
            log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Row ``key`` after ``settings.warmup`` generations, over ``settings.rounds`` generations; ``log`` gets a
    line before the first generation and after each (a real-width round takes minutes on a CPU)."""
    say = log or (lambda line: None)
    name = f"{model_id(built.layers, built.dtype)} b{ids.shape[0]} {ROWS[key].label}"
    rounds = max(settings.rounds, 1)
    say(f"{name}: {settings.warmup} warm-up + {rounds} measured generation(s) of {settings.gen} tokens ...")
    for i in range(settings.warmup):
        warm = run_row(built, ids, settings, key)
        say(f"{name}: warm-up {i + 1}/{settings.warmup} done ({warm['ms_per_step_mean']:.1f} ms/step)")
    runs = []
    for i in range(rounds):
        runs.append(run_row(built, ids, settings, key))
        say(f"{name}: round {i + 1}/{rounds} done ({runs[-1]['ms_per_step_mean']:.1f} ms/step)")
    return combine(runs)


#: measured quantities: (result key, table header, formatter)
METRICS: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("ms_per_step_mean", "ms/step", lambda v: f"{v:.1f}" if v >= 100 else f"{v:.2f}"),
    ("ms_per_step_min", "min ms/step", lambda v: f"{v:.1f}" if v >= 100 else f"{v:.2f}"),
    ("weight_bytes_per_step", "weight B/step", si),
    ("kv_bytes_per_step", "K/V B/step", si),
    ("rows_per_step_layer", "rows/step/layer", lambda v: f"{v:.1f}"),
    ("proxy_rows_per_step_layer", "proxy rows/step/layer", lambda v: f"{v:.1f}"),
)


def cell_of(result: dict[str, Any]) -> tuple:
    """The cell (layers, dtype, batch) a result belongs to."""
    return (result["layers"], result["dtype"], result["batch"])


def ratio(value: float, reference: float) -> float | None:
    """``value / reference``, None when the reference is 0 (e.g. fast-dllm's proxy rows)."""
    return value / reference if reference else None


def ratio_std(result: dict[str, Any], reference: dict[str, Any]) -> float | None:
    """The spread of ``ms_per_step_mean_ratio``: the ratio times the root sum of squares of both means' relative
    standard deviations over rounds (first-order propagation); None without a reference mean."""
    a, b = result["ms_per_step_mean"], reference["ms_per_step_mean"]
    if not a or not b:
        return None
    rel = ((result.get("ms_per_step_std", 0.0) / a) ** 2 + (reference.get("ms_per_step_std", 0.0) / b) ** 2) ** 0.5
    return a / b * rel


def with_ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each result with ``<metric>_ratio``: its value over the :data:`REFERENCE` row's of the same cell (None
    without one), and ``ms_per_step_mean_ratio_std``, the step time ratio's spread (:func:`ratio_std`)."""
    refs = {cell_of(r): r for r in results if r["row"] == REFERENCE}
    out = []
    for r in results:
        ref = refs.get(cell_of(r))
        out.append({**r, **{f"{key}_ratio": ratio(r[key], ref[key]) if ref else None for key, _, _ in METRICS},
                    "ms_per_step_mean_ratio_std": ratio_std(r, ref) if ref and ref is not r else None})
    return out


def _cell_text(result: dict[str, Any], key: str, fmt: Callable[[float], str]) -> str:
    r = result.get(f"{key}_ratio")
    value = fmt(result[key])
    if key == "ms_per_step_mean" and result.get("rounds", 1) > 1:
        value += f" ± {fmt(result['ms_per_step_std'])}"
    if r is None:
        return value
    spread = result.get(f"{key}_ratio_std")
    return value + (f" ({r:.2f}±{spread:.2f}×)" if spread is not None and result.get("rounds", 1) > 1
                    else f" ({r:.2f}×)")


def markdown_table(results: list[dict[str, Any]]) -> str:
    """One markdown row per result: cell, row, steps, then each metric with its ratio to fast-dllm's."""
    head = ["layers", "dtype", "batch", "policy", "steps", *(h for _, h, _ in METRICS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        label = r["label"] + ("" if r["forced_commit"] else " †")
        cells = [str(r["layers"]), r["dtype"], str(r["batch"]), label, str(r["nfe"]),
                 *(_cell_text(r, key, fmt) for key, _, fmt in METRICS)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("(×) ratio to fast-dllm in the same cell; ± the standard deviation over the rounds (propagated "
                 "into the ratio); † own commit rule, so its step count may differ (the other rows commit one token "
                 "per step with `commit=topk`).")
    return "\n".join(lines)


def run_cells(settings: Settings, log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every cell of ``settings``: each model built once, every batch and row measured, then freed; results
    with their ratios to fast-dllm. ``log`` gets the progress lines: before and after each build, before each
    row's first generation, after each generation and each row's result."""
    results = []
    say = log or (lambda line: None)
    for layers in settings.layers:
        for dtype in settings.dtypes:
            start = time.perf_counter()
            say(f"{model_id(layers, dtype)}: building the model ({'published' if settings.width is None else 'tiny'} "
                f"width, {layers} layers, random weights, on {settings.device}) ...")
            built = build(settings, layers, dtype)
            say(f"{model_id(layers, dtype)}: built in {time.perf_counter() - start:.1f}s")
            for batch in settings.batches:
                ids = prompts(settings, batch)
                for key in settings.rows:
                    results.append(measure(built, ids, settings, key, log))
                    if log is not None:
                        r = results[-1]
                        log(f"{model_id(layers, dtype)} b{batch} {r['label']}: {r['nfe']} steps, "
                            f"{r['ms_per_step_mean']:.2f} ms/step")
            del built
            free(settings.device)
    return with_ratios(results)


def main(argv: list[str] | None = None) -> int:
    """Run the cells of the ``POLESTAR_RW_*`` settings and print the markdown table (``--json``: also write the
    results)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", dest="json_out", default=None, metavar="OUT.json", help="also write the results")
    args = ap.parse_args(argv)
    try:
        check_outside_source([args.json_out], "--json")
    except ValueError as err:
        ap.error(str(err))
    return run_and_report(settings_from_env(), args.json_out)


def run_and_report(settings: Settings, json_out: str | None = None) -> int:
    """Run the cells of ``settings`` with their progress lines on stderr, print the markdown table on stdout and
    write the results into ``json_out`` when given."""
    results = run_cells(settings, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(markdown_table(results))
    if json_out:
        write_atomic(json_out, json.dumps({"settings": attrs.asdict(settings), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
