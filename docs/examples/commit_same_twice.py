"""A commit rule (kind ``commit``) with per-generation state: commit a masked token once the model proposes the
same token for it at two consecutive steps.

Contract: ``select(pred, masked, state, local)`` -> ``CommitSelection(commit)`` with ``commit`` bool ``[B, bl]``
(``masked``: the block's masked positions of active rows; ``pred.tokens`` / ``pred.confidence``: ``[B, bl]``). The
engine commits only masked positions and at least one per active row. Per-generation state lives in the object
``init_state`` returns (``local``), reset by ``begin_block``; never on the stage itself.
"""

import attrs
import torch

import polestar
from polestar.stages import CommitRule
from polestar.state import CommitSelection
from polestar.testing import check_stage


@attrs.define
class StreakState:
    """The previous step's proposals ``[B, bl]`` (None at a block start)."""

    prev: torch.Tensor | None = None


@polestar.register("commit", "same-twice")
class SameTwice(CommitRule):
    """Commit masked tokens proposed identically at two consecutive steps, and always the most confident one.
    Shapes: tokens and confidence ``[B, bl]``."""

    @attrs.frozen
    class Config:
        pass

    def init_state(self, state):
        return StreakState()

    def begin_block(self, local, state):
        local.prev = None

    def select(self, pred, masked, state, local):
        conf = pred.confidence.masked_fill(~masked, float("-inf"))
        top = torch.zeros_like(masked).scatter_(1, conf.argmax(dim=1, keepdim=True), True)
        same = torch.zeros_like(masked) if local.prev is None else pred.tokens == local.prev
        local.prev = pred.tokens
        return CommitSelection(masked & (top | same))


if __name__ == "__main__":
    check_stage("commit", "same-twice", ["contract", "invariants"])
    model = polestar.load("tiny-llada")
    out = polestar.generate(model, ["3+4*2-5"], task="arith", policy="fast-dllm", commit="same-twice")
    print(out.texts[0], out.stats.nfe, "steps")
