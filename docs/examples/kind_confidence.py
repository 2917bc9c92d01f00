"""A new stage kind, ``confidence``, in one file: how sure the model is of each proposed token, read by a commit rule.

A kind is a :class:`~polestar.stage_kinds.StageKind` record: its base class, the contract of what its methods
return (checked on every output of a stage from outside the package, and by ``polestar.testing``), example inputs
and the laws the property tests check on them, and a one-line summary. Once declared with ``register_kind``, the
kind is a registry namespace (``polestar.register("confidence", ...)``), a key of policies and overrides
(``confidence=margin``) and a valid ``check_stage`` target, with no other file edited.
"""

import attrs
import torch

import polestar
from polestar.contracts import expect_tensor, fail
from polestar.policy import PolicySpec
from polestar.stage_kinds import StageKind, register_kind
from polestar.stages import CommitRule, Stage
from polestar.state import CommitSelection
from polestar.testing import check_stage


class ConfidenceMeasure(Stage):
    """Base of kind ``confidence``: ``score(log_probs [B, bl, V])`` → ``[B, bl]`` in ``[0, 1]``, 1 where the
    distribution is one-hot. ``log_probs``: the step's token log-probabilities (``Prediction.log_probs``)."""

    def score(self, log_probs: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def check_confidence(stage, out, log_probs):
    """The contract of ``score``: ``[B, bl]``, finite, in ``[0, 1]``."""
    expect_tensor(stage, "score", out, tuple(log_probs.shape[:2]), "a [B, bl] tensor")
    if not torch.isfinite(out).all() or (out < 0).any() or (out > 1 + 1e-6).any():
        fail(stage, "score", out, "a confidence must lie in [0, 1]")


def confidence_examples(gen, n):
    """``n`` seeded inputs ``(log_probs [B, bl, V],)``, flat to peaked distributions."""
    for i in range(n):
        b, bl, vocab = (int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((1, 4), (1, 9), (2, 41)))
        logits = torch.randn(b, bl, vocab, generator=gen, dtype=torch.float64) * (0.1, 1.0, 8.0)[i % 3]
        yield (logits.log_softmax(-1),)


def confidence_laws(stage, log_probs):
    """The same scores twice, and 1 on one-hot distributions."""
    assert torch.equal(stage.score(log_probs), stage.score(log_probs.clone())), (
        f"confidence stage {stage.name!r} is not deterministic")
    one_hot = torch.full_like(log_probs, float("-inf")).scatter(-1, log_probs.argmax(-1, keepdim=True), 0.0)
    sure = stage.score(one_hot)
    assert torch.allclose(sure, torch.ones_like(sure)), f"confidence stage {stage.name!r} is not 1 on one-hot rows"


register_kind(StageKind(
    "confidence", ConfidenceMeasure, "how sure the model is of each proposed token",
    contract={"score": check_confidence}, examples=confidence_examples, laws=confidence_laws, default="margin"))


@polestar.register("confidence", "margin")
class Margin(ConfidenceMeasure):
    """The top-1 probability minus the top-2 one."""

    @attrs.frozen
    class Config:
        pass

    def score(self, log_probs):
        top = log_probs.exp().topk(2, dim=-1).values
        return top[..., 0] - top[..., 1]


@polestar.register("commit", "confident")
class ConfidentCommit(CommitRule):
    """Commit every masked token whose ``confidence`` stage scores at least ``threshold``, and always the most
    probable one. Shapes: ``[B, bl]``."""

    requires = ("confidence",)

    @attrs.frozen
    class Config:
        threshold: float = attrs.field(default=0.8, validator=[attrs.validators.ge(0), attrs.validators.le(1)])

    def bind(self, stages):
        self.measure = stages["confidence"]

    def select(self, pred, masked, state, local):
        best = pred.confidence.masked_fill(~masked, float("-inf")).argmax(dim=1, keepdim=True)
        top = torch.zeros_like(masked).scatter_(1, best, True)
        sure = self.measure.score(pred.log_probs) >= self.config.threshold
        return CommitSelection(masked & (top | sure))


polestar.register_policy(PolicySpec(
    "fast-dllm-margin", {"refresh": "dual", "commit": "confident", "confidence": "margin"},
    description="Fast-dLLM dual cache + commit where the top-1 / top-2 margin is at least the threshold"))


if __name__ == "__main__":
    check_stage("confidence", "margin", ["contract", "laws", "invariants"])
    model = polestar.load("tiny-llada")
    out = polestar.generate(model, ["3+4*2-5"], task="arith", policy="fast-dllm-margin")
    print(out.texts[0], out.stats.nfe, "steps")
