"""Why a decode asked to compile runs eagerly, said in one line.

``compile=True`` falls back to eager steps in two cases, and says so, never silently:

* a stage declares ``compilable = False`` (the ``cpu`` offloader, a host-memory offloader of your own): known when
  the :class:`~polestar.step.StepRunner` is made (:func:`declared`), and every step runs eagerly;
* ``torch.compile`` cannot trace the step of a pipeline with a stage from outside the package (a plugin that reads
  a tensor's value on the host, a Python branch on a tensor): met at the first compile of a step phase
  (:func:`refused`), and the rest of the decode runs eagerly. A built-in pipeline that does not trace is a bug of
  the package: its error is raised as it is.

Each reason is one WARNING line of this module's logger (``polestar.compile_off``; with no logging configured
Python prints the bare line on stderr), once per process (:func:`report`); ``RunStats.compiled_steps`` counts the
steps that did compile.
"""

from __future__ import annotations

import logging
import re

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
    """The line saying why ``pipeline``'s steps cannot compile because a stage declares ``compilable = False``;
    None when every stage is compilable."""
    off = [_describe(kind, stage) for kind, stage in pipeline.stages.items()
           if not getattr(stage, "compilable", True)]
    if not off:
        return None
    verb = "declares" if len(off) == 1 else "declare"
    return f"compile is off: {', '.join(off)} {verb} compilable = False; every step runs eagerly"


def outside_stages(pipeline) -> list[str]:
    """``pipeline``'s stages from outside the package (:func:`polestar.registry.is_builtin`), described."""
    return [_describe(kind, stage) for kind, stage in pipeline.stages.items() if not registry.is_builtin(type(stage))]


def refused(pipeline, err: Exception) -> str | None:
    """The line saying why ``torch.compile`` stopped (``err``, dynamo's error, whose first line names the cause and
    whose user frame names the code) on a pipeline with stages from outside the package; None for a pipeline of
    built-in stages only (their error is a bug to raise)."""
    outside = outside_stages(pipeline)
    if not outside:
        return None
    cause = _cause(err)
    stack = getattr(err, "real_stack", None)
    where = f" at {stack[-1].filename}:{stack[-1].lineno} in {stack[-1].name}" if stack else ""
    return (f"compile is off: torch.compile cannot trace the step with {', '.join(outside)}: {cause}{where}; the "
            "remaining steps run eagerly")


#: parts of dynamo's first error line that are advice or internals, not the cause
_NOISE = re.compile(r"Consider annotating your code using torch\._check\*\(\)\.|"
                    r"\((?:unhinted|Size-like symbols):(?:[^()]|\([^()]*\))*\)")


def _cause(err: Exception) -> str:
    """The first line of dynamo's error, without its advice and internals (:data:`_NOISE`)."""
    first = (str(err).strip().splitlines() or [""])[0]
    return " ".join(_NOISE.sub("", first).split()).rstrip(". ") or type(err).__name__


def report(reason: str) -> None:
    """Log ``reason`` (one line) as a warning, once per process."""
    if reason in _REPORTED:
        return
    _REPORTED.add(reason)
    log.warning(reason)
