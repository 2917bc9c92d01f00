"""Adaptive commit rules: Polestar-Commit (drift delta + suffix block), EB-sampler's entropy bound, KLASS.

Shapes: ``Prediction.confidence [B, bl]``, ``Prediction.logits [B, bl, V]``, masks ``[B, bl]``; the attention probe
of the block rows at the last layer ``[B, H, bl, T + 1]``; the update packet ``positions [B, M]``, ``valid [B, M]``,
``logits [B, M, V]`` (``M`` the last layer's member capacity).
"""

from __future__ import annotations

import math

import attrs
import torch
from attrs import validators as v

from polestar.models.backbone import AttentionProbe
from polestar.models.plan import Plan
from polestar.registry import register
from polestar.stages import Capability, CommitFloor, CommitRule
from polestar.state import CommitSelection, DecodeState, Prediction, SuffixCommit, propose, token_log_probs

from .commit_basic import _threshold_validator, rank_descending, threshold_transfer


@register("commit", "polestar")
class PolestarCommit(CommitRule):
    """Polestar-Commit (Lee et al. 2026): Fast-dLLM's threshold rule (``threshold`` = τ_s, most confident always),
    plus early commit of a masked block token whose drift delta (its last-layer attention drift between consecutive
    steps, scored by the policy's ``drift`` stage -- KL by default --, minus the mean of its last ``window`` drifts)
    satisfies
    ``alpha * (threshold − c)² ≤ delta < delta_cap`` for ``min_confidence < c < threshold``, plus suffix-block
    commit of masked positions after the block that the last layer's update packet refreshed, when their
    confidence ≥ ``threshold`` (positions shifted by one for Dream's shifted logits). ``alpha = inf`` disables the
    early commit (plain threshold)."""

    @attrs.frozen
    class Config:
        threshold: float = attrs.field(default=0.9, converter=float, validator=_threshold_validator)
        min_confidence: float = attrs.field(default=0.7, converter=float, validator=_threshold_validator)
        alpha: float = attrs.field(default=10.0, converter=float, validator=v.ge(0.0))
        window: int = attrs.field(default=5, validator=v.ge(1))
        delta_cap: float = attrs.field(default=2.0, converter=float, validator=v.gt(0.0))
        suffix_commit: bool = attrs.field(default=True, validator=v.instance_of(bool))

    wants_packet = True
    requires = ("drift",)
    needs = frozenset({Capability.ATTENTION_PROBE, Capability.BLOCK_REGION})

    def bind(self, stages: dict) -> None:
        self.drift = stages["drift"]  # the policy's drift metric scores the block's attention change

    def init_state(self, state: DecodeState) -> PolestarCommitState:
        B, bl, device = state.batch_size, state.block_length, state.x.device
        return PolestarCommitState(
            attn=torch.zeros(B, state.n_heads, bl, state.length + 1, device=device),
            hist=torch.zeros(B, self.config.window, bl, device=device),
            count=torch.zeros((), dtype=torch.long, device=device),
            delta=torch.zeros(B, bl, device=device))

    def begin_block(self, local: PolestarCommitState, state: DecodeState) -> None:
        local.hist.zero_()
        local.count.zero_()

    def phase(self, position, state: DecodeState, local) -> bool:
        """Whether the block has a previous step's attention to compare with (every step but its first)."""
        return not position.at_block_start

    def probe(self, state: DecodeState, plan: Plan) -> AttentionProbe:
        rows = plan.target_offset + state.block_arange
        return AttentionProbe(state.n_layers - 1, rows[None, :].expand(state.batch_size, -1))

    def observe_probe(self, state: DecodeState, probs: torch.Tensor, local: PolestarCommitState) -> None:
        """Keep this step's attention rows ``[B, H, bl, T+1]`` and, past the block's first step, turn their drift
        from the previous step's into drift deltas ``local.delta [B, bl]``: the drift minus the mean of the (at most
        ``window``) drifts before it in this block, the drift itself when there are none. ``hist`` keeps the last
        ``window`` drifts newest first, zeros where none was seen yet, so its sum over the seen ones divided by
        their count is the mean, with no branch on the count. All in place."""
        if state.phase.commit:
            drift = self.drift.score(probs, local.attn).to(local.hist.dtype)  # [B, bl]
            seen = local.count.clamp(max=self.config.window)
            local.delta.copy_(drift - local.hist.sum(dim=1) / seen.clamp_min(1))
            local.hist.copy_(torch.cat([drift[:, None], local.hist[:, :-1]], dim=1))
            local.count.add_(1)
        local.attn.copy_(probs)

    def select(self, pred: Prediction, masked: torch.Tensor, state: DecodeState,
               local: PolestarCommitState) -> CommitSelection:
        c = self.config
        transfer = threshold_transfer(pred.confidence, masked, c.threshold)
        if not state.phase.commit:  # the block's first step: no drift delta yet
            return CommitSelection(transfer)
        conf = pred.confidence
        band = masked & (conf > c.min_confidence) & (conf < c.threshold)
        if math.isinf(c.alpha):
            return CommitSelection(transfer, torch.zeros_like(band), band)
        gate = c.alpha * (c.threshold - conf).clamp_min(0.0) ** 2
        early = band & (local.delta.double() >= gate) & (local.delta < c.delta_cap)
        return CommitSelection(transfer | early, early, band)

    def floor(self) -> CommitFloor:
        """Early commits need ``c > min_confidence``, threshold and suffix commits ``c ≥ threshold``; below the
        lower of the two only the most confident position of a row."""
        return CommitFloor(min(self.config.min_confidence, self.config.threshold), 1)

    def suffix(self, state: DecodeState, local: PolestarCommitState, packet) -> SuffixCommit | None:
        """Suffix-block commits from this step's update packet (``[B, N]`` fields), or None."""
        if packet is None or not self.config.suffix_commit:
            return None
        target = packet.positions + state.logit_shift
        block_end = state.clock.block_start + state.block_length
        inside = (target >= block_end) & (target < state.length)
        target = target.clamp(max=state.length - 1)
        tokens, conf = propose(packet.logits, state.mask_id)
        is_masked = state.x.gather(1, target) == state.mask_id
        commit = packet.valid & inside & is_masked & (conf >= self.config.threshold) & state.active[:, None]
        return SuffixCommit(target, tokens, conf, commit)


@attrs.define
class PolestarCommitState:
    """Per-generation state of :class:`PolestarCommit` (preallocated, written in place; ``hist`` and ``count`` reset
    at each block start): ``attn`` the previous step's attention rows ``[B, H, bl, T+1]``, ``hist`` the last
    ``window`` drifts ``[B, window, bl]`` (newest first, zeros where no drift was seen yet), ``count`` a long scalar
    tensor, drifts seen in this block, ``delta`` this step's drift delta ``[B, bl]`` (meaningful past a block's first
    step)."""

    attn: torch.Tensor | None = None
    hist: torch.Tensor | None = None
    count: torch.Tensor | None = None
    delta: torch.Tensor | None = None


def token_entropy(logits: torch.Tensor, mask_id: int) -> torch.Tensor:
    """Entropy (nats, float64) of the token distribution decoding draws from (:func:`token_log_probs`, the mask
    token excluded): ``logits [..., V]`` → ``[...]``."""
    return log_probs_entropy(token_log_probs(logits, mask_id))


def log_probs_entropy(logp: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of the distribution ``logp [..., V]`` (log-probabilities, ``-inf`` entries allowed) →
    ``[...]``."""
    return torch.special.entr(logp.exp()).sum(-1)


@register("commit", "entropy-bound")
class EntropyBoundCommit(CommitRule):
    """EB-sampler (Ben-Hamu et al. 2025, "Accelerated Sampling from Masked Diffusion Models via Entropy Bounded
    Unmasking"): order masked tokens by confidence and commit the longest prefix whose summed entropy minus its
    largest entropy stays ≤ ``gamma`` (at least one token). Entropies are those of the distribution the tokens
    are drawn from (:func:`~polestar.state.token_log_probs`, the mask token excluded), as the paper defines them
    on the model's token distribution. Floor: every committed token but the prefix's largest-entropy one has
    entropy ≤ ``gamma``, hence confidence ≥ ``exp(-gamma)``; the largest-entropy one is exempt by the paper's
    bound and may have any confidence (at most one per row and step). Shapes: entropies ``[B, bl]``."""

    @attrs.frozen
    class Config:
        gamma: float = attrs.field(default=0.1, converter=float, validator=v.ge(0.0))

    def select(self, pred: Prediction, masked: torch.Tensor, state: DecodeState, local=None) -> CommitSelection:
        conf = pred.confidence.masked_fill(~masked, float("-inf"))
        order = conf.argsort(dim=1, descending=True, stable=True)
        ent = log_probs_entropy(pred.log_probs).masked_fill(~masked, 0.0).gather(1, order)
        csum = ent.cumsum(dim=1)
        cmax = ent.cummax(dim=1).values
        ok = (csum - cmax) <= self.config.gamma
        count = ok.long().cumprod(dim=1).sum(dim=1).clamp_min(1)
        return CommitSelection(masked & (rank_descending(conf) < count[:, None]))

    def floor(self) -> CommitFloor:
        return CommitFloor(math.exp(-self.config.gamma), 1)


@register("commit", "klass")
class KLASSCommit(CommitRule):
    """KLASS (Kim et al. 2025, "KLASS: KL-Guided Fast Inference in Masked Diffusion Models", KL-Adaptive Stability
    Sampling): a masked token is *stable* when its output distribution moved less than ``kl_bound`` (KL between
    consecutive steps) at each of the last ``stable_steps`` steps and its confidence is above ``min_confidence``.
    A step commits every stable token of the block and nothing else; only when no token is stable does it commit
    the most confident one (the released code's fallback, a top-k of LLaDA's schedule, one per step here). The KL
    is taken between the distributions the tokens are drawn from (:func:`~polestar.state.token_log_probs`, the mask
    token excluded).

    History: the released code keeps one KL history over the whole sequence across blocks and allows a commit from
    the block's step ``stable_steps - 1`` on (its first KL compares with the previous block's last step). This rule
    sees the block's distributions only (a dual cache never recomputes the next block's rows before it starts), so
    the history starts at each block: the first KL is the block's second step, and a stable commit comes at step
    ``stable_steps`` at the earliest -- as Research dLLM's ``klass`` decodes under its caches. Shapes: ``[B, bl]``."""

    needs = frozenset({Capability.BLOCK_REGION})  # the previous step's distributions, column by column

    @attrs.frozen
    class Config:
        kl_bound: float = attrs.field(default=0.01, converter=float, validator=v.ge(0.0))
        stable_steps: int = attrs.field(default=2, validator=v.ge(1))
        min_confidence: float = attrs.field(default=0.5, converter=float, validator=_threshold_validator)

    def init_state(self, state: DecodeState) -> KLASSState:
        B, bl, device = state.batch_size, state.block_length, state.x.device
        return KLASSState(torch.zeros(B, bl, state.vocab_size, device=device),
                          torch.zeros(B, bl, dtype=torch.long, device=device))

    def phase(self, position, state: DecodeState, local) -> bool:
        """Whether the block has a previous step's distribution to compare with (every step but its first)."""
        return not position.at_block_start

    def select(self, pred: Prediction, masked: torch.Tensor, state: DecodeState, local: KLASSState) -> CommitSelection:
        # float32, the mask entry at the dtype's minimum: its p is 0 and its KL term 0 * 0, never inf - inf
        logp = pred.log_probs.float().clamp_min(torch.finfo(torch.float32).min)
        if state.phase.commit:
            kl = (logp.exp() * (logp - local.logp)).sum(-1).clamp_min(0.0)
            streak = torch.where(kl < self.config.kl_bound, local.streak + 1, 0)
        else:
            streak = torch.zeros_like(masked, dtype=torch.long)
        local.logp.copy_(logp)
        local.streak.copy_(streak)
        stable = masked & (streak >= self.config.stable_steps) & (pred.confidence > self.config.min_confidence)
        top1 = threshold_transfer(pred.confidence, masked, 2.0)  # the most confident masked token alone
        return CommitSelection(torch.where(stable.any(dim=1, keepdim=True), stable, top1))

    def floor(self) -> CommitFloor:
        """Below ``min_confidence`` only the most confident position of a row (when nothing is stable)."""
        return CommitFloor(self.config.min_confidence, 1)


@attrs.define
class KLASSState:
    """Per-generation state of :class:`KLASSCommit` (preallocated, written in place at every step): the previous
    step's log-probs ``logp [B, bl, V]`` and each position's count of consecutive stable steps ``streak [B, bl]``
    (read past a block's first step only)."""

    logp: torch.Tensor
    streak: torch.Tensor
