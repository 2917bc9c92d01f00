"""What each stage kind must return, checked on the values a stage actually returns.

A stage's methods are pure and run inside the step; a wrong output (a drift of the wrong shape, a negative
drift) would otherwise surface far away (an index error in the refresh selector) or not at all. With checking on,
:func:`checked` wraps the contract methods of one stage instance, and the first output that breaks the contract
raises one :class:`StageContractError` naming the stage, the method and what it returned.

By default only stages from outside the package are checked (:func:`wanted`): a plugin file, an installed entry
point, a class of your own, whose first NaN or wrong shape would otherwise run on silently or crash far away. The
built-in stages are not (a check reads the device: every check is a host read, and a checked stage makes the step
run eagerly). ``polestar.generate(..., check_stages=True)`` / ``polestar.assemble(..., check_stages=True)`` or the
environment variable ``POLESTAR_CHECK_STAGES=1`` check every stage; ``check_stages=False`` or
``POLESTAR_CHECK_STAGES=0`` none. :mod:`polestar.testing` always checks.

The contracts (shapes as in the base classes' docstrings):

* drift ``score(cur, prev)``: ``cur, prev [B, H, R, T]`` → ``[B, R]`` floating, finite, ≥ 0;
* cluster ``cluster(x [G, N, D], k, valid [G, N], ...)`` → ``(centroids [G, k, D], labels [G, N] integer in
  [-1, k), counts [G, k])``;
* quant ``decode(encode(x))``: ``encode`` then ``decode`` give back ``x``'s shape and dtype;
* offload ``read_rows(stored, rows [B, M], device)`` → a tuple of tensors ``[B, M, ...]``;
* refresh ``plan(state, cache, local)`` → a :class:`~polestar.models.plan.Plan` with integer ``index`` and bool
  ``valid`` of one shape ``[B, C]`` or ``[n_layers, B, C]``, ``index`` in ``[0, T]`` (``T``: the trash slot);
* commit ``select(pred, masked [B, bl], state, local)`` → a :class:`~polestar.state.CommitSelection` whose
  ``commit`` is bool ``[B, bl]``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

ENV_SWITCH = "POLESTAR_CHECK_STAGES"


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


def _fail(stage, method: str, out: Any, problem: str) -> None:
    raise StageContractError(f"{stage.kind} stage {stage.name!r} ({type(stage).__name__}.{method}) returned "
                             f"{_describe(out)}: {problem}{origin(stage)}")


def _tensor(stage, method: str, out: Any, shape: tuple[int, ...] | None, what: str) -> None:
    if not isinstance(out, torch.Tensor):
        _fail(stage, method, out, f"expected {what}")
    if shape is not None and tuple(out.shape) != tuple(shape):
        _fail(stage, method, out, f"expected {what} of shape {list(shape)}")


def check_drift(stage, out: Any, cur: torch.Tensor, prev: torch.Tensor) -> None:
    """``score(cur, prev)``: ``[B, R]`` floating, finite, ≥ 0."""
    _tensor(stage, "score", out, (cur.shape[0], cur.shape[2]), "a floating [B, R] tensor")
    if not out.is_floating_point():
        _fail(stage, "score", out, "expected a floating [B, R] tensor")
    if not torch.isfinite(out).all():
        _fail(stage, "score", out, "a drift must be finite; it holds NaN or inf")
    if (out < 0).any():
        _fail(stage, "score", out, f"a drift must be >= 0; its minimum is {out.min().item():.4g}")


def check_cluster(stage, out: Any, x: torch.Tensor, k: int, valid: torch.Tensor, *_: Any, **__: Any) -> None:
    """``cluster(x [G, N, D], k, valid, ...)`` → ``(centroids [G, k, D], labels [G, N] in [-1, k), counts [G, k])``."""
    G, N, D = x.shape
    if not isinstance(out, tuple) or len(out) != 3:
        _fail(stage, "cluster", out, "expected (centroids, labels, counts)")
    centroids, labels, counts = out
    _tensor(stage, "cluster", centroids, (G, k, D), "centroids [G, k, D]")
    _tensor(stage, "cluster", labels, (G, N), "labels [G, N]")
    _tensor(stage, "cluster", counts, (G, k), "counts [G, k]")
    if labels.is_floating_point() or ((labels < -1) | (labels >= k)).any():
        _fail(stage, "cluster", out, f"labels must be integers in [-1, {k})")
    if ((labels >= 0) & ~valid).any():
        _fail(stage, "cluster", out, "an invalid position got a cluster label (expected -1)")


def check_quant_round_trip(stage, x: torch.Tensor, y: Any) -> None:
    """``decode(encode(x))`` has ``x``'s shape and dtype."""
    _tensor(stage, "decode", y, tuple(x.shape), f"a {x.dtype} tensor")
    if y.dtype != x.dtype:
        _fail(stage, "decode", y, f"expected dtype {x.dtype} (the encoded input's)")


def check_quant_decode(stage, out: Any, packed: Any) -> None:
    """``decode(packed)`` is a floating tensor."""
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        _fail(stage, "decode", out, "expected a floating tensor [..., D]")


def check_rows(stage, out: Any, stored: Any, rows: torch.Tensor, device: Any) -> None:
    """``read_rows(stored, rows [B, M], device)`` → tuple of ``[B, M, ...]`` tensors."""
    if not isinstance(out, tuple) or not all(isinstance(t, torch.Tensor) for t in out):
        _fail(stage, "read_rows", out, "expected a tuple of tensors [B, M, ...]")
    for leaf in out:
        if tuple(leaf.shape[:2]) != tuple(rows.shape):
            _fail(stage, "read_rows", out, f"every leaf must start with the rows' shape {list(rows.shape)}")


def check_plan(stage, out: Any, state: Any, cache: Any, local: Any) -> None:
    """``plan(state, cache, local)`` → a Plan, integer index in ``[0, T]`` and bool valid of one shape."""
    from polestar.models.plan import Plan

    if not isinstance(out, Plan):
        _fail(stage, "plan", out, "expected a Plan(index, valid, target_offset)")
    index, valid = out.index, out.valid
    if index.shape != valid.shape or index.dim() not in (2, 3) or index.shape[-2] != state.x.shape[0]:
        _fail(stage, "plan", out, f"index and valid must share a shape [B, C] or [n_layers, B, C] with "
                                  f"B = {state.x.shape[0]}")
    if index.is_floating_point() or valid.dtype != torch.bool:
        _fail(stage, "plan", out, "index must be an integer tensor and valid a bool tensor")
    T = state.x.shape[1]
    if ((index < 0) | (index > T)).any():
        _fail(stage, "plan", out, f"index values must lie in [0, {T}] ({T}: the trash slot)")


def check_commit(stage, out: Any, pred: Any, masked: torch.Tensor, state: Any, local: Any) -> None:
    """``select(pred, masked [B, bl], state, local)`` → CommitSelection with bool ``commit [B, bl]``."""
    commit = getattr(out, "commit", None)
    if not isinstance(commit, torch.Tensor) or commit.dtype != torch.bool or commit.shape != masked.shape:
        _fail(stage, "select", out, f"expected a CommitSelection whose commit is bool {list(masked.shape)}")


#: kind → {method name: check(stage, output, *the method's arguments)}
CONTRACTS: dict[str, dict[str, Callable[..., None]]] = {
    "drift": {"score": check_drift},
    "cluster": {"cluster": check_cluster},
    "quant": {"decode": check_quant_decode},
    "offload": {"read_rows": check_rows},
    "refresh": {"plan": check_plan},
    "commit": {"select": check_commit},
}


def checked(stage):
    """Wrap, on this instance, every contract method of ``stage`` with its check; returns ``stage``. A checked
    stage is not compilable (its checks read the device), so the step runs eagerly."""
    for method, check in CONTRACTS.get(stage.kind, {}).items():
        bound = getattr(stage, method)

        @functools.wraps(bound)
        def wrapper(*args, _bound=bound, _check=check, **kwargs):
            out = _bound(*args, **kwargs)
            _check(stage, out, *args, **kwargs)
            return out

        setattr(stage, method, wrapper)
    stage.compilable = False
    return stage
