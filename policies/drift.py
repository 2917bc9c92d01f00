"""Drift metrics (kind ``drift``): how far an attention distribution moved between two steps.

Every metric maps ``cur, prev [B, H, R, T]`` (attention probabilities of ``R`` rows over ``T`` keys per head) to
``[B, R]`` fp32 ≥ 0, 0 for identical inputs. Source: Polestar (Lee et al. 2026) uses KL(current ‖ previous),
per head then averaged over heads; JS, cosine and uncertainty are the paper's ablations.
"""

from __future__ import annotations

import attrs
import torch

from polestar.kernels.drift import DEFAULT_EPS, cosine_drift, entropy, js_drift, kl_drift
from polestar.registry import register
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


@attrs.frozen
class EpsConfig:
    """``eps``: floor of probabilities inside logarithms."""

    eps: float = attrs.field(default=DEFAULT_EPS, validator=attrs.validators.gt(0))


class _PairwiseDrift(DriftMetric):
    """A row-wise divergence from :mod:`polestar.kernels.drift`, averaged over heads."""

    Config = EpsConfig

    def score(self, cur, prev):
        return type(self).divergence(cur, prev, self.config.eps).mean(dim=1)


@register("drift", "kl")
class KLDrift(_PairwiseDrift):
    """KL(cur ‖ prev) per head, averaged over heads (Polestar's drift). ``[B, H, R, T]`` ×2 → ``[B, R]``."""

    divergence = staticmethod(kl_drift)


@register("drift", "js")
class JSDrift(_PairwiseDrift):
    """Jensen–Shannon divergence per head, averaged over heads. ``[B, H, R, T]`` ×2 → ``[B, R]``."""

    divergence = staticmethod(js_drift)


@register("drift", "cosine")
class CosineDrift(_PairwiseDrift):
    """1 − cosine similarity of attention rows per head, averaged over heads. ``[B, H, R, T]`` ×2 → ``[B, R]``."""

    divergence = staticmethod(cosine_drift)


@register("drift", "uncertainty")
class UncertaintyDrift(DriftMetric):
    """Uncertainty ablation: entropy of the current distribution (``prev`` ignored), averaged over heads.
    ``[B, H, R, T]`` → ``[B, R]``."""

    @attrs.frozen
    class Config:
        pass

    def score(self, cur, prev):
        return entropy(cur.float().log()).mean(dim=1)  # softmax(log p) = p; log 0 = -inf contributes 0
