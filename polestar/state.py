"""Decode state shared by the stages of one generation, and the per-step model prediction."""

from __future__ import annotations

from typing import NamedTuple

import attrs
import torch

from .config import GenerationConfig


class Prediction(NamedTuple):
    """What the model proposes for the current block at one step.

    ``tokens``: ``[B, bl]`` long, argmax (or Gumbel-max sample) with the mask token excluded;
    ``confidence``: ``[B, bl]`` float64, softmax probability of ``tokens`` (``-inf`` where not masked);
    ``logits``: ``[B, bl, V]`` raw logits of the block positions.
    """

    tokens: torch.Tensor
    confidence: torch.Tensor
    logits: torch.Tensor


def propose(
    logits: torch.Tensor, mask_id: int, temperature: float = 0.0, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and float64 confidences for ``logits [..., V]`` → ``[...]``, ``[...]``.

    The mask token is never proposed (its logit is excluded before argmax / sampling). With ``temperature > 0``
    tokens are Gumbel-max samples in float64 as in LLaDA (``exp(l) / (-log u)^temperature``). Confidence is the
    softmax probability of the proposed token under the unmodified logits.
    """
    l64 = logits.to(torch.float64)
    scores = l64
    if 0 <= mask_id < logits.shape[-1]:
        scores = l64.clone()
        scores[..., mask_id] = float("-inf")
    if temperature > 0:
        noise = torch.rand(scores.shape, generator=generator, dtype=torch.float64, device=generator.device)
        scores = scores.exp() / (-torch.log(noise.to(scores.device))) ** temperature
    tokens = scores.argmax(dim=-1)
    conf = (l64.gather(-1, tokens[..., None]).squeeze(-1) - torch.logsumexp(l64, dim=-1)).exp()
    return tokens, conf


@attrs.define
class DecodeState:
    """Mutable state of one batched generation, read by refresh selectors and commit rules.

    ``x``: ``[B, T]`` tokens (prompt right-aligned, mask tokens in the generation region);
    ``active``: ``[B]`` bool, rows that still decode in the current block;
    ``block_start``/``block_end``: columns of the current block; ``step``: step index inside the block
    (0 = the block's first forward); ``num_transfer``: ``[B, steps_per_block]`` LLaDA's per-step token counts
    for the current block; ``extras``: per-stage tensors (drift histories, packets) keyed by stage name.
    """

    x: torch.Tensor
    active: torch.Tensor
    config: GenerationConfig
    mask_id: int
    eos_id: int
    prompt_len: int
    logit_shift: int
    n_layers: int
    generator: torch.Generator
    block_index: int = 0
    block_start: int = 0
    block_end: int = 0
    step: int = 0
    global_step: int = 0
    num_transfer: torch.Tensor | None = None
    extras: dict = attrs.field(factory=dict)
    compile: bool = False  # steps run through torch.compile; stages may compile their post-forward work too

    @property
    def length(self) -> int:
        return self.x.shape[1]

    @property
    def batch_size(self) -> int:
        return self.x.shape[0]

    @property
    def block_length(self) -> int:
        return self.block_end - self.block_start

    def block_masked(self) -> torch.Tensor:
        """``[B, bl]`` bool: mask tokens of the current block in active rows."""
        return (self.x[:, self.block_start : self.block_end] == self.mask_id) & self.active[:, None]

    def select_rows(self, rows: torch.Tensor) -> None:
        self.x = self.x.index_select(0, rows)
        self.active = self.active.index_select(0, rows)
        self.extras = {key: _select(value, rows) for key, value in self.extras.items()}


def _select(value, rows):
    """Batch-row selection through nested containers; per-stage extras keep the batch as dim 0."""
    if isinstance(value, torch.Tensor):
        return value.index_select(0, rows) if value.dim() > 0 else value
    if isinstance(value, dict):
        return {k: _select(v, rows) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_select(v, rows) for v in value)
    return value
