"""A drift metric (kind ``drift``): the Hellinger distance between a row's attention now and one step earlier.

Contract: ``score(cur, prev)`` takes two attention tensors ``[B, H, R, T]`` (``R`` rows of probabilities over ``T``
keys per head) and returns ``[B, R]`` floating, finite, >= 0, and 0 where ``cur == prev``.
Consumers: the ``polestar`` refresh selector (which clusters to update) and the ``polestar`` commit rule (drift
delta), so it runs in the policies ``polestar`` and ``polestar-cache``.
"""

import attrs

import polestar
from polestar.policies.drift import DriftMetric
from polestar.testing import check_stage


@polestar.register("drift", "hellinger")
class HellingerDrift(DriftMetric):
    """Hellinger distance ``sqrt(1/2 * sum_t (sqrt(p_t) - sqrt(q_t))^2)`` per head, averaged over heads.
    ``[B, H, R, T]`` twice -> ``[B, R]`` in ``[0, 1]``."""

    @attrs.frozen
    class Config:
        pass

    def score(self, cur, prev):
        diff = cur.float().sqrt() - prev.float().sqrt()
        return diff.pow(2).sum(-1).mul(0.5).clamp_min(0).sqrt().mean(dim=1)


if __name__ == "__main__":
    check_stage("drift", "hellinger", ["contract", "laws"])  # the checks `pytest --polestar-stage` runs
    model = polestar.load("tiny-llada")
    out = polestar.generate(model, ["3+4*2-5"], task="arith", policy="polestar", drift="hellinger")
    print(out.texts[0], out.pipeline.describe()["drift"])
