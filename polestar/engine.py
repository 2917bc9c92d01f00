"""The block/step decoding loop: plain Python around one step function (:func:`polestar.step.decode_step`).

The step is fixed-shape (gpt-fast style): the batch and the cache keep their shape for the whole generation; a
finished sequence is frozen through ``DecodeState.active`` (its plan slots are unused and it commits nothing; its
rows still go through the step and count in the run's :class:`RunStats` totals, not in its own
:class:`SequenceStats`). The loop reads one small tensor per step (which blocks still have work), once before the
first step, and once at the end for the counters; nothing else crosses to the host.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs
import torch

from polestar.models.backbone import DiffusionLM

from .config import GenerationConfig
from .policy import Pipeline
from .schedule import transfer_counts
from .state import DecodeState, StepDetail, StepRecord
from .stats import RunStats, SequenceStats
from .step import Generation, StepRunner, Totals, block_work


@torch.inference_mode()
def decode(
    model: DiffusionLM,
    prompt_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    pipeline: Pipeline,
    config: GenerationConfig,
    compile: bool = False,
    stop_ids: tuple[int, ...] | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
    runner: StepRunner | None = None,
) -> tuple[torch.Tensor, RunStats]:
    """Generate for left-padded ``prompt_ids [B, P]`` with ``attention_mask [B, P]``.

    ``stop_ids``: tokens that end a sequence (default: the model's EOS); after the first one every later masked
    position is filled with EOS.

    Returns tokens ``[B, P + gen_length]`` and :class:`RunStats`. Each sequence finishes on its own (see
    :class:`GenerationConfig.stop_at_eos`) and is then frozen: no token changes, no compute counted. A sequence
    whose logits turn NaN or infinite stops at that step, commits nothing there, and carries the error in its
    :class:`SequenceStats`; the other sequences are unaffected. ``on_step`` (optional) receives a
    :class:`~polestar.state.StepRecord` after every step (it copies the tokens, so it costs host work); while it
    is given, the stages gather a :class:`~polestar.state.StepDetail` per step (references to tensors the step
    computes anyway, no host read).
    ``runner`` (optional): a :class:`StepRunner` to run the steps with (its step counters then cover this run).
    """
    gen = start_generation(model, prompt_ids, attention_mask, pipeline, config, stop_ids)
    runner = runner if runner is not None else StepRunner(compile, prompt_ids.device, pipeline)
    runner.mark_static(gen.cache)
    compiled_before = runner.compiled_steps
    meter = _RunMeter()
    start_time = time.perf_counter()
    work = block_work(gen.state.x, gen.totals.finished, gen.state.prompt_len, config.block_length,
                      model.spec.mask_id).tolist()  # which blocks have work: one host read per generation
    block = _next_block(work, -1)
    global_step = 0
    with runner.running():
        while block is not None:
            begin_block(gen, block)
            work, global_step = _run_block(gen, runner, block, global_step, meter, on_step)
            block = _next_block(work, block)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    wall = time.perf_counter() - start_time
    stats = attrs.evolve(finish_stats(gen, meter, global_step, wall), compiled_steps=runner.compiled_steps - compiled_before)
    return gen.state.x, stats


def start_generation(model: DiffusionLM, prompt_ids: torch.Tensor, attention_mask: torch.Tensor, pipeline: Pipeline,
                     config: GenerationConfig, stop_ids: tuple[int, ...] | None = None) -> Generation:
    """Allocate one generation: tokens ``[B, P + G]`` (generation region masked), the cache, each stage's state."""
    spec = model.spec
    device = prompt_ids.device
    B, P = prompt_ids.shape
    G = config.gen_length
    x = torch.full((B, P + G), spec.mask_id, dtype=torch.long, device=device)
    x[:, :P] = prompt_ids
    full_mask = torch.cat([attention_mask.bool(), torch.ones(B, G, dtype=torch.bool, device=device)], dim=1)
    generator = torch.Generator(device=device).manual_seed(config.seed)
    refresh, commit = pipeline.refresh, pipeline.commit
    cache = model.new_cache(full_mask, store_hidden=refresh.needs_hidden)
    state = DecodeState(
        x=x, active=torch.ones(B, dtype=torch.bool, device=device), config=config, mask_id=spec.mask_id,
        eos_id=spec.eos_id, prompt_len=P, logit_shift=spec.logit_shift, n_layers=spec.n_layers, generator=generator,
    )
    stops = torch.tensor(stop_ids or (spec.eos_id,), dtype=torch.long, device=device)
    return Generation(model, pipeline, config, state, cache, refresh.init_state(state), commit.init_state(state),
                      Totals.zeros(B, device), stops, torch.arange(config.block_length, device=device))


def begin_block(gen: Generation, block: int) -> None:
    """Enter block ``block``: its columns, active rows, LLaDA's per-step schedule, and each stage's reset."""
    state, config = gen.state, gen.config
    bl = config.block_length
    state.block_index, state.block_start, state.block_end = block, state.prompt_len + block * bl, \
        state.prompt_len + (block + 1) * bl
    state.step = 0
    state.active = ~gen.totals.finished
    state.num_transfer = transfer_counts(state.block_masked(), config.steps_per_block)
    state.active = ~gen.totals.finished & state.block_masked_any()
    state.last_commits = torch.zeros(state.batch_size, dtype=torch.long, device=state.x.device)
    state.packet = None
    state.refresh_flags = ()
    gen.pipeline.refresh.begin_block(gen.refresh_local, state)
    gen.pipeline.commit.begin_block(gen.commit_local, state)
    gen.pipeline.refresh.allocate(gen.refresh_local, state, gen.cache, gen.model)


def _run_block(gen: Generation, runner: StepRunner, block: int, global_step: int, meter: _RunMeter,
               on_step: Callable[[StepRecord], None] | None) -> tuple[list[bool], int]:
    """Step block ``block`` until its work flag clears → the last "work left" flags and the next global step."""
    num_blocks = gen.config.num_blocks
    step = 0
    while True:
        before = gen.state.x.clone() if on_step is not None else None
        gen.state.detail = StepDetail() if on_step is not None else None
        out = runner(gen, block, gen.state.block_start, gen.state.block_end, step, global_step)
        meter.add(out.cost)
        read = out.work.tolist()  # the loop's termination check: the one host read per step
        work, gen.state.refresh_flags = read[:num_blocks], tuple(read[num_blocks:])
        if on_step is not None:
            on_step(_record(gen, out, block, step, global_step, before))
        step += 1
        global_step += 1
        if not work[block]:
            return work, global_step


def _next_block(work: list[bool], after: int) -> int | None:
    return next((j for j in range(after + 1, len(work)) if work[j]), None)


class _RunMeter:
    """Sums the per-step :class:`~polestar.models.cost.StepCost` (plain ints) of a run."""

    def __init__(self) -> None:
        self.weight_bytes = self.kv_bytes = self.layer_rows = self.probe_rows = 0

    def add(self, cost) -> None:
        self.weight_bytes += cost.weight_bytes
        self.kv_bytes += cost.kv_bytes
        self.layer_rows += cost.layer_rows
        self.probe_rows += cost.probe_rows


def finish_stats(gen: Generation, meter: _RunMeter, calls: int, wall: float) -> RunStats:
    """The run's :class:`RunStats` (one host read for every per-sequence counter)."""
    spec, totals = gen.model.spec, gen.totals
    out = gen.state.x[:, gen.state.prompt_len :]
    tokens = ((out != spec.eos_id) & (out != spec.mask_id)).sum(dim=1)
    rows = torch.stack([totals.nfe, tokens, totals.evals, totals.failed_at], dim=1).tolist()
    seqs = tuple(SequenceStats(n, t, e, _error_message(f)) for n, t, e, f in rows)
    return RunStats(calls, sum(r[1] for r in rows), wall, meter.layer_rows, seqs, weight_bytes=meter.weight_bytes,
                    kv_bytes=meter.kv_bytes, proxy_query_evals=meter.probe_rows)


def _record(gen: Generation, out, block: int, step: int, global_step: int, before: torch.Tensor) -> StepRecord:
    state, mask_id = gen.state, gen.model.spec.mask_id
    after = state.x.clone()
    return StepRecord(global_step, block, step, state.block_start, state.block_end, out.plan, out.stepped, out.masked,
                      out.confidence, before, after, (before == mask_id) & (after != mask_id), out.origins, out.cost,
                      state.detail)


def _error_message(failed_at: int) -> str | None:
    if failed_at < 0:
        return None
    return (f"non-finite logits (NaN or inf) at decoding step {failed_at}; the sequence was stopped there and its "
            "remaining positions hold the mask token. Check the model weights and dtype (float16 overflows).")
