"""Commit rules of LLaDA (fixed count per step) and Fast-dLLM (confidence threshold, confidence factor)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import attrs
import torch
from attrs import validators as v

from polestar.registry import register
from polestar.schedule import transfer_counts  # noqa: F401  (LLaDA's schedule, kept importable from here)
from polestar.stages import CommitFloor, CommitRule
from polestar.state import CommitSelection, DecodeState, Prediction


def rank_descending(scores: torch.Tensor) -> torch.Tensor:
    """Rank of every entry within its row, 0 = largest. ``scores [B, n]`` → long ``[B, n]``."""
    order = scores.argsort(dim=-1, descending=True, stable=True)
    return order.argsort(dim=-1)


def _low_confidence(pred: Prediction, state: DecodeState) -> torch.Tensor:
    return pred.confidence


def _random(pred: Prediction, state: DecodeState) -> torch.Tensor:
    return state.random.remask  # drawn before the step from the generation's generator


_REMASKING = {"low_confidence": _low_confidence, "random": _random}


def scheduled_count(state: DecodeState) -> torch.Tensor:
    """``[B, 1]`` long: how many tokens LLaDA's schedule commits at this step of the block (``state.num_transfer``
    gathered at the device step: no Python int enters the step)."""
    steps = state.num_transfer.shape[1]
    column = state.clock.step.clamp(max=steps - 1).expand(state.batch_size, 1)
    return state.num_transfer.gather(1, column)


def softmax_confidence(pred: Prediction) -> torch.Tensor:
    """``[B, R]``: the proposed token's probability under the softmax of the raw logits over the whole vocabulary,
    mask token included, in the logits' precision and at least fp32 (how LLaDA-family released loops rank them)."""
    logits = pred.logits.to(torch.promote_types(pred.logits.dtype, torch.float32))
    return torch.softmax(logits, dim=-1).gather(-1, pred.tokens[..., None]).squeeze(-1)


@register("commit", "topk")
class TopKCommit(CommitRule):
    """LLaDA's fixed-count rule: step ``i`` of a block commits ``num_transfer[i]`` tokens, LLaDA's even split of the
    block's masks over ``steps // num_blocks`` steps, choosing the most confident (``low_confidence`` remasking) or
    random ones (``random``). Source: Nie et al. 2025, ``generate.py``. It has no confidence floor: the count is
    fixed by the schedule, so a step commits its share of tokens whatever their confidence. Shapes: scores
    ``[B, bl]``.

    ``mask_in_softmax``: rank by the proposed token's probability under the softmax of the raw logits over the
    whole vocabulary, mask token included, in the logits' precision and at least fp32, as dLLM-Cache's released loop
    ranks them (Liu et al. 2025), instead of the library's fp64 confidence with the mask token excluded; the committed
    tokens are the same proposals either way."""

    @attrs.frozen
    class Config:
        remasking: str = attrs.field(default="low_confidence", validator=v.in_(tuple(_REMASKING)))
        mask_in_softmax: bool = attrs.field(default=False, validator=v.instance_of(bool))

        def __attrs_post_init__(self):
            if self.mask_in_softmax and self.remasking != "low_confidence":
                raise ValueError("mask_in_softmax ranks by confidence: it needs remasking='low_confidence'")

    @property
    def needs_random(self) -> bool:
        return self.config.remasking == "random"

    def select(self, pred: Prediction, masked: torch.Tensor, state: DecodeState, local=None) -> CommitSelection:
        scores = _REMASKING[self.config.remasking](pred, state)
        if self.config.mask_in_softmax:
            scores = softmax_confidence(pred)
        scores = scores.masked_fill(~masked, float("-inf"))
        return CommitSelection(rank_descending(scores) < scheduled_count(state))

    def floor(self) -> CommitFloor:
        return CommitFloor(0.0, 0)


def _threshold_validator(_inst, attribute, value):
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{attribute.name} must be in [0, 1], got {value}")


def threshold_transfer(confidence: torch.Tensor, masked: torch.Tensor, threshold: float) -> torch.Tensor:
    """Masked positions with ``confidence ≥ threshold``, plus each row's most confident masked position.
    ``[B, n]`` → bool ``[B, n]``."""
    conf = confidence.masked_fill(~masked, float("-inf"))
    top = torch.zeros_like(masked).scatter_(1, conf.argmax(dim=1, keepdim=True), True)
    return masked & ((conf >= threshold) | top)


@register("commit", "threshold")
class ThresholdCommit(CommitRule):
    """Fast-dLLM's parallel rule: commit every masked token whose confidence ≥ ``threshold``, and always the most
    confident one. Source: Wu et al. 2025 (Fast-dLLM), ``get_transfer_index``. Shapes: ``[B, bl]``."""

    @attrs.frozen
    class Config:
        threshold: float = attrs.field(default=0.9, converter=float, validator=_threshold_validator)

    def select(self, pred: Prediction, masked: torch.Tensor, state: DecodeState, local=None) -> CommitSelection:
        return CommitSelection(threshold_transfer(pred.confidence, masked, self.config.threshold))

    def floor(self) -> CommitFloor:
        """Below ``threshold`` only the most confident position of a row."""
        return CommitFloor(self.config.threshold, 1)


def _factor_count_code(ordered: torch.Tensor, inside: torch.Tensor, n_masked: torch.Tensor,
                       factor: float) -> torch.Tensor:
    """Fast-dLLM's released code: ranks pass while ``c_n ≥ 1 - factor / (n + 1)``; a first failure at the last
    masked rank commits that rank too. ``ordered [B, n]`` descending, ``inside [B, n]`` → counts ``[B]``."""
    rank = torch.arange(ordered.shape[1], device=ordered.device)
    bound = 1.0 - factor / (rank + 2.0)
    bound[0] = -1.0
    fails = (ordered < bound) & inside
    first_fail = torch.where(fails.any(dim=1), fails.long().argmax(dim=1), n_masked - 1)
    return first_fail + ((first_fail == 0) | (first_fail == n_masked - 1)).long()


def _factor_count_paper(ordered: torch.Tensor, inside: torch.Tensor, n_masked: torch.Tensor,
                        factor: float) -> torch.Tensor:
    """The paper's bound: the longest prefix of ranks with ``(n + 1)(1 - c_n) < factor``, the first always.
    ``ordered [B, n]`` descending, ``inside [B, n]`` → counts ``[B]``."""
    rank = torch.arange(ordered.shape[1], device=ordered.device)
    passes = ((rank + 2.0) * (1.0 - ordered) < factor) & inside
    passes[:, 0] = True
    return passes.long().cumprod(dim=1).sum(dim=1)


class FactorVariant(NamedTuple):
    """One variant of the factor rule (:class:`FactorCommit`): ``count(ordered, inside, n_masked, factor)`` → how
    many of a step's sorted confidences it commits ``[B]``; ``exempt``: how many of those may fall below the rule's
    floor."""

    count: Callable[..., torch.Tensor]
    exempt: int


_FACTOR_RULES = {"code": FactorVariant(_factor_count_code, 2), "paper": FactorVariant(_factor_count_paper, 1)}


@register("commit", "factor")
class FactorCommit(CommitRule):
    """Fast-dLLM's factor rule (Wu et al. 2025, "Fast-dLLM: Training-free Acceleration of Diffusion LLM by
    Enabling KV Cache and Parallel Decoding"): sort the masked confidences ``c_1 ≥ c_2 ≥ …`` and commit the ``n``
    most confident, the first always. Two variants (``rule``):

    * ``paper``: the largest ``n`` with ``(n + 1)(1 - c_n) < factor`` for every rank up to ``n`` -- the bound as
      the paper states it (strict; the product grows with ``n``, so the passing ranks are a prefix).
    * ``code``: the released code's ``get_transfer_index_dynamic``: a rank passes while
      ``c_n ≥ 1 - factor / (n + 1)`` (not strict), and when the first failing rank is the last masked token, that
      token is committed as well.

    Shapes: ``[B, bl]``."""

    @attrs.frozen
    class Config:
        factor: float = attrs.field(default=1.0, converter=float, validator=[v.gt(0.0), v.le(100.0)])
        rule: str = attrs.field(default="paper", validator=v.in_(tuple(_FACTOR_RULES)))

    def select(self, pred: Prediction, masked: torch.Tensor, state: DecodeState, local=None) -> CommitSelection:
        conf = pred.confidence.masked_fill(~masked, float("-inf"))
        n_masked = masked.sum(dim=1)
        ordered = conf.sort(dim=1, descending=True).values
        inside = torch.arange(conf.shape[1], device=conf.device)[None, :] < n_masked[:, None]
        count = _FACTOR_RULES[self.config.rule].count(ordered, inside, n_masked, self.config.factor)
        return CommitSelection(masked & (rank_descending(conf) < count[:, None]))

    def floor(self) -> CommitFloor:
        """Ranks 2 and later of a step need ``c ≥ 1 - factor / 3`` or more; exempt are the first and, under the
        ``code`` rule, its extra last token."""
        return CommitFloor(max(0.0, 1.0 - self.config.factor / 3.0), _FACTOR_RULES[self.config.rule].exempt)
