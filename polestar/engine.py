"""The block/step decoding loop: plain Python around one step function (:func:`polestar.step.decode_step`).

The step is fixed-shape (gpt-fast style): the batch and the cache keep their shape for the whole generation; a
finished sequence is frozen through ``DecodeState.active`` (its plan slots are unused and it commits nothing; its
rows still go through the step and count in the run's :class:`RunStats` totals, not in its own
:class:`SequenceStats`). The loop reads one small tensor per step (which blocks still have work), once before the
first step, and once at the end for the counters; nothing else crosses to the host.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import attrs
import torch

from polestar.models.backbone import DiffusionLM

from .config import GenerationConfig
from .policy import Pipeline
from .schedule import transfer_counts
from .state import DecodeState, StepClock, StepDetail, StepPhase, StepPosition, StepRandom, StepRecord
from .stats import RunStats, SequenceStats
from .step import Generation, StepInputs, StepRunner, Totals


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

    Returns tokens ``[B, P + gen_length]`` (a copy: the generation's buffers go back to the pool for the next
    generation of the same shape) and :class:`RunStats`. Each sequence finishes on its own (see
    :class:`GenerationConfig.stop_at_eos`) and is then frozen: no token changes, no compute counted. A sequence
    whose logits turn NaN or infinite stops at that step, commits nothing there, and carries the error in its
    :class:`SequenceStats`; the other sequences are unaffected. ``on_step`` (optional) receives a
    :class:`~polestar.state.StepRecord` after every step: copies of what the step computed (host work, and one more
    graph per step variant while it records); the stages gather a :class:`~polestar.state.StepDetail` per step.
    ``runner`` (optional): a :class:`StepRunner` to run the steps with (its step counters then cover this run).
    """
    model.ensure_fused()  # host-side: parameters replaced by hand since the last decode are fused again
    gen = acquire_generation(model, prompt_ids, attention_mask, pipeline, config, stop_ids)
    try:
        runner = runner if runner is not None else StepRunner(compile, prompt_ids.device, pipeline)
        compiled_before = runner.compiled_steps
        meter = _RunMeter()
        start_time = time.perf_counter()
        work = gen.state.schedule.work(gen.state, gen.totals.finished).tolist()  # one host read per generation
        block = _next_block(work, -1)
        global_step = 0
        with runner.running():
            while block is not None:
                begin_block(gen, block, global_step)
                runner.begin_block(gen)  # a block may allocate buffers (a new window size): marked before use
                work, global_step = _run_block(gen, runner, block, global_step, meter, on_step)
                block = _next_block(work, block)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        wall = time.perf_counter() - start_time
        stats = attrs.evolve(finish_stats(gen, meter, global_step, wall),
                             compiled_steps=runner.compiled_steps - compiled_before)
        tokens = gen.state.x.clone()
    finally:
        release_generation(gen)
    return tokens, stats


def _pool_key(model: DiffusionLM, pipeline: Pipeline, prompt_ids: torch.Tensor, config: GenerationConfig,
              stop_ids: tuple[int, ...] | None) -> tuple:
    """What fixes a generation's buffers: the model's dtype (its cache's; a model cast between two generations gets
    new buffers), the stage composition, the batch, the prompt and generation lengths, the decoding settings (the
    seed aside) and the stop ids."""
    return (model.dtype, repr(sorted(pipeline.describe().items())), tuple(prompt_ids.shape), prompt_ids.device,
            attrs.evolve(config, seed=0), stop_ids)


#: free generations per model, by :func:`_pool_key`; at most :data:`POOL_SIZE` shapes are kept per model
_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
POOL_SIZE = 4


def acquire_generation(model: DiffusionLM, prompt_ids: torch.Tensor, attention_mask: torch.Tensor,
                       pipeline: Pipeline, config: GenerationConfig,
                       stop_ids: tuple[int, ...] | None = None) -> Generation:
    """A generation's buffers for these prompts: the ones a finished generation of the same shape gave back
    (:func:`release_generation`), reset in place for the new prompts, so a compiled step's CUDA graphs replay on
    the same addresses; else new ones (:func:`start_generation`). A generation in use is never handed out twice,
    so one pipeline can decode several generations at once."""
    key = _pool_key(model, pipeline, prompt_ids, config, stop_ids)
    free = _POOLS.setdefault(model, {}).get(key)
    if not free:
        gen = start_generation(model, prompt_ids, attention_mask, pipeline, config, stop_ids)
    else:
        gen = free.pop()
        reset_generation(gen, prompt_ids, attention_mask, config)
    gen.pool_key = key
    return gen


def release_generation(gen: Generation) -> None:
    """Give ``gen``'s buffers back for the next generation of the same shape (the most recent shapes are kept)."""
    pool = _POOLS.setdefault(gen.model, {})
    key = getattr(gen, "pool_key", None)
    if key is None:
        return
    pool.pop(key, None)
    pool[key] = [gen]  # one free generation per shape; re-inserted as the most recent
    while len(pool) > POOL_SIZE:
        pool.pop(next(iter(pool)))


def start_generation(model: DiffusionLM, prompt_ids: torch.Tensor, attention_mask: torch.Tensor, pipeline: Pipeline,
                     config: GenerationConfig, stop_ids: tuple[int, ...] | None = None) -> Generation:
    """Allocate one generation: tokens ``[B, P + G]`` (generation region masked), the cache, the random buffers,
    the step clock, the counters and each stage's state."""
    spec = model.spec
    device = prompt_ids.device
    B, P = prompt_ids.shape
    G = config.gen_length
    x = torch.full((B, P + G), spec.mask_id, dtype=torch.long, device=device)
    x[:, :P] = prompt_ids
    full_mask = _full_mask(attention_mask, G)
    # the meta device has no generator: a meta run (shapes only) draws its random numbers on the CPU
    generator = torch.Generator(device="cpu" if device.type == "meta" else device).manual_seed(config.seed)
    refresh, commit = pipeline.refresh, pipeline.commit
    cache = model.new_cache(full_mask, store_hidden=refresh.needs_hidden)
    schedule = refresh.region()
    bl = schedule.width(config)
    gumbel = (torch.zeros((B, bl, spec.vocab_size), dtype=torch.float64, device=device)
              if config.temperature > 0 else None)
    remask = torch.zeros((B, bl), dtype=torch.float64, device=device) if commit.needs_random else None
    state = DecodeState(
        x=x, active=torch.ones(B, dtype=torch.bool, device=device), config=config, mask_id=spec.mask_id,
        eos_id=spec.eos_id, prompt_len=P, logit_shift=spec.logit_shift, n_layers=spec.n_layers, generator=generator,
        clock=StepClock.at(P, device), n_heads=spec.n_heads, vocab_size=spec.vocab_size,
        num_transfer=torch.zeros((B, config.steps_per_block), dtype=torch.long, device=device),
        random=StepRandom(gumbel, remask), schedule=schedule,
    )
    stops = torch.tensor(stop_ids or (spec.eos_id,), dtype=torch.long, device=device)
    inputs = StepInputs(state, cache, refresh.init_state(state), commit.init_state(state), Totals.zeros(B, device),
                        stops, config)
    gen = Generation(model, pipeline, inputs)
    refresh.begin_generation(gen.refresh_local, state, cache, model)
    commit.begin_generation(gen.commit_local, state, cache, model)
    return gen


def _full_mask(attention_mask: torch.Tensor, gen_length: int) -> torch.Tensor:
    B = attention_mask.shape[0]
    gen = torch.ones(B, gen_length, dtype=torch.bool, device=attention_mask.device)
    return torch.cat([attention_mask.bool(), gen], dim=1)


def reset_generation(gen: Generation, prompt_ids: torch.Tensor, attention_mask: torch.Tensor,
                     config: GenerationConfig) -> None:
    """Reset a pooled generation in place for new prompts of the same shape: tokens, cache (validity, positions,
    zeroed K/V and stored inputs), counters, clock, the generator's seed and each stage's state."""
    state, cache, P = gen.state, gen.cache, prompt_ids.shape[1]
    gen.config = state.config = config
    state.x.fill_(gen.model.spec.mask_id)
    state.x[:, :P].copy_(prompt_ids)
    state.active.fill_(True)
    state.last_commits.zero_()
    state.clock.block_start.fill_(P)
    state.clock.step.zero_()
    state.clock.global_step.zero_()
    state.horizon.fill_(state.length)
    state.generator.manual_seed(config.seed)
    state.detail = None
    cache.reset(_full_mask(attention_mask, config.gen_length))
    gen.totals.reset()
    refresh, commit = gen.pipeline.refresh, gen.pipeline.commit
    refresh.begin_generation(gen.refresh_local, state, gen.cache, gen.model)
    commit.begin_generation(gen.commit_local, state, gen.cache, gen.model)


def begin_block(gen: Generation, block: int, global_step: int = 0) -> None:
    """Enter block ``block`` (on the host, in place): its first column and the step counter, its active rows, LLaDA's
    per-step schedule, and each stage's reset and buffers."""
    state, config = gen.state, gen.config
    position = _position(gen, block, 0, global_step)
    state.clock.block_start.fill_(position.block_start)
    state.clock.step.zero_()
    state.schedule.begin_block(state)
    state.active.copy_(~gen.totals.finished)
    state.num_transfer.copy_(transfer_counts(state.block_masked(), config.steps_per_block))
    state.active.copy_(~gen.totals.finished & state.block_masked_any())
    state.last_commits.zero_()
    gen.pipeline.refresh.begin_block(gen.refresh_local, state)
    gen.pipeline.commit.begin_block(gen.commit_local, state)
    gen.pipeline.refresh.allocate(gen.refresh_local, state, gen.cache, gen.model, position)


def _position(gen: Generation, block: int, step: int, global_step: int, flags: tuple[bool, ...] = ()) -> StepPosition:
    bl, P = gen.state.schedule.span(gen.config), gen.state.prompt_len
    return StepPosition(block, P + block * bl, P + (block + 1) * bl, step, global_step, flags)


def step_phase(gen: Generation, position: StepPosition) -> StepPhase:
    """The stages' :class:`~polestar.state.StepPhase` for a step at ``position``."""
    pipeline = gen.pipeline
    return StepPhase(pipeline.refresh.phase(position, gen.state, gen.refresh_local),
                     pipeline.commit.phase(position, gen.state, gen.commit_local))


def _run_block(gen: Generation, runner: StepRunner, block: int, global_step: int, meter: _RunMeter,
               on_step: Callable[[StepRecord], None] | None) -> tuple[list[bool], int]:
    """Step block ``block`` until its work flag clears → the last "work left" flags and the next global step."""
    num_blocks = gen.config.gen_length // gen.state.schedule.span(gen.config)
    step = 0
    flags: tuple[bool, ...] = ()
    while True:
        position = _position(gen, block, step, global_step, flags)
        before = gen.state.x.clone() if on_step is not None else None
        gen.state.detail = StepDetail() if on_step is not None else None
        out = runner(gen, step_phase(gen, position))
        meter.add(out.cost)
        read = out.work.tolist()  # the loop's termination check: the one host read per step
        work, flags = read[:num_blocks], tuple(read[num_blocks:])
        if on_step is not None:
            on_step(_record(gen, out, position, before))
            gen.state.detail = None
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
    rows = torch.stack([totals.nfe, tokens, totals.evals, totals.failed_at, totals.revoked], dim=1).tolist()
    seqs = tuple(SequenceStats(n, t, e, _error_message(f), r) for n, t, e, f, r in rows)
    return RunStats(calls, sum(r[1] for r in rows), wall, meter.layer_rows, seqs, weight_bytes=meter.weight_bytes,
                    kv_bytes=meter.kv_bytes, proxy_query_evals=meter.probe_rows, revoked=sum(r[4] for r in rows))


def _record(gen: Generation, out, position: StepPosition, before: torch.Tensor) -> StepRecord:
    """The observer's :class:`StepRecord`, made of copies: nothing in it is a tensor the step returned, so an
    observer may keep it while later steps (or CUDA-graph replays) overwrite those."""
    state, mask_id = gen.state, gen.model.spec.mask_id
    after = state.x.clone()
    view, detail = _copies(out.view), _copies(state.detail)
    return StepRecord(position.global_step, position.block_index, position.step, position.block_start,
                      position.block_end, view.plan, view.stepped, view.masked, view.confidence, before, after,
                      (before == mask_id) & (after != mask_id), view.origins, out.cost, detail, view.region,
                      view.held)


def _copies(obj):
    """``obj`` with every tensor in it (NamedTuples, tuples, lists, dicts, attrs classes) replaced by a copy."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_copies(v) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_copies(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _copies(v) for k, v in obj.items()}
    if attrs.has(type(obj)):
        return attrs.evolve(obj, **{f.name: _copies(getattr(obj, f.name)) for f in attrs.fields(type(obj))
                                    if f.init})
    return obj


def _error_message(failed_at: int) -> str | None:
    if failed_at < 0:
        return None
    return (f"non-finite logits (NaN or inf) at decoding step {failed_at}; the sequence was stopped there and its "
            "remaining positions hold the mask token. Check the model weights and dtype (float16 overflows).")
