"""WINO's revokable commit rule (Wide-In, Narrow-Out) and the shadow-block pass that re-scores a block's drafts.

Source: Hong et al. 2025, "Wide-In, Narrow-Out: Revokable Decoding for Efficient and Effective DLLMs"; the rule as
Research dLLM's ``wino`` generation strategy runs it (its defaults: ``wide_in_thres`` 0.7, ``narrow_out_thres``
0.9). Shapes: the block ``[B, bl]``; the shadow pass's rows ``[B, bl, d]``, its keys ``[B, Hkv, T + 1 + bl, hd]``
and its attention mask ``[B, 1, bl, T + 1 + bl]``.
"""

from __future__ import annotations

import attrs
import torch
from attrs import validators as v

from polestar.models import layer_regions
from polestar.models.cost import CostMeter, StepCost
from polestar.models.layer_regions import LayerCache
from polestar.models.plan import DecodeCache
from polestar.registry import register
from polestar.stages import Capability, CommitFloor, CommitRule
from polestar.state import CommitSelection, DecodeState, Prediction

from .commit_basic import _threshold_validator, rank_descending


@attrs.define
class WinoState:
    """Per-generation state of :class:`WinoCommit`: ``verify_conf [B, bl]`` float64, the shadow block's probability
    of the token each committed block position holds (written in place by :meth:`WinoCommit.verify`)."""

    verify_conf: torch.Tensor


def shadow_logits(model, cache: DecodeCache, x: torch.Tensor, columns: torch.Tensor, mask_id: int,
                  meter: CostMeter) -> torch.Tensor:
    """WINO's shadow block for the block's columns ``columns [B, bl]`` (tokens ``x [B, T]``), run through every layer
    after the step's forward wrote that layer's K/V: row ``j`` is a mask token at column ``j``'s RoPE position. It
    attends to every valid cached key but column ``j``'s (leave one out) and to the whole shadow block; no cached row
    sees the shadow block, so the forward's own logits are those of a plain pass. With shifted logits (Dream, whose
    prediction of column ``j`` is the output of the row at ``j - 1``) row ``j`` is instead the token of column
    ``j - 1`` at that position, still leaving column ``j``'s key out. → logits ``[B, bl, V]`` predicting the
    columns, the pass counted on ``meter`` (one more pass over every layer's weights and K/V, ``B · bl`` rows per
    layer, the embedding rows and the LM head)."""
    spec = model.spec
    B, bl = columns.shape
    H, Hkv = spec.n_heads, spec.n_kv_heads
    rows_at = columns - spec.logit_shift
    tokens = x.gather(1, rows_at) if spec.logit_shift else torch.full_like(columns, mask_id)
    meter.embedding(model.embedding_weight(), tokens.numel())
    h = model.embed(tokens)
    rope = model.rope_of(cache, cache.positions.gather(1, rows_at))
    keys_at = torch.arange(cache.key_valid.shape[1], device=columns.device)
    seen = cache.key_valid[:, None, :] & (keys_at[None, None, :] != columns[:, :, None])  # [B, bl, T + 1]
    mask = torch.cat([seen, seen.new_ones(B, bl, bl)], dim=2)  # [B, bl, T + 1 + bl]: a mask per shadow row
    regions, shape = layer_regions.active(), model.layer_shape
    for layer in range(spec.n_layers):  # the layer regions the forward runs, over the cache joined with the shadow
        w = model.layer_weights(layer)
        qk, proj = regions.qkv_rows(h, rope, w, shape)
        keys = torch.cat([cache.k[layer], qk[:, :, H:].transpose(1, 2)], dim=2)
        values = torch.cat([cache.v[layer], proj[:, :, H + Hkv :].transpose(1, 2)], dim=2)
        h = regions.attend_mlp(qk[:, :, :H].transpose(1, 2), h, LayerCache(keys, values, mask), w, shape)
        counted = model.layer_bytes(layer)
        meter.add(counted.qkv_pass + counted.out_mlp_pass, 2 * cache.layer_kv_bytes, B * bl)
    meter.weight(model.final_norm_weight())
    return model.logits(model.final_norm(h), meter)


def _token_probs(logits: torch.Tensor, tokens: torch.Tensor, mask_in_softmax: bool, mask_id: int) -> torch.Tensor:
    """float64 probability of ``tokens [B, bl]`` under the softmax of ``logits [B, bl, V]`` (mask token included
    unless ``mask_in_softmax`` is False)."""
    l64 = logits.to(torch.float64)
    if not mask_in_softmax:
        l64 = l64.clone()
        l64[..., mask_id] = float("-inf")
    return torch.softmax(l64, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


def wide_in(conf: torch.Tensor, masked: torch.Tensor, threshold: float) -> torch.Tensor:
    """WINO's wide-in: every masked position with ``conf ≥ threshold``; more than the cap
    ``max(clamp(int(0.7 · masked), 5, 20), 1)`` of them: the cap's most confident; none: the most confident one.
    ``conf, masked [B, bl]`` → bool ``[B, bl]``."""
    conf = conf.masked_fill(~masked, float("-inf"))
    cap = (masked.sum(dim=1) * 0.7).int().clamp(5, 20).clamp(min=1)[:, None]
    above = masked & (conf >= threshold)
    count = above.sum(dim=1, keepdim=True)
    rank = rank_descending(conf)
    return masked & torch.where(count > cap, rank < cap, above | ((count == 0) & (rank == 0)))


def narrow_out(verify_conf: torch.Tensor, drafted: torch.Tensor, accepted: torch.Tensor,
               threshold: float) -> torch.Tensor:
    """WINO's narrow-out: the drafted positions (``drafted [B, bl]``, committed before this step) whose shadow
    confidence ``verify_conf [B, bl]`` is below ``threshold``; when more than ``k = accepted - 1`` qualify
    (``accepted [B]`` this step's wide-in count), the ``k`` least confident of them. A row so masks at most
    ``accepted - 1`` positions: every step leaves at least one fewer mask. → bool ``[B, bl]``."""
    low = drafted & (verify_conf < threshold)
    k = (accepted - 1).clamp(min=0)[:, None]
    bottom = rank_descending(-verify_conf.masked_fill(~drafted, float("inf"))) < k
    return torch.where(low.sum(dim=1, keepdim=True) > k, bottom & drafted, low)


@register("commit", "wino")
class WinoCommit(CommitRule):
    """WINO (Hong et al. 2025, "Wide-In, Narrow-Out: Revokable Decoding for Efficient and Effective DLLMs"), as
    Research dLLM's ``wino`` strategy runs it. Wide-in (:func:`wide_in`): commit (draft) every masked block
    position whose confidence is ≥ ``wide_in_thres``, at most ``max(clamp(int(0.7 · masked), 5, 20), 1)``, at
    least the most confident. Narrow-out (:func:`narrow_out`): a shadow block (:func:`shadow_logits`, a pass of its
    own after the forward: ``B · bl`` more rows per layer, counted) scores each token drafted in an earlier step of
    the block with that position left out; drafts below ``narrow_out_thres`` are revoked (masked again), at most
    this step's wide-in count minus one, the least confident first, so a block always ends. A block's first step
    has no draft to verify and runs no shadow pass.

    ``mask_in_softmax``: confidences are softmax probabilities in float64 over the whole vocabulary, mask token
    included, as Research dLLM computes them (False: the mask token excluded, the library's
    :func:`~polestar.state.token_log_probs`). The shadow block attends to the K/V the forward wrote, so with a
    cache it verifies against the same cached context the block rows saw. Shapes: ``[B, bl]``.

    It has no confidence floor: wide-in's cap fallback and its top-1 commit pick by rank, whatever the
    confidence."""

    @attrs.frozen
    class Config:
        wide_in_thres: float = attrs.field(default=0.7, converter=float, validator=_threshold_validator)
        narrow_out_thres: float = attrs.field(default=0.9, converter=float, validator=_threshold_validator)
        mask_in_softmax: bool = attrs.field(default=True, validator=v.instance_of(bool))

    needs = frozenset({Capability.BLOCK_REGION})

    def init_state(self, state: DecodeState) -> WinoState:
        conf = torch.zeros(state.batch_size, state.block_length, dtype=torch.float64, device=state.x.device)
        return WinoState(conf)

    def begin_generation(self, local: WinoState, state: DecodeState, cache: DecodeCache, model) -> None:
        local.verify_conf.zero_()

    def phase(self, position, state: DecodeState, local: WinoState) -> bool:
        """Whether the block may hold drafts to verify (every step but its first)."""
        return not position.at_block_start

    def verify(self, state: DecodeState, cache: DecodeCache, model, local: WinoState) -> StepCost | None:
        """The shadow pass (past a block's first step): the probability, under each shadow row, of the token its
        block position holds, into ``local.verify_conf``."""
        if not state.phase.commit:
            return None
        meter = CostMeter()
        logits = shadow_logits(model, cache, state.x, state.region, state.mask_id, meter)
        if state.detail is not None:  # an observer records: the shadow rows, one per block column, at every layer
            rows = (state.region, torch.ones_like(state.region_valid))
            state.detail.verified.update(dict.fromkeys(range(state.n_layers), rows))
        current = state.x.gather(1, state.region)  # the block's tokens before this step's commits
        local.verify_conf.copy_(_token_probs(logits, current, self.config.mask_in_softmax, state.mask_id))
        return meter.result()

    def select(self, pred: Prediction, masked: torch.Tensor, state: DecodeState, local: WinoState) -> CommitSelection:
        cfg = self.config
        conf = _token_probs(pred.logits, pred.tokens, cfg.mask_in_softmax, state.mask_id)
        commit = wide_in(conf, masked, cfg.wide_in_thres)
        if not state.phase.commit:
            return CommitSelection(commit)
        drafted = (state.x.gather(1, state.region) != state.mask_id) & state.active[:, None]
        revoke = narrow_out(local.verify_conf, drafted, commit.sum(dim=1), cfg.narrow_out_thres)
        return CommitSelection(commit, revoke=revoke)

    def floor(self) -> CommitFloor:
        return CommitFloor(0.0, 0)
