"""Base classes of the stage kinds the decoding loop calls every step."""

from __future__ import annotations

import torch

from polestar.models.backbone import AttentionProbe
from polestar.models.plan import DecodeCache, Plan

from .state import DecodeState, Prediction


class Stage:
    """A pipeline stage: a frozen attrs ``Config`` plus per-generation state kept in ``DecodeState.extras``."""

    kind: str
    name: str
    Config: type

    def __init__(self, config):
        self.config = config

    def bind(self, stages: dict) -> None:
        """Called once the pipeline is assembled with every stage by kind (for stages that compose others)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"


class RefreshSelector(Stage):
    """Decides which positions each layer recomputes (the :class:`~polestar.models.plan.Plan`) at each step.

    ``needs_hidden``: the cache must store every layer's input hidden states.
    """

    needs_hidden: bool = False

    def plan(self, state: DecodeState, cache: DecodeCache) -> Plan:  # pragma: no cover - abstract
        raise NotImplementedError

    def hook(self, state: DecodeState, plan: Plan, cache: DecodeCache, model):
        """A per-layer controller for this step's forward (sparse updates), or None. It exposes
        ``before_attention(layer, h, index)``, ``after_layer(layer)`` and ``evals`` (``[B]`` extra positions
        computed)."""
        return None

    def probe(self, state: DecodeState, plan: Plan) -> AttentionProbe | None:
        """Attention rows this selector wants from the forward (default: none)."""
        return None

    def observe(self, state: DecodeState, plan: Plan, probe: torch.Tensor | None, cache: DecodeCache) -> None:
        """Bookkeeping after the forward (drift histories, clusters); default: nothing."""


class CommitRule(Stage):
    """Decides which masked tokens of the current block a step commits.

    ``select(pred, masked, state)`` → ``[B, bl]`` bool. ``masked``: ``[B, bl]`` bool masked positions of active
    rows. The engine commits only masked positions and guarantees at least one commit per active row.
    """

    wants_packet: bool = False

    def select(self, pred: Prediction, masked: torch.Tensor, state: DecodeState) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def probe(self, state: DecodeState, plan: Plan) -> AttentionProbe | None:
        """Attention rows this rule wants from the forward (default: none)."""
        return None

    def observe_probe(self, state: DecodeState, probs: torch.Tensor) -> None:
        """Receives the probed attention ``[B, H, R, T+1]`` before ``select``."""

    def suffix(self, state: DecodeState):
        """Commits outside the block: ``(positions [B, N], tokens [B, N], commit [B, N] bool)`` or None."""
        return None
