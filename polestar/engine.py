"""The block/step decoding loop: plain Python around one step (plan → forward → predict → commit).

The step is fixed-shape (gpt-fast style): the batch and the cache keep their shape for the whole generation; a
finished sequence is frozen through ``DecodeState.active`` (its plan slots are unused and it commits nothing; its
rows still go through the step and count in the run's :class:`RunStats` totals, not in its own
:class:`SequenceStats`). The loop's termination check is the one host read per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from polestar.models.backbone import DiffusionLM

from .config import GenerationConfig
from .policy import Pipeline
from .profiling import scope
from .schedule import transfer_counts
from .state import CommitOrigins, DecodeState, Prediction, StepRecord, UpdatePacket, propose
from .stats import RunStats, SequenceStats
from .step import StepRunner


def predict(logits: torch.Tensor, masked: torch.Tensor, temperature: float, generator: torch.Generator, mask_id: int) -> Prediction:
    """Proposals for the block (see :func:`polestar.state.propose`): ``logits [B, bl, V]``, ``masked [B, bl]`` →
    :class:`Prediction` with ``-inf`` confidence outside ``masked``."""
    tokens, conf = propose(logits, mask_id, temperature, generator)
    return Prediction(tokens, conf.masked_fill(~masked, float("-inf")), logits)


def eos_finished(gen: torch.Tensor, mask_id: int, stop_ids: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose generation ``gen [B, G]`` holds a stop token (EOS, or any id of the LongTensor ``stop_ids [S]``
    on ``gen``'s device, e.g. EOS and end-of-turn) with every earlier position committed. No host sync.

    Returns ``(finished [B] bool, fill [B, G] bool)`` where ``fill`` marks the masked positions after that stop.
    """
    is_eos = gen == stop_ids if isinstance(stop_ids, int) else torch.isin(gen, stop_ids)
    has_eos = is_eos.any(dim=1)
    first = torch.where(has_eos, is_eos.long().argmax(dim=1), gen.shape[1])
    col = torch.arange(gen.shape[1], device=gen.device)[None, :]
    masked = gen == mask_id
    finished = has_eos & ~(masked & (col < first[:, None])).any(dim=1)
    fill = finished[:, None] & masked & (col > first[:, None])
    return finished, fill


def forced_commits(transfer: torch.Tensor, masked: torch.Tensor, confidence: torch.Tensor) -> torch.Tensor:
    """The engine's progress guarantee: in rows with masked positions where the rule chose nothing, the most
    confident masked position. ``transfer, masked [B, bl]`` bool, ``confidence [B, bl]`` → ``[B, bl]`` bool."""
    stalled = masked.any(dim=1) & ~transfer.any(dim=1)
    best = torch.zeros_like(masked).scatter_(1, confidence.argmax(dim=1, keepdim=True), True)
    return stalled[:, None] & best & masked


def own_slots(plan, cache) -> torch.Tensor:
    """The plan slots that hold one of the row's own positions (valid, not left padding): ``[B, C]`` or
    ``[L, B, C]`` bool, like ``plan.valid``. A sequence's own counters count these, so they do not depend on the
    batch it was decoded in."""
    key_valid = cache.key_valid
    if plan.per_layer:
        key_valid = key_valid.expand(plan.index.shape[0], -1, -1)
    return plan.valid & key_valid.gather(-1, plan.index)


def nonfinite_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits [B, bl, V]`` → ``[B]`` bool: rows with a NaN or infinite logit (a broken model or input)."""
    return ~torch.isfinite(logits).all(dim=2).all(dim=1)


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
) -> tuple[torch.Tensor, RunStats]:
    """Generate for left-padded ``prompt_ids [B, P]`` with ``attention_mask [B, P]``.

    ``stop_ids``: tokens that end a sequence (default: the model's EOS); after the first one every later masked
    position is filled with EOS.

    Returns tokens ``[B, P + gen_length]`` and :class:`RunStats`. Each sequence finishes on its own (see
    :class:`GenerationConfig.stop_at_eos`) and is then frozen: no token changes, no compute counted. A sequence
    whose logits turn NaN or infinite stops at that step, commits nothing there, and carries the error in its
    :class:`SequenceStats`; the other sequences are unaffected. ``on_step`` (optional) receives a
    :class:`~polestar.state.StepRecord` after every step (it copies the tokens, so it costs host work).
    """
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
        compile=compile,
    )
    refresh_local, commit_local = refresh.init_state(state), commit.init_state(state)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    failed_at = torch.full((B,), -1, dtype=torch.long, device=device)  # step whose logits were non-finite
    nfe = torch.zeros(B, dtype=torch.long, device=device)
    evals = torch.zeros(B, dtype=torch.long, device=device)
    calls = 0
    weight_bytes = kv_bytes = layer_rows = probe_rows = 0
    bl = config.block_length
    block_cols = torch.arange(bl, device=device)
    runner = StepRunner(compile, device)
    runner.mark_static(cache)
    stops = torch.tensor(stop_ids or (spec.eos_id,), dtype=torch.long, device=device)
    start_time = time.perf_counter()
    for block in range(config.num_blocks):
        state.block_index, state.block_start, state.block_end = block, P + block * bl, P + (block + 1) * bl
        state.step = 0
        state.active = ~finished
        state.num_transfer = transfer_counts(state.block_masked(), config.steps_per_block)
        state.active = ~finished & state.block_masked().any(dim=1)
        state.last_commits = torch.zeros(B, dtype=torch.long, device=device)
        state.packet = None
        refresh.begin_block(refresh_local, state)
        commit.begin_block(commit_local, state)
        while bool(state.active.any()):  # the loop's termination check: the one host read per step
            before = state.x.clone() if on_step is not None else None
            plan = refresh.plan(state, cache, refresh_local)
            hook = refresh.hook(state, plan, cache, model, refresh_local)
            probe = commit.probe(state, plan) or refresh.probe(state, plan)
            target = plan.target_offset + block_cols
            with scope("forward"):  # includes the sparse update riding along it (Polestar's clustering, proxies, stores)
                logits, probs, packet_logits, cost = runner(
                    model, state.x, cache, plan, target[None, :].expand(B, -1), probe, hook)
                refresh.observe(state, plan, probs, cache, refresh_local)
            state.packet = None
            if packet_logits is not None:
                state.packet = UpdatePacket(hook.head_positions, hook.head_valid, packet_logits)
            weight_bytes += cost.weight_bytes
            kv_bytes += cost.kv_bytes
            layer_rows += cost.layer_rows
            probe_rows += cost.probe_rows
            if probs is not None:
                commit.observe_probe(state, probs, commit_local)
            stepped = state.active
            broken = stepped & nonfinite_rows(logits)
            failed_at = torch.where(broken, state.global_step, failed_at)
            finished |= broken
            state.active = stepped & ~broken  # a row with non-finite logits commits nothing from here on
            masked = state.block_masked()
            with scope("commit"):
                pred = predict(logits, masked, config.temperature, generator, spec.mask_id)
                chosen = commit.select(pred, masked, state, commit_local)
                transfer = chosen.commit & masked
            forced = forced_commits(transfer, masked, pred.confidence)
            rule_transfer, transfer = transfer, transfer | forced
            state.last_commits = transfer.sum(dim=1)
            block_x = state.x[:, state.block_start : state.block_end]
            state.x[:, state.block_start : state.block_end] = torch.where(transfer, pred.tokens, block_x)
            extra = commit.suffix(state, commit_local)
            if extra is not None:
                keep = state.x.gather(1, extra.positions)
                state.x.scatter_(1, extra.positions, torch.where(extra.commit, extra.tokens, keep))
            own = own_slots(plan, cache).sum(dim=-1)
            evals += own.sum(dim=0) if plan.per_layer else own * spec.n_layers
            if hook is not None:
                evals += hook.evals
            nfe += stepped.long()
            calls += 1
            if config.stop_at_eos:
                done, fill = eos_finished(state.x[:, P:], spec.mask_id, stops)
                state.x[:, P:] = state.x[:, P:].masked_fill(fill, spec.eos_id)
                finished |= done
            if on_step is not None:
                origins = CommitOrigins(rule_transfer, forced, chosen.early, chosen.gate_candidates, extra)
                on_step(StepRecord(
                    state.global_step, block, state.step, state.block_start, state.block_end, plan, stepped, masked,
                    pred.confidence, before, state.x.clone(), (before == spec.mask_id) & (state.x != spec.mask_id),
                    origins,
                ))
            state.step += 1
            state.global_step += 1
            state.active = ~finished & state.block_masked().any(dim=1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - start_time
    gen = state.x[:, P:]
    tokens = ((gen != spec.eos_id) & (gen != spec.mask_id)).sum(dim=1)
    seqs = tuple(
        SequenceStats(int(n), int(t), int(e), _error_message(int(f)))
        for n, t, e, f in zip(nfe.tolist(), tokens.tolist(), evals.tolist(), failed_at.tolist())
    )
    stats = RunStats(calls, int(tokens.sum()), wall, layer_rows, seqs, weight_bytes=weight_bytes, kv_bytes=kv_bytes,
                     proxy_query_evals=probe_rows)
    return state.x, stats


def _error_message(failed_at: int) -> str | None:
    if failed_at < 0:
        return None
    return (f"non-finite logits (NaN or inf) at decoding step {failed_at}; the sequence was stopped there and its "
            "remaining positions hold the mask token. Check the model weights and dtype (float16 overflows).")
