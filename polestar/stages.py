"""Base classes of the stage kinds the decoding loop calls every step, and the stage lifecycle.

Lifecycle (every stage kind): a stage is a frozen config plus pure methods and keeps no per-generation state on
itself. When a generation's buffers are allocated the engine calls ``init_state(state)`` and keeps the returned
object (None for stateless stages): its tensors are preallocated once per shape and reused by later generations
of that shape (``begin_generation`` resets them in place). At each block start it calls ``begin_block(local,
state)``, and a refresh selector's :meth:`RefreshSelector.allocate` prepares the block on the host (buffers,
random draws). Before each step, ``phase(position, state, local)`` turns the loop's position into the step's
variant (:class:`~polestar.state.StepPhase`).

Everything per step runs inside one step function (:func:`polestar.step.decode_step`) that may be compiled whole
and replayed as a CUDA graph, so per-step methods:

* read no device value on the host (no ``.item()``, ``bool(tensor)``, ``.tolist()``, ``nonzero()``) and draw no
  random numbers;
* read positions from ``state.clock`` (device scalars) and their variant from ``state.phase``, never a Python int
  that changes per step;
* write what must outlive the step into ``local``'s preallocated tensors in place (``copy_``, ``zero_``, indexed
  writes), never by rebinding an attribute of ``local`` or ``state`` to a tensor the step computed.

What stages hand each other within a step travels in typed return values and arguments
(:class:`~polestar.state.CommitSelection`, :class:`~polestar.state.UpdatePacket`,
:class:`~polestar.state.SuffixCommit`) or in persistent fields of :class:`~polestar.state.DecodeState`
(``last_commits``). So one assembled pipeline can decode several generations at once.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Mapping
from typing import Any, NamedTuple

import attrs
import torch

from polestar.models.backbone import AttentionProbe
from polestar.models.cost import StepCost
from polestar.models.hooks import LayerHook as LayerHookProtocol
from polestar.models.plan import DecodeCache, Plan

from .contracts import fail
from .region import BlockRegion
from .stage_kinds import StageKind, register_kind
from .state import CommitSelection, DecodeState, Prediction, StepPosition, SuffixCommit, UpdatePacket


@attrs.frozen
class NoOptions:
    """The ``Config`` of a stage without options (what :class:`Stage` supplies when a stage declares none)."""


class Stage:
    """A pipeline stage: a frozen attrs ``Config`` and pure methods (see the module docstring for the lifecycle).
    A stage without options may leave ``Config`` out (it inherits :class:`NoOptions`).

    ``trace_figures``: figures this stage adds to ``polestar trace`` (:class:`polestar.tracing.stage_figure.
    StageFigure`: each reads what the stage gathered in :attr:`~polestar.state.StepDetail.stages` and draws it).
    ``requires``: the stage kinds this stage composes (it reads them in :meth:`bind`); where a policy names no stage
    of one, :func:`polestar.assemble` adds that kind's default (:attr:`polestar.stage_kinds.StageKind.default`).
    """

    kind: str
    name: str
    Config: type = NoOptions
    requires: tuple[str, ...] = ()
    trace_figures: tuple = ()

    def __init__(self, config):
        self.config = config

    def bind(self, stages: dict) -> None:
        """Called once the pipeline is assembled with every stage by kind (for stages that compose others)."""

    def init_state(self, state: DecodeState) -> Any:
        """A fresh per-generation state object for this stage (default: None, a stateless stage)."""
        return None

    def begin_generation(self, local: Any, state: DecodeState, cache: DecodeCache, model) -> None:
        """Reset ``local`` in place for a new generation (a fresh one, or a pooled one of the same shape reused for
        new prompts, whose buffers keep their addresses). Default: nothing."""

    def begin_block(self, local: Any, state: DecodeState) -> None:
        """Reset ``local`` (this stage's state object) in place at the start of a block (on the host)."""

    def phase(self, position: StepPosition, state: DecodeState, local: Any) -> Hashable:
        """This stage's entry of the step's :class:`~polestar.state.StepPhase`, decided on the host from the loop's
        :class:`~polestar.state.StepPosition`: plain hashable Python values that choose the step's shapes and
        branches (each distinct value is one compiled graph). Inside the step the stage reads it back as
        ``state.phase.refresh`` or ``state.phase.commit``; block and step positions are read from
        ``state.clock`` (device scalars), never from Python ints. Default: None (every step alike)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"


class LayerHook(LayerHookProtocol):
    """The layer-hook contract of :class:`polestar.models.hooks.LayerHook` with do-nothing defaults: a refresh
    selector's :meth:`RefreshSelector.hook` returns a subclass for one step's forward (sparse updates, a
    recomputation decided layer by layer).

    ``detail``: the step's :class:`~polestar.state.StepDetail` while an observer records (set by the step), else
    None.
    """

    detail = None

    def held(self) -> torch.Tensor | None:
        """``[B]`` bool, read by the step after the forward: rows whose forward is not complete at this step (it
        continues in the next one, e.g. a recomputation decided during this forward): they commit nothing and their
        forward is not counted here. Default: None (every forward completes in its step)."""
        return None


class AfterStep(NamedTuple):
    """What a refresh selector hands the loop at the end of a step (:meth:`RefreshSelector.after_step`):
    ``flags [F]`` bool, decisions for the next step that ride along the loop's one host read and come back in the
    next step's :class:`~polestar.state.StepPosition` (``flags``, Python bools) to :meth:`~Stage.phase`; ``cost``:
    the :class:`~polestar.models.cost.StepCost` of model work it did for them (added to the step's). Either None."""

    flags: torch.Tensor | None = None
    cost: StepCost | None = None


#: :meth:`RefreshSelector.after_step` of a selector with nothing to decide ahead
NOTHING_AHEAD = AfterStep()


class Capability(enum.Enum):
    """What a commit rule may need from the refresh selector's forward (:attr:`CommitRule.needs`), and a selector
    may not serve (:attr:`RefreshSelector.not_served`). :func:`polestar.assemble` refuses a composition whose commit
    rule needs what its selector does not serve, before any work, naming both stages and the reason."""

    #: the attention rows of the committed positions at a layer, from the forward itself (an attention probe)
    ATTENTION_PROBE = "the attention rows of the committed positions from the forward (an attention probe)"
    #: a commit region that is the current block, the same columns at every step of it
    BLOCK_REGION = "a commit region that is the current block"


class RefreshSelector(Stage):
    """Decides which positions each layer recomputes (the :class:`~polestar.models.plan.Plan`) at each step.

    The engine calls, per step: :meth:`plan` (required), :meth:`hook` and :meth:`after_step`; per block:
    :meth:`allocate`; once: :meth:`region`. Anything else a selector needs lives in its own state object and its
    hook. ``needs_hidden``: the cache must store every layer's input hidden states.
    """

    needs_hidden: bool = False
    #: what this selector's forward does not serve a commit rule (:class:`Capability`), each with the reason
    not_served: Mapping[Capability, str] = {}

    def region(self):
        """The commit-region schedule this selector plans for (:mod:`polestar.region`): default the current block
        (:class:`~polestar.region.BlockRegion`); a selector may return a sliding window
        (:class:`~polestar.region.WindowRegion`), whose columns move every step and differ per row."""
        return BlockRegion()

    def plan(self, state: DecodeState, cache: DecodeCache, local: Any) -> Plan:  # pragma: no cover - abstract
        raise NotImplementedError

    def allocate(self, local: Any, state: DecodeState, cache: DecodeCache, model, position: StepPosition) -> None:
        """Host-side preparation of the block at ``position``, called after :meth:`begin_block` and outside the
        compiled step: allocate buffers (once per shape; reuse them across blocks and generations) and draw random
        numbers from ``state.generator`` into them. Default: nothing."""

    def hook(self, state: DecodeState, plan: Plan, cache: DecodeCache, model, local: Any) -> LayerHook | None:
        """A :class:`LayerHook` for this step's forward (sparse updates; rows :meth:`LayerHook.held` over to the next
        step), or None. The hook gets what it runs on the model as a :class:`~polestar.models.layer_ops.LayerOps`
        view of ``model``, not the model."""
        return None

    def after_step(self, state: DecodeState, cache: DecodeCache, model, local: Any) -> AfterStep:
        """After the step's commits, in the step: decisions for the next step, computed on the device
        (:class:`AfterStep`: flags for the loop's one host read, so a selector can choose the next step's variant
        and skip work no row needs -- Polestar: no row is due for a sparse update), and the cost of any model work
        they took. Default: :data:`NOTHING_AHEAD`."""
        return NOTHING_AHEAD


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
    guarantees at least one commit per active row. A rule may also take committed tokens of the block back
    (``CommitSelection.revoke``): the engine masks them again (:func:`~polestar.state.revocations`).
    ``needs_random``: the rule reads ``state.random.remask`` (``[B, bl]`` uniform scores drawn before each step).
    """

    wants_packet: bool = False
    needs_random: bool = False
    #: what this rule needs from the refresh selector's forward (:class:`Capability`)
    needs: frozenset = frozenset()

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

    def verify(self, state: DecodeState, cache: DecodeCache, model, local: Any) -> StepCost | None:
        """Model work of the rule's own, in the step after the forward and before :meth:`select`, its results
        written into ``local`` in place (WINO's shadow block re-scores the block's committed tokens over the K/V
        the forward just wrote): its :class:`~polestar.models.cost.StepCost`, added to the step's, or None (no
        work; the default)."""
        return None

    def suffix(self, state: DecodeState, local: Any, packet: UpdatePacket | None) -> SuffixCommit | None:
        """Commits outside the block (:class:`~polestar.state.SuffixCommit`) or None; ``packet``: this step's
        :class:`~polestar.state.UpdatePacket` from the refresh selector's sparse update, or None."""
        return None


def check_plan(stage, out: Any, state: DecodeState, cache: DecodeCache, local: Any) -> None:
    """``plan(state, cache, local)`` → a Plan with integer ``index`` in ``[0, T]`` (``T``: the trash slot) and bool
    ``valid`` of one shape ``[B, C]`` or ``[n_layers, B, C]``."""
    if not isinstance(out, Plan):
        fail(stage, "plan", out, "expected a Plan(index, valid, target_offset)")
    index, valid = out.index, out.valid
    if index.shape != valid.shape or index.dim() not in (2, 3) or index.shape[-2] != state.x.shape[0]:
        fail(stage, "plan", out, f"index and valid must share a shape [B, C] or [n_layers, B, C] with "
                                 f"B = {state.x.shape[0]}")
    if index.is_floating_point() or valid.dtype != torch.bool:
        fail(stage, "plan", out, "index must be an integer tensor and valid a bool tensor")
    T = state.x.shape[1]
    if ((index < 0) | (index > T)).any():
        fail(stage, "plan", out, f"index values must lie in [0, {T}] ({T}: the trash slot)")


def check_commit(stage, out: Any, pred: Prediction, masked: torch.Tensor, state: DecodeState, local: Any) -> None:
    """``select(pred, masked [B, bl], state, local)`` → a CommitSelection whose ``commit`` is bool ``[B, bl]``."""
    commit = getattr(out, "commit", None)
    if not isinstance(commit, torch.Tensor) or commit.dtype != torch.bool or commit.shape != masked.shape:
        fail(stage, "select", out, f"expected a CommitSelection whose commit is bool {list(masked.shape)}")


REFRESH = register_kind(StageKind(
    "refresh", RefreshSelector, "which positions each layer recomputes at each step (the cache policy)",
    engine_driven=True, contract={"plan": check_plan}))

COMMIT = register_kind(StageKind(
    "commit", CommitRule, "which masked tokens of the block a step commits", engine_driven=True,
    contract={"select": check_commit}))
