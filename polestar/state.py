"""Decode state shared by the stages of one generation, the per-step model prediction and the typed records
stages hand each other (update packet, commit selection, suffix commits) and the engine hands observers."""

from __future__ import annotations

from typing import NamedTuple

import attrs
import torch

from polestar.models.cost import StepCost
from polestar.models.plan import Plan

from .config import GenerationConfig
from .region import BlockRegion


class Prediction(NamedTuple):
    """What the model proposes for the current block at one step.

    ``tokens``: ``[B, bl]`` long, argmax (or Gumbel-max sample) with the mask token excluded;
    ``confidence``: ``[B, bl]`` float64, probability of ``tokens`` under :func:`token_log_probs` (the mask token
    excluded; ``-inf`` where not masked);
    ``logits``: ``[B, bl, V]`` raw logits of the block positions;
    ``log_probs``: ``[B, bl, V]`` float64 :func:`token_log_probs` of ``logits``, computed once per step for the
    proposal and read by the commit rules that need the whole distribution (entropy, KL).
    """

    tokens: torch.Tensor
    confidence: torch.Tensor
    logits: torch.Tensor
    log_probs: torch.Tensor | None = None


class StepRandom(NamedTuple):
    """One step's random numbers, drawn from the generation's generator before the step runs (so a compiled step
    and an eager one consume the same stream): ``gumbel``: ``[B, bl, V]`` float64 uniform draws for Gumbel-max
    sampling (None at temperature 0); ``remask``: ``[B, bl]`` float64 uniform scores for random remasking (None
    unless the commit rule ``needs_random``)."""

    gumbel: torch.Tensor | None = None
    remask: torch.Tensor | None = None


def token_log_probs(logits: torch.Tensor, mask_id: int) -> torch.Tensor:
    """The model's token distribution that decoding draws from: float64 log-probabilities of ``logits [..., V]``
    with the mask token excluded (its logit set to ``-inf`` before the softmax, so its entry is ``-inf`` and the
    other entries are renormalised) → ``[..., V]``. Proposals, confidences and every commit rule's entropy or KL
    use this one distribution."""
    l64 = logits.to(torch.float64)
    if 0 <= mask_id < logits.shape[-1]:
        l64 = l64.clone()
        l64[..., mask_id] = float("-inf")
    return torch.log_softmax(l64, dim=-1)


def propose(
    logits: torch.Tensor, mask_id: int, temperature: float = 0.0, generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and float64 confidences for ``logits [..., V]`` → ``[...]``, ``[...]``.

    Tokens are drawn from :func:`token_log_probs` (the mask token is never proposed). With ``temperature > 0``
    they are Gumbel-max samples in float64 as in LLaDA (``exp(l) / (-log u)^temperature``), with ``u`` the
    uniform draws ``noise`` (same shape as ``logits``) or, without them, drawn here from ``generator``. Confidence
    is the proposed token's probability under that same distribution (mask token excluded).
    """
    return propose_from(token_log_probs(logits, mask_id), temperature, generator, noise)


def propose_from(
    logp: torch.Tensor, temperature: float = 0.0, generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`propose` from the distribution ``logp [..., V]`` (:func:`token_log_probs`) already computed."""
    scores = logp
    if temperature > 0:
        if noise is None:
            noise = torch.rand(scores.shape, generator=generator, dtype=torch.float64, device=generator.device)
        scores = scores.exp() / (-torch.log(noise.to(scores.device))) ** temperature
    tokens = scores.argmax(dim=-1)
    conf = logp.gather(-1, tokens[..., None]).squeeze(-1).exp()
    return tokens, conf


class UpdatePacket(NamedTuple):
    """The last layer's update packet of a sparse refresh, handed from the refresh selector to the commit rule.

    ``positions``: ``[B, M]`` long cache positions of the last layer's member buffer (``M`` its capacity);
    ``valid``: ``[B, M]`` bool, the slots that hold a member recomputed this step; ``logits``: ``[B, M, V]`` logits
    of those members' refreshed last-layer outputs (Polestar, Lee et al. 2026), from the same LM-head pass as the
    block's logits.
    """

    positions: torch.Tensor
    valid: torch.Tensor
    logits: torch.Tensor


class CommitSelection(NamedTuple):
    """What a commit rule chose for the current block, with the origin of its below-threshold commits.

    ``commit``: ``[B, bl]`` bool, the rule's commits; ``early``: ``[B, bl]`` bool or None, commits admitted below
    the rule's threshold by an adaptive criterion (Polestar-Commit's drift-delta gate); ``gate_candidates``:
    ``[B, bl]`` bool or None, the masked positions that criterion was evaluated on (the confidence band, at steps
    where a drift delta exists); ``revoke``: ``[B, bl]`` bool or None, committed positions of the region the rule
    takes back (the engine puts the mask token there again; :func:`revocations` says which it honours).
    """

    commit: torch.Tensor
    early: torch.Tensor | None = None
    gate_candidates: torch.Tensor | None = None
    revoke: torch.Tensor | None = None


#: the revocation guard: a region accepts revocations only in its first ``REVOKE_STEPS_PER_POSITION × R`` steps
#: (``R`` the region's width); later steps ignore them, so the engine's one commit per step ends the region at most
#: ``R`` steps after that, whatever a rule revokes
REVOKE_STEPS_PER_POSITION = 2


def revocations(revoke: torch.Tensor | None, masked: torch.Tensor, transfer: torch.Tensor,
                state: DecodeState) -> torch.Tensor | None:
    """The revocations the engine applies this step: of a rule's ``revoke [B, R]``, the valid region positions of
    active rows that hold a committed token before the step (not masked; ``masked [B, R]`` are the step's masked
    positions of active rows) and that the step does not commit (``transfer [B, R]``), while the region's step is
    below the guard (:data:`REVOKE_STEPS_PER_POSITION`). A prompt column never qualifies. None when the rule
    revokes nothing. No host read, fixed shapes."""
    if revoke is None:
        return None
    R = masked.shape[1]
    held = (state.x.gather(1, state.region) != state.mask_id) & state.region_valid & state.active[:, None]
    in_time = state.clock.step < REVOKE_STEPS_PER_POSITION * R
    return revoke & held & ~masked & ~transfer & (state.region >= state.prompt_len) & in_time


class SuffixCommit(NamedTuple):
    """Commits outside the current block: ``positions``, ``tokens``, ``confidence`` (float64) and ``commit``
    (bool), each ``[B, N]``; only entries where ``commit`` is True are written."""

    positions: torch.Tensor
    tokens: torch.Tensor
    confidence: torch.Tensor
    commit: torch.Tensor


class CommitOrigins(NamedTuple):
    """Where one step's commits came from. ``rule``: ``[B, bl]`` the commit rule's selection (masked positions
    only); ``forced``: ``[B, bl]`` the engine's top-1 commit in rows the rule left without one; ``early`` and
    ``gate_candidates``: as in :class:`CommitSelection`; ``suffix``: the rule's :class:`SuffixCommit` or None;
    ``revoked``: ``[B, bl]`` committed positions the step masked again (:func:`revocations`), None where the rule
    revokes nothing."""

    rule: torch.Tensor
    forced: torch.Tensor
    early: torch.Tensor | None
    gate_candidates: torch.Tensor | None
    suffix: SuffixCommit | None
    revoked: torch.Tensor | None = None

    @property
    def block(self) -> torch.Tensor:
        """``[B, bl]`` bool: every commit inside the block."""
        return self.rule | self.forced


class StepRecord(NamedTuple):
    """One decoding step, handed to ``decode(..., on_step=...)`` observers (tests, ``polestar anatomy``).

    ``step``: index over the generation; ``block_index``/``block_step``: the block and the step inside it;
    ``block_start``/``block_end``: the block's columns; ``plan``: the refresh plan the forward executed;
    ``active``: ``[B]`` bool, rows that decoded at this step; ``masked``: ``[B, bl]`` bool, the block's masked
    positions of those rows before the commit; ``confidence``: ``[B, bl]`` float64 (``-inf`` outside ``masked``);
    ``tokens_before``/``tokens_after``: ``[B, T]`` (``tokens_after`` includes the EOS fill of finished rows);
    ``committed``: ``[B, T]`` bool, positions that held the mask token before and not after;
    ``origins``: :class:`CommitOrigins`; ``cost``: the step's :class:`~polestar.models.cost.StepCost` (plain ints,
    whole batch); ``detail``: the step's :class:`StepDetail` (what the stages gathered for observers); ``region``:
    ``[B, R]`` long, the columns of the step's commit region (entry ``j`` of ``masked``, ``confidence`` and
    ``origins``: ``block_start + j`` in a block, a sliding window's own columns otherwise); ``held``: ``[B]`` bool,
    rows the step computed without completing their forward (it continues at the next step; not in ``active``).
    """

    step: int
    block_index: int
    block_step: int
    block_start: int
    block_end: int
    plan: Plan
    active: torch.Tensor
    masked: torch.Tensor
    confidence: torch.Tensor
    tokens_before: torch.Tensor
    tokens_after: torch.Tensor
    committed: torch.Tensor
    origins: CommitOrigins
    cost: StepCost | None = None
    detail: StepDetail | None = None
    region: torch.Tensor | None = None
    held: torch.Tensor | None = None


@attrs.define
class StepDetail:
    """What the stages of one step gathered for an observer (``decode(..., on_step=...)``), keyed by layer.

    Filled only while an observer records (``DecodeState.detail`` is None otherwise, and no stage gathers anything):
    the entries are references to tensors the step computes anyway, so recording adds no host read to a step.
    What every policy may have: ``refreshed[l]``: ``(positions [B, M] long cache positions, valid [B, M] bool)``
    of the members a sparse update recomputed at layer ``l`` (every sparse-update method, through
    :class:`~polestar.policies.sparse_update.SparseUpdate`); ``computed[l]``: ``(positions [B, X], valid [B, X])``
    of the plan rows layer ``l`` put through attention and the MLP, where a hook restricted the layer's pass to some
    of them (dLLM-Cache's feature cache; absent: every plan row). ``stages``: what one stage alone gathers, under
    a name of its own, layer → its record (:meth:`entry`; Polestar-Cache's cluster drifts, Elastic-Cache's
    trigger): read by the stage's own trace figures (``Stage.trace_figures``). ``verified[l]``: ``(positions [B, R],
    valid [B, R])``, the columns whose rows the commit rule's own pass put through layer ``l``
    (:meth:`~polestar.stages.CommitRule.verify`: WINO's shadow block, one row per block column)."""

    refreshed: dict = attrs.field(factory=dict)
    computed: dict = attrs.field(factory=dict)
    stages: dict = attrs.field(factory=dict)
    verified: dict = attrs.field(factory=dict)

    def entry(self, name: str) -> dict:
        """The per-layer records a stage gathers under ``name`` (created empty on first use)."""
        return self.stages.setdefault(name, {})


class StepPosition(NamedTuple):
    """Where the loop stands before a step, in plain ints on the host: ``block_index``, the block's columns
    ``[block_start, block_end)``, ``step`` inside the block (0 = its first forward), ``global_step`` over the
    generation and ``flags``, the refresh selector's flags read with the previous step's termination check (empty at
    a block's first step). Stages turn it into their :class:`StepPhase` entry (:meth:`~polestar.stages.Stage.phase`);
    it never enters the step itself."""

    block_index: int
    block_start: int
    block_end: int
    step: int
    global_step: int
    flags: tuple[bool, ...] = ()

    @property
    def at_block_start(self) -> bool:
        return self.step == 0


class StepPhase(NamedTuple):
    """The step variant: what the stages decided on the host from the :class:`StepPosition` (plain, hashable
    Python values). It chooses the step's shapes and branches, so each distinct phase is one compiled graph and
    nothing else that changes from step to step is a Python value inside the step. ``refresh``: the refresh
    selector's entry; ``commit``: the commit rule's (None for a rule whose steps are all alike)."""

    refresh: object = None
    commit: object = None


@attrs.define
class StepClock:
    """The step's position as 0-d long tensors on the decoding device, so a new block or step changes tensor values,
    never a graph: ``block_start`` the block's first column (written when a block starts), ``step`` the step inside
    the block and ``global_step`` over the generation (both advanced in place by the step itself)."""

    block_start: torch.Tensor
    step: torch.Tensor
    global_step: torch.Tensor

    @classmethod
    def at(cls, block_start: int, device, step: int = 0, global_step: int = 0) -> StepClock:
        def scalar(v: int) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.long, device=device)

        return cls(scalar(block_start), scalar(step), scalar(global_step))


@attrs.define
class DecodeState:
    """The decode state of one batched generation: persistent buffers, owned by the engine, read by every stage and
    written only in place (the same tensors for the whole generation, and for the next generation of the same
    shape).

    ``x``: ``[B, T]`` tokens (prompt right-aligned, mask tokens in the generation region); ``active``: ``[B]`` bool,
    rows that still decode in the current block (finished rows are frozen, never dropped); ``clock``: the block's
    first column and the step counters as device scalars (:class:`StepClock`); ``block_arange``: ``[bl]``
    ``arange(R)``; ``region``: ``[B, R]`` long, the columns the current step may commit, and ``region_valid``
    ``[B, R]`` bool its real entries (written in place by ``schedule``, a :mod:`polestar.region` schedule: the
    current block, or a sliding window of masked positions); ``horizon``: ``[B]`` long, the last column a sliding
    window may reach (``T``: unbounded); ``num_transfer``: ``[B, steps_per_block]`` LLaDA's per-step token counts for
    the current region; ``last_commits``: ``[B]`` long, tokens committed per row by the previous step (engine → refresh
    selectors); ``random``: this step's :class:`StepRandom`, drawn into its buffers before the step.
    Host-side: ``phase``, this step's :class:`StepPhase` (set by the loop before the step); ``detail``: this step's
    :class:`StepDetail` while an observer records, else None.
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
    clock: StepClock
    n_heads: int = 1
    vocab_size: int = 0
    num_transfer: torch.Tensor | None = None
    last_commits: torch.Tensor | None = None
    random: StepRandom = StepRandom()
    phase: StepPhase = StepPhase()
    detail: StepDetail | None = None
    block_arange: torch.Tensor = attrs.field(default=None)
    schedule: object = attrs.field(factory=BlockRegion)
    region: torch.Tensor = attrs.field(default=None)
    region_valid: torch.Tensor = attrs.field(default=None)
    horizon: torch.Tensor = attrs.field(default=None)

    def __attrs_post_init__(self):
        if self.block_arange is None:
            self.block_arange = torch.arange(self.schedule.width(self.config), device=self.x.device)
        if self.region is None:
            R = self.block_arange.shape[0]
            self.region = (self.prompt_len + self.block_arange)[None, :].repeat(self.batch_size, 1)
            self.region_valid = torch.ones(self.batch_size, R, dtype=torch.bool, device=self.x.device)
        if self.horizon is None:
            self.horizon = torch.full((self.batch_size,), self.length, dtype=torch.long, device=self.x.device)
        if self.last_commits is None:
            self.last_commits = torch.zeros(self.batch_size, dtype=torch.long, device=self.x.device)

    @property
    def length(self) -> int:
        return self.x.shape[1]

    @property
    def batch_size(self) -> int:
        return self.x.shape[0]

    @property
    def block_length(self) -> int:
        return self.config.block_length

    def block_columns(self) -> torch.Tensor:
        """``[B, R]`` long: the current region's columns (the block's, ``clock.block_start + arange``, in every row
        under :class:`~polestar.region.BlockRegion`)."""
        return self.region

    def _block_is_mask(self) -> torch.Tensor:
        return (self.x.gather(1, self.region) == self.mask_id) & self.region_valid

    def block_masked(self) -> torch.Tensor:
        """``[B, R]`` bool: mask tokens of the current region in active rows."""
        return self._block_is_mask() & self.active[:, None]

    def block_masked_any(self) -> torch.Tensor:
        """``[B]`` bool: rows with a mask token in the current region (active or not)."""
        return self._block_is_mask().any(dim=1)
