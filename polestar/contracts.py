"""What each stage kind must return, checked on the values a stage actually returns.

A stage's methods are pure and run inside the step; a wrong output (a drift of the wrong shape, a negative
drift) would otherwise surface far away (an index error in the refresh selector) or not at all. With checking on,
:func:`checked` wraps the contract methods of one stage instance, and the first output that breaks the contract
raises one :class:`StageContractError` naming the stage, the method and what it returned.

By default only stages from outside the package are checked (:func:`wanted`): a plugin file, an installed entry
point, a class of your own, whose first NaN or wrong shape would otherwise run on silently or crash far away. The
built-in stages are not (a check reads the device: every check is a host read).
``polestar.generate(..., check_stages=True)`` / ``polestar.assemble(..., check_stages=True)`` or the environment
variable ``POLESTAR_CHECK_STAGES=1`` check every stage; ``check_stages=False`` or ``POLESTAR_CHECK_STAGES=0`` none.
:mod:`polestar.testing` always checks.

A check runs on every call made eagerly, and never inside a compiled step or a captured graph (:func:`active`):
there the stage's method runs unchecked, and a checked stage stays compilable. With ``compile=True`` the first step
of each step phase runs eagerly with its checks and the rest of the decode compiles
(:class:`polestar.step.StepRunner`); the graphs that replay uncompiled steps on CUDA are captured after that
phase's eager, checked first step the same way (:class:`polestar.step_graphs.StepGraphs`).

Each kind's contract is part of its record (:attr:`polestar.stage_kinds.StageKind.contract`, declared next to
the kind's base class): method name → a check of what the method returns, built from :func:`fail` and
:func:`expect_tensor`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .stage_kinds import KINDS

ENV_SWITCH = "POLESTAR_CHECK_STAGES"

#: the instance attribute :func:`checked` sets on a stage it wrapped
MARK = "contract_checked"

_LOCAL = threading.local()


class StageContractError(ValueError):
    """A stage returned a value its kind's contract forbids; the message names the stage and what it returned."""


def _switch() -> bool | None:
    """``POLESTAR_CHECK_STAGES``: True or False when set (``0``, ``false``, ``no``: False), None when unset or empty."""
    value = os.environ.get(ENV_SWITCH, "").strip().lower()
    if not value:
        return None
    return value not in ("0", "false", "no", "off")


def enabled(check_stages: bool | None = None) -> bool:
    """Whether *every* stage is checked: ``check_stages`` when given, else whether ``POLESTAR_CHECK_STAGES`` is set
    to something other than 0."""
    if check_stages is not None:
        return bool(check_stages)
    return bool(_switch())


def wanted(stage, check_stages: bool | None = None) -> bool:
    """Whether ``stage``'s outputs are checked when its policy is assembled: ``check_stages`` when given, else
    ``POLESTAR_CHECK_STAGES`` when set, else only when the stage comes from outside the package
    (:func:`polestar.registry.is_builtin`)."""
    if check_stages is not None:
        return bool(check_stages)
    switch = _switch()
    if switch is not None:
        return switch
    from polestar.registry import is_builtin

    return not is_builtin(type(stage))


def origin(stage) -> str:
    """Where a stage from outside the package is defined (``" (defined in /path/mydrift.py)"``); empty for a
    built-in stage."""
    from polestar.registry import is_builtin, source_file

    cls = type(stage)
    if is_builtin(cls):
        return ""
    return f" (defined in {source_file(cls) or cls.__module__})"


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    if isinstance(value, tuple):
        return f"a {type(value).__name__} of {len(value)}: (" + ", ".join(_describe(v) for v in value) + ")"
    return f"a {type(value).__name__}"


def fail(stage, method: str, out: Any, problem: str) -> None:
    """Raise the :class:`StageContractError` of ``stage``'s ``method`` returning ``out``: ``problem`` says why."""
    raise StageContractError(f"{stage.kind} stage {stage.name!r} ({type(stage).__name__}.{method}) returned "
                             f"{_describe(out)}: {problem}{origin(stage)}")


def expect_tensor(stage, method: str, out: Any, shape: tuple[int, ...] | None, what: str) -> None:
    """``out`` must be a tensor (of ``shape`` unless None); ``what`` names the expected value in the error."""
    if not isinstance(out, torch.Tensor):
        fail(stage, method, out, f"expected {what}")
    if shape is not None and tuple(out.shape) != tuple(shape):
        fail(stage, method, out, f"expected {what} of shape {list(shape)}")


def contract(kind: str) -> Mapping[str, Callable[..., None]]:
    """Method name → check of what it returns, for stages of ``kind`` (its :class:`~polestar.stage_kinds.StageKind`
    record's contract; empty for a kind without one)."""
    record = KINDS.get(kind)
    return record.contract if record is not None else {}


def active() -> bool:
    """Whether a checked stage's checks run now: not while dynamo traces a compiled step (there a check's host read
    would break the graph) nor within :func:`suspended` on this thread."""
    return not torch.compiler.is_compiling() and not getattr(_LOCAL, "suspended", False)


@contextlib.contextmanager
def suspended():
    """Within: no check runs on this thread (a graph capture, which must not read the device). Nests."""
    before = getattr(_LOCAL, "suspended", False)
    _LOCAL.suspended = True
    try:
        yield
    finally:
        _LOCAL.suspended = before


def is_checked(stage) -> bool:
    """Whether :func:`checked` wrapped ``stage``'s contract methods."""
    return bool(getattr(stage, MARK, False))


def checked(stage):
    """Wrap, on this instance, every contract method of ``stage`` with its check; returns ``stage``. The check runs
    when :func:`active` (an eager call); inside a compiled step or a graph capture the method runs unchecked, and
    what it returns is never changed, so the stage keeps its ``compilable``."""
    for method, check in contract(stage.kind).items():
        bound = getattr(stage, method)

        @functools.wraps(bound)
        def wrapper(*args, _bound=bound, _check=check, **kwargs):
            out = _bound(*args, **kwargs)
            if active():
                _check(stage, out, *args, **kwargs)
            return out

        setattr(stage, method, wrapper)
    setattr(stage, MARK, True)
    return stage
