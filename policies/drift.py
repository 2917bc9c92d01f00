"""Drift metrics (kind ``drift``): how far an attention distribution moved between two steps.

Every metric maps ``cur, prev [B, H, R, T]`` (attention probabilities of ``R`` rows over ``T`` keys per head) to
``[B, R]`` fp32 ≥ 0, 0 for identical inputs. Source: Polestar (Lee et al. 2026) uses KL(current ‖ previous),
per head then averaged over heads; JS, cosine and uncertainty are the paper's ablations.
"""

from __future__ import annotations

import attrs
import torch

from polestar.contracts import expect_tensor, fail
from polestar.kernels.drift import DEFAULT_EPS, cosine_drift, entropy, js_drift, kl_drift
from polestar.kernels.drift_keep import METRICS, drift_keep
from polestar.registry import register
from polestar.stage_kinds import StageKind, register_kind
from polestar.stages import Stage


class DriftMetric(Stage):
    """Base of drift metrics (kind ``drift``): how far each row's attention moved between two steps.

    Read by the ``polestar`` refresh selector (which clusters of the window to update) and the ``polestar`` commit
    rule (the drift delta of its early commits). Example: ``docs/examples/drift_hellinger.py``.
    """

    def score(self, cur: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        """``cur, prev [B, H, R, T]`` (attention probabilities of ``R`` rows over ``T`` keys per head, now and one
        step earlier) → ``[B, R]`` floating, finite, ≥ 0, and 0 where ``cur == prev`` (a metric of ``cur`` alone,
        like the entropy ablation, is 0 on one-hot rows). A pure function of its inputs: no random draws, no host
        reads."""
        raise NotImplementedError

    def score_keep(self, cur: torch.Tensor, prev: torch.Tensor, due: torch.Tensor) -> torch.Tensor:
        """:meth:`score` of ``cur`` against ``prev``, then ``prev`` rewritten in place with ``cur`` in the rows due
        (``due [B]`` bool): what a sparse-update step does with each layer's proxy attention. Equal to ``score``
        followed by ``torch.where(due, cur, prev, out=prev)`` (checked by the laws); a metric may do both in one
        operation (the built-in divergences do)."""
        drift = self.score(cur, prev)
        torch.where(due[:, None, None, None], cur, prev, out=prev)
        return drift


def check_drift(stage, out, cur: torch.Tensor, prev: torch.Tensor) -> None:
    """``score(cur, prev)``: ``[B, R]`` floating, finite, ≥ 0. Its tests read the device, so they run on eager
    calls only (a compiled step runs the stage unchecked, :func:`polestar.contracts.checked`); built-in stages are
    checked only when asked."""
    expect_tensor(stage, "score", out, (cur.shape[0], cur.shape[2]), "a floating [B, R] tensor")
    if not out.is_floating_point():
        fail(stage, "score", out, "expected a floating [B, R] tensor")
    if not torch.isfinite(out).all():
        fail(stage, "score", out, "a drift must be finite; it holds NaN or inf")
    if (out < 0).any():
        fail(stage, "score", out, f"a drift must be >= 0; its minimum is {out.min().item():.4g}")


def check_drift_keep(stage, out, cur: torch.Tensor, prev: torch.Tensor, due: torch.Tensor) -> None:
    """``score_keep(cur, prev, due)``: a drift as :func:`check_drift` requires (the laws check that it equals
    ``score`` and that ``prev`` keeps ``cur`` in the rows due)."""
    check_drift(stage, out, cur, prev)


def drift_examples(gen: torch.Generator, n: int):
    """``n`` attention pairs ``(cur, prev) [B, H, R, T]`` of random sizes, near-uniform to near-one-hot rows."""
    for i in range(n):
        b, h, r, t = (int(torch.randint(1, m + 1, (1,), generator=gen)) for m in (2, 3, 3, 24))
        sharp = (0.1, 1.0, 8.0)[i % 3]
        cur = (torch.randn(b, h, r, t, generator=gen) * sharp).softmax(-1)
        prev = (torch.randn(b, h, r, t, generator=gen) * sharp).softmax(-1)
        yield cur, prev


def drift_laws(metric: DriftMetric, cur: torch.Tensor, prev: torch.Tensor) -> None:
    """The same scores twice, and 0 on equal inputs — or, for a metric that ignores ``prev``, 0 on one-hot rows."""
    score = metric.score(cur, prev)
    again = metric.score(cur.clone(), prev.clone())
    assert torch.equal(score, again), f"drift stage {metric.name!r} is not deterministic: the same inputs scored " \
        f"differently (max difference {(score - again).abs().max().item():.3g})"
    ignores_prev = torch.equal(score, metric.score(cur, cur.flip(-1)))
    probe = cur if not ignores_prev else torch.nn.functional.one_hot(cur.argmax(-1), cur.shape[-1]).float()
    zero = metric.score(probe, probe)
    assert torch.allclose(zero, torch.zeros_like(zero), atol=1e-5), (
        f"drift stage {metric.name!r} is not 0 on equal inputs (max {zero.abs().max().item():.3g})")
    due = torch.arange(cur.shape[0]) % 2 == 0
    kept = prev.clone()
    assert torch.equal(metric.score_keep(cur, kept, due), score), (
        f"drift stage {metric.name!r}: score_keep scored otherwise than score")
    assert torch.equal(kept, torch.where(due[:, None, None, None], cur, prev)), (
        f"drift stage {metric.name!r}: score_keep must rewrite prev with cur in the rows due, and only there")


DRIFT = register_kind(StageKind(
    "drift", DriftMetric, "how far each row's attention moved between two steps",
    contract={"score": check_drift, "score_keep": check_drift_keep}, examples=drift_examples, laws=drift_laws,
    default="kl"))


@attrs.frozen
class EpsConfig:
    """``eps``: floor of probabilities inside logarithms."""

    eps: float = attrs.field(default=DEFAULT_EPS, validator=attrs.validators.gt(0))


class _PairwiseDrift(DriftMetric):
    """A row-wise divergence from :mod:`polestar.kernels.drift`, averaged over heads; :meth:`score_keep` is one
    operation (:func:`~polestar.kernels.drift_keep.drift_keep`: the divergence, its head mean and the rows' keep)."""

    Config = EpsConfig
    #: the divergence's id in :data:`polestar.kernels.drift_keep.METRICS`
    metric: str

    def score(self, cur, prev):
        return type(self).divergence(cur, prev, self.config.eps).mean(dim=1)

    def score_keep(self, cur, prev, due):
        return drift_keep(cur, prev, due, METRICS[self.metric], self.config.eps)


@register("drift", "kl")
class KLDrift(_PairwiseDrift):
    """KL(cur ‖ prev) per head, averaged over heads (Polestar's drift). ``[B, H, R, T]`` ×2 → ``[B, R]``."""

    divergence = staticmethod(kl_drift)
    metric = "kl"


@register("drift", "js")
class JSDrift(_PairwiseDrift):
    """Jensen–Shannon divergence per head, averaged over heads. ``[B, H, R, T]`` ×2 → ``[B, R]``."""

    divergence = staticmethod(js_drift)
    metric = "js"


@register("drift", "cosine")
class CosineDrift(_PairwiseDrift):
    """1 − cosine similarity of attention rows per head, averaged over heads. ``[B, H, R, T]`` ×2 → ``[B, R]``."""

    divergence = staticmethod(cosine_drift)
    metric = "cosine"


@register("drift", "uncertainty")
class UncertaintyDrift(DriftMetric):
    """Uncertainty ablation: entropy of the current distribution (``prev`` ignored), averaged over heads.
    ``[B, H, R, T]`` → ``[B, R]``."""

    @attrs.frozen
    class Config:
        pass

    def score(self, cur, prev):
        return entropy(cur.float().log()).mean(dim=1)  # softmax(log p) = p; log 0 = -inf contributes 0
