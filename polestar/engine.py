"""The block/step decoding loop: plain Python around one step (plan → forward → predict → commit)."""

from __future__ import annotations

import time

import torch

from polestar.models.backbone import DiffusionLM
from polestar.policies.commit_basic import transfer_counts

from .config import GenerationConfig
from .policy import Pipeline
from .profiling import scope
from .state import DecodeState, Prediction, propose
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


@torch.inference_mode()
def decode(
    model: DiffusionLM,
    prompt_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    pipeline: Pipeline,
    config: GenerationConfig,
    compile: bool = False,
    stop_ids: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, RunStats]:
    """Generate for left-padded ``prompt_ids [B, P]`` with ``attention_mask [B, P]``.

    ``stop_ids``: tokens that end a sequence (default: the model's EOS); after the first one every later masked
    position is filled with EOS.

    Returns tokens ``[B, P + gen_length]`` and :class:`RunStats`. Each sequence finishes on its own (see
    :class:`GenerationConfig.stop_at_eos`); finished sequences are dropped from the working batch at the next block
    boundary and frozen (no compute counted) until then.
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
    result = x.clone()
    rows = torch.arange(B, device=device)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    nfe = torch.zeros(B, dtype=torch.long, device=device)
    evals = torch.zeros(B, dtype=torch.long, device=device)
    calls = 0
    bl = config.block_length
    block_cols = torch.arange(bl, device=device)
    runner = StepRunner(compile, device)
    runner.mark_static(cache)
    stops = torch.tensor(stop_ids or (spec.eos_id,), dtype=torch.long, device=device)
    start_time = time.perf_counter()
    for block in range(config.num_blocks):
        if bool(finished.any()):
            result[rows[finished]] = state.x[finished]
            keep = (~finished).nonzero().squeeze(1)
            rows, finished = rows[keep], finished[keep]
            state.select_rows(keep)
            cache.select_rows(keep)
            if rows.numel() == 0:
                break
        state.block_index, state.block_start, state.block_end = block, P + block * bl, P + (block + 1) * bl
        state.step = 0
        state.active = ~finished
        state.num_transfer = transfer_counts(state.block_masked(), config.steps_per_block)
        state.active = ~finished & state.block_masked().any(dim=1)
        while bool(state.active.any()):
            plan = refresh.plan(state, cache)
            hook = refresh.hook(state, plan, cache, model)
            probe = commit.probe(state, plan) or refresh.probe(state, plan)
            target = plan.target_offset + block_cols
            with scope("forward"):  # includes the selector's post-forward work (Polestar's block-start clustering)
                logits, probs = runner(model, state.x, cache, plan, target[None, :].expand(state.batch_size, -1), probe, hook)
                refresh.observe(state, plan, probs, cache)
            if probs is not None:
                commit.observe_probe(state, probs)
            masked = state.block_masked()
            with scope("commit"):
                pred = predict(logits, masked, config.temperature, generator, spec.mask_id)
                transfer = commit.select(pred, masked, state) & masked
            stalled = masked.any(dim=1) & ~transfer.any(dim=1)
            best = torch.zeros_like(masked).scatter_(1, pred.confidence.argmax(dim=1, keepdim=True), True)
            transfer |= stalled[:, None] & best & masked
            state.extras["last_commits"] = transfer.sum(dim=1)
            block_x = state.x[:, state.block_start : state.block_end]
            state.x[:, state.block_start : state.block_end] = torch.where(transfer, pred.tokens, block_x)
            extra = commit.suffix(state)
            if extra is not None:
                positions, tokens, take = extra
                state.x.scatter_(1, positions, torch.where(take, tokens, state.x.gather(1, positions)))
            layers_valid = plan.valid.sum(dim=-1)
            evals[rows] += layers_valid.sum(dim=0) if plan.per_layer else layers_valid * spec.n_layers
            if hook is not None:
                evals[rows] += hook.evals
            nfe[rows] += state.active.long()
            calls += 1
            if config.stop_at_eos:
                done, fill = eos_finished(state.x[:, P:], spec.mask_id, stops)
                state.x[:, P:] = state.x[:, P:].masked_fill(fill, spec.eos_id)
                finished |= done
            state.step += 1
            state.global_step += 1
            state.active = ~finished & state.block_masked().any(dim=1)
    result[rows] = state.x
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - start_time
    gen = result[:, P:]
    tokens = ((gen != spec.eos_id) & (gen != spec.mask_id)).sum(dim=1)
    seqs = tuple(
        SequenceStats(int(n), int(t), int(e)) for n, t, e in zip(nfe.tolist(), tokens.tolist(), evals.tolist())
    )
    stats = RunStats(calls, int(tokens.sum()), wall, int(evals.sum()), seqs)
    return result, stats
