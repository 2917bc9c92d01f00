"""Public entry points: ``polestar.load`` and ``polestar.generate``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from polestar.models.backbone import DiffusionLM
from polestar.models.loading import load_model

from .config import GenerationConfig
from .engine import decode
from .policy import Pipeline, assemble
from .state import StepRecord
from .stats import RunStats


def load(path: str | Path, dtype: torch.dtype | str | None = torch.float32, device: str | torch.device = "cpu") -> DiffusionLM:
    """Load an LLaDA or Dream checkpoint: a Hugging Face-format directory or a shipped name (``"tiny-llada"``).

    ``dtype``: float32, bfloat16 or float16. Weights come from safetensors only; ``tokenizer.json`` is attached as
    ``model.tokenizer`` when present.
    """
    return load_model(path, dtype=dtype, device=device)


@attrs.frozen
class GenerationOutput:
    """Result of :func:`generate`.

    ``tokens``: LongTensor ``[B, prompt_len + gen_length]`` (prompts right-aligned, left padding with the pad id);
    ``texts``: decoded generations (up to the first EOS) when the checkpoint has a tokenizer, else None;
    ``stats``: :class:`~polestar.stats.RunStats`; ``prompt_len``: column where generation starts;
    ``pipeline``: the assembled stages and their options.
    """

    tokens: torch.Tensor
    texts: list[str] | None
    stats: RunStats
    prompt_len: int
    pipeline: Pipeline

    @property
    def generations(self) -> torch.Tensor:
        """``[B, gen_length]`` generated tokens."""
        return self.tokens[:, self.prompt_len :]

    @property
    def errors(self) -> list[str | None]:
        """Per sequence: why it stopped early (non-finite logits), None when it decoded normally."""
        return [seq.error for seq in self.stats.sequences]


def encode_prompts(model: DiffusionLM, prompts: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts (strings, token-id lists or a LongTensor ``[B, L]``) → left-padded ids ``[B, P]`` and mask ``[B, P]``."""
    spec = model.spec
    if isinstance(prompts, str):
        prompts = [prompts]
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() == 1:
            prompts = prompts[None]
        if prompts.dim() != 2 or prompts.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"prompt tensor must be an integer tensor [B, L], got {prompts.dtype} {tuple(prompts.shape)}")
        rows = [list(map(int, r)) for r in prompts.tolist()]
    elif isinstance(prompts, Sequence):
        if len(prompts) == 0:
            raise ValueError("empty batch: pass at least one prompt")
        if all(isinstance(p, str) for p in prompts):
            tok = getattr(model, "tokenizer", None)
            if tok is None:
                raise ValueError("string prompts need a checkpoint with tokenizer.json; pass token ids instead")
            rows = [tok.encode(p).ids for p in prompts]
        elif all(isinstance(p, Sequence) and not isinstance(p, str) for p in prompts):
            rows = [list(map(int, p)) for p in prompts]
        else:
            raise ValueError("prompts must be all strings or all token-id lists")
    else:
        raise ValueError(f"prompts must be strings, token-id lists or a LongTensor, got {type(prompts).__name__}")
    if len(rows) == 0:
        raise ValueError("empty batch: pass at least one prompt")
    for i, r in enumerate(rows):
        if len(r) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        bad = [t for t in r if not 0 <= t < spec.embedding_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {spec.embedding_size}): {bad[:5]}")
    P = max(len(r) for r in rows)
    ids = torch.full((len(rows), P), spec.pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), P, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, P - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, P - len(r) :] = True
    return ids.to(model.device), mask.to(model.device)


def generate(
    model: DiffusionLM,
    prompts: Any,
    policy: str | Pipeline = "fast-dllm",
    gen_length: int = 256,
    block_length: int = 32,
    steps: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    threshold: float | None = None,
    stop_at_eos: bool = True,
    compile: bool = False,
    on_step: Callable[[StepRecord], None] | None = None,
    **overrides: Any,
) -> GenerationOutput:
    """Decode ``prompts`` with ``policy``: a registered policy name (see ``polestar policies``) or a
    :class:`~polestar.policy.Pipeline` already built by :func:`polestar.assemble` (then without overrides).

    ``overrides`` set stage options (``threshold=0.8``, ``commit.threshold=0.8``) or swap stages
    (``refresh="prefix"``); every value is validated before any work starts. ``threshold`` is the confidence
    threshold of the threshold-based commit rules; policies without one (``baseline``) ignore it, so one call
    can sweep every policy. ``compile=True`` runs each step's forward through ``torch.compile`` (CUDA graphs on
    CUDA); tokens are the same as eager. ``on_step`` receives a :class:`~polestar.state.StepRecord` after every
    step (for tests and diagnostics such as ``polestar anatomy``).
    """
    config = GenerationConfig(gen_length, block_length, steps, temperature, seed, stop_at_eos)
    if isinstance(policy, Pipeline):
        if overrides or threshold is not None:
            raise ValueError("stage options and threshold apply to a policy name; for an assembled Pipeline pass "
                             "them to polestar.assemble instead")
        pipeline = policy
    else:
        if threshold is not None:
            overrides.setdefault("threshold?", threshold)
        pipeline = assemble(policy, overrides)
    ids, mask = encode_prompts(model, prompts)
    total = ids.shape[1] + gen_length
    if total > model.spec.max_seq_len:
        raise ValueError(
            f"prompt length {ids.shape[1]} + gen_length {gen_length} = {total} exceeds the model's context "
            f"({model.spec.max_seq_len}); shorten the prompt or lower gen_length"
        )
    tokens, stats = decode(model, ids, mask, pipeline, config, compile=compile, on_step=on_step)
    texts = _decode_texts(model, tokens[:, ids.shape[1] :])
    return GenerationOutput(tokens, texts, stats, ids.shape[1], pipeline)


def _decode_texts(model: DiffusionLM, gen: torch.Tensor) -> list[str] | None:
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        return None
    eos = model.spec.eos_id
    texts = []
    for row in gen.tolist():
        cut = row.index(eos) if eos in row else len(row)
        texts.append(tok.decode(row[:cut], skip_special_tokens=False))
    return texts
