"""Named scopes for ``polestar bench --profile``: the share of step time per pipeline stage.

Scopes are no-ops unless profiling is enabled (so compiled graphs never see them). ``profile_shares`` runs a
callable under ``torch.profiler`` and returns the time of each scope as a share of the total step time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

SCOPES = ("forward", "proxy_attention", "drift", "cluster", "store", "commit")
_ENABLED = False


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
    out = dict.fromkeys(SCOPES, 0.0)
    for evt in prof.key_averages():
        if evt.key.startswith("polestar/"):
            out[evt.key.split("/", 1)[1]] = evt.cpu_time_total / 1e6
    out["total"] = total
    return out
