"""Named scopes for ``polestar bench --profile``: the share of step time per pipeline stage.

Scopes are no-ops unless profiling is enabled (so compiled graphs never see them). ``profile_shares`` runs a
callable under ``torch.profiler`` and returns the time of each scope as a share of the total step time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

#: the step's own scopes: the forward pass (with whatever rides along it) and the commit rule
STEP_SCOPES = ("forward", "commit")
#: scopes inside the forward that stages declare where they are written (:func:`declare_scopes`), in order
FORWARD_SCOPES: list[str] = []
_ENABLED = False


def declare_scopes(*names: str) -> None:
    """Declare scopes a stage opens inside the forward pass (e.g. Polestar-Cache's ``proxy_attention``, ``drift``,
    ``cluster``, ``store``), so ``polestar bench --profile`` reports them as parts of the forward's time."""
    for name in names:
        if name in STEP_SCOPES:
            raise ValueError(f"scope {name!r} is one of the step's own scopes {STEP_SCOPES}")
        if name not in FORWARD_SCOPES:
            FORWARD_SCOPES.append(name)


def scope_names() -> tuple[str, ...]:
    """Every scope ``profile_shares`` reports: the step's own and the declared ones."""
    return (*STEP_SCOPES, *FORWARD_SCOPES)


def scope(name: str):
    """``with scope("drift"): ...`` — a ``torch.profiler.record_function`` while profiling, else nothing."""
    if not _ENABLED:
        return contextlib.nullcontext()
    return torch.profiler.record_function(f"polestar/{name}")


def profile_shares(fn: Callable[[], object]) -> dict[str, float]:
    """Run ``fn`` under the profiler; return ``{scope: seconds}`` plus ``"total"`` (wall time of ``fn``)."""
    global _ENABLED
    _ENABLED = True
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        with torch.profiler.profile(activities=activities) as prof:
            start = time.perf_counter()
            fn()
            total = time.perf_counter() - start
    finally:
        _ENABLED = False
    out = dict.fromkeys(scope_names(), 0.0)
    for evt in prof.key_averages():
        if evt.key.startswith("polestar/"):
            out[evt.key.split("/", 1)[1]] = evt.cpu_time_total / 1e6
    out["total"] = total
    return out
