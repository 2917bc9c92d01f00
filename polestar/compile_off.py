"""Why a decode on CUDA runs its steps uncaptured, said in one line.

On CUDA a step phase is captured as one CUDA graph and replayed (:class:`~polestar.step_graphs.StepGraphs`). A stage
that declares ``compilable = False`` (the ``cpu`` offloader, whose host copies and events cannot be captured; a
host-memory offloader of your own) turns the capture off for its pipeline (:func:`declared`): its steps then run as
Python, with the layer regions still compiled where ``compile`` asks for it. That is said once per process as one
WARNING line of this module's logger (``polestar.compile_off``; with no logging configured Python prints the bare
line on stderr), never silently.
"""

from __future__ import annotations

import logging

from . import registry

log = logging.getLogger(__name__)

#: reasons already reported in this process (each is said once, however many decodes meet it)
_REPORTED: set[str] = set()


def _describe(kind: str, stage) -> str:
    """``drift stage 'x' (XDrift, defined in /path/x.py)``; a built-in stage without its file."""
    cls = type(stage)
    where = "" if registry.is_builtin(cls) else f", defined in {registry.source_file(cls) or cls.__module__}"
    return f"{kind} stage {stage.name!r} ({cls.__name__}{where})"


def declared(pipeline) -> str | None:
    """The line saying why ``pipeline``'s steps are not captured as CUDA graphs because a stage declares
    ``compilable = False``; None when every stage is compilable."""
    off = [_describe(kind, stage) for kind, stage in pipeline.stages.items()
           if not getattr(stage, "compilable", True)]
    if not off:
        return None
    verb = "declares" if len(off) == 1 else "declare"
    return (f"CUDA-graph capture is off: {', '.join(off)} {verb} compilable = False; every step runs as Python "
            "(the layer regions still compile)")


def report(reason: str) -> None:
    """Log ``reason`` (one line) as a warning, once per process."""
    if reason in _REPORTED:
        return
    _REPORTED.add(reason)
    log.warning(reason)
