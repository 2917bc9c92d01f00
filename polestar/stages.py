"""Base classes of the stage kinds the decoding loop calls every step, and the stage lifecycle.

Lifecycle (every stage kind): a stage is a frozen config plus pure methods and keeps no per-generation state on
itself. At the start of a generation the engine calls ``init_state(state)`` and keeps the returned object (None
for stateless stages); at each block start it calls ``begin_block(local, state)``; every per-step method of a
refresh selector or commit rule receives that object as ``local``. A refresh selector's :meth:`RefreshSelector.allocate`
then prepares the block on the host (buffers, random draws); everything per step runs inside one step function
(:func:`polestar.step.decode_step`) that may be compiled whole, so per-step methods must not read the device
(no ``.item()``, ``bool(tensor)``, ``.tolist()``, ``nonzero()``) and draw no random numbers. What stages hand each other travels in typed
fields of :class:`~polestar.state.DecodeState` (``last_commits``, ``packet``) or in typed return values
(:class:`~polestar.state.CommitSelection`, :class:`~polestar.state.SuffixCommit`). So one assembled pipeline can
decode several generations at once.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from polestar.models.backbone import AttentionProbe
from polestar.models.hooks import LayerHook as LayerHookProtocol
from polestar.models.plan import DecodeCache, Plan

from .state import CommitSelection, DecodeState, Prediction, SuffixCommit


class Stage:
    """A pipeline stage: a frozen attrs ``Config`` and pure methods (see the module docstring for the lifecycle).

    ``requires``: stage kinds this stage composes, each with the registered name :func:`polestar.assemble` adds
    when a policy has no stage of that kind.
    """

    kind: str
    name: str
    Config: type
    requires: dict[str, str] = {}

    def __init__(self, config):
        self.config = config

    def bind(self, stages: dict) -> None:
        """Called once the pipeline is assembled with every stage by kind (for stages that compose others)."""

    def init_state(self, state: DecodeState) -> Any:
        """A fresh per-generation state object for this stage (default: None, a stateless stage)."""
        return None

    def begin_block(self, local: Any, state: DecodeState) -> None:
        """Reset ``local`` (this stage's state object) at the start of block ``state.block_index``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"


class LayerHook(LayerHookProtocol):
    """The layer-hook contract of :class:`polestar.models.hooks.LayerHook` with do-nothing defaults: a refresh
    selector's :meth:`RefreshSelector.hook` returns a subclass for one step's forward (sparse updates).

    ``detail``: the step's :class:`~polestar.state.StepDetail` while an observer records (set by the step), else
    None.
    """

    detail = None


class RefreshSelector(Stage):
    """Decides which positions each layer recomputes (the :class:`~polestar.models.plan.Plan`) at each step.

    ``needs_hidden``: the cache must store every layer's input hidden states.
    """

    needs_hidden: bool = False

    def plan(self, state: DecodeState, cache: DecodeCache, local: Any) -> Plan:  # pragma: no cover - abstract
        raise NotImplementedError

    def allocate(self, local: Any, state: DecodeState, cache: DecodeCache, model) -> None:
        """Host-side preparation of a block, called after :meth:`begin_block` and outside the compiled step:
        allocate buffers (once; reuse them across blocks) and draw random numbers from ``state.generator``.
        Default: nothing."""

    def hook(self, state: DecodeState, plan: Plan, cache: DecodeCache, model, local: Any) -> LayerHook | None:
        """A :class:`LayerHook` for this step's forward (sparse updates), or None."""
        return None

    def probe(self, state: DecodeState, plan: Plan) -> AttentionProbe | None:
        """Attention rows this selector wants from the forward (default: none)."""
        return None

    def next_step_flags(self, state: DecodeState, local: Any) -> torch.Tensor | None:
        """Decisions for the next step, computed on the device at the end of this one: ``[F]`` bool or None. The
        loop reads them with its termination check (no extra host read) and hands them back as
        ``state.refresh_flags`` (Python bools) for the next step's :meth:`plan` and :meth:`hook`, so a selector
        can skip work no row needs (Polestar: no row is due for a sparse update) by choosing the step's shape."""
        return None

    def observe(self, state: DecodeState, plan: Plan, probe: torch.Tensor | None, cache: DecodeCache,
                local: Any) -> None:
        """Bookkeeping after the forward (drift histories, clusters); default: nothing."""


class CommitFloor(NamedTuple):
    """A commit rule's stated confidence floor: at temperature 0, one step commits at most ``exempt`` positions
    of a row (inside the block and after it together, the engine's forced top-1 commit included) whose
    confidence -- the proposed token's probability under :func:`~polestar.state.token_log_probs` -- is below
    ``probability``. ``probability`` 0 states no floor; such a rule says why in its docstring."""

    probability: float
    exempt: int


class CommitRule(Stage):
    """Decides which masked tokens of the current block a step commits.

    ``select(pred, masked, state, local)`` → :class:`~polestar.state.CommitSelection` (``commit [B, bl]`` bool).
    ``masked``: ``[B, bl]`` bool masked positions of active rows. The engine commits only masked positions and
    guarantees at least one commit per active row. ``needs_random``: the rule reads ``state.random.remask``
    (``[B, bl]`` uniform scores drawn before each step).
    """

    wants_packet: bool = False
    needs_random: bool = False

    def select(self, pred: Prediction, masked: torch.Tensor, state: DecodeState,
               local: Any) -> CommitSelection:  # pragma: no cover - abstract
        raise NotImplementedError

    def floor(self) -> CommitFloor:
        """The rule's :class:`CommitFloor` (default: no floor stated)."""
        return CommitFloor(0.0, 0)

    def probe(self, state: DecodeState, plan: Plan) -> AttentionProbe | None:
        """Attention rows this rule wants from the forward (default: none)."""
        return None

    def observe_probe(self, state: DecodeState, probs: torch.Tensor, local: Any) -> None:
        """Receives the probed attention ``[B, H, R, T+1]`` before ``select``."""

    def suffix(self, state: DecodeState, local: Any) -> SuffixCommit | None:
        """Commits outside the block (:class:`~polestar.state.SuffixCommit`) or None."""
        return None
