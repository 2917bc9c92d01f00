"""Per-step trace records of one decoded prompt: the engine's typed :class:`~polestar.state.StepRecord` of row 0,
read back to the host as plain Python values (a trace is a diagnostic: it reads every step's tensors).

Commit origins, in the order a committed position is classified (see :data:`ORIGINS`):

* ``suffix`` — committed outside the block by the commit rule's suffix commit (Polestar-Commit, from the update
  packet);
* ``early`` — admitted below the rule's threshold τ by its adaptive criterion (Polestar-Commit's drift-delta gate);
* ``forced`` — the row's most confident masked position committed below τ: the engine's progress guarantee, or a
  threshold rule's own top-1 fallback;
* ``confident`` — a rule commit with confidence ≥ τ;
* ``rule`` — any other rule commit (a rule without a threshold: LLaDA's fixed count, EB-sampler, KLASS; or below τ
  and not the top-1);
* ``eos`` — filled with EOS after the sequence committed a stop token.

A commit rule that revokes (WINO's narrow-out) puts the mask token back on committed positions: a step's
``revoked`` columns; such a position is committed again at a later step (a second :class:`Commit`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from polestar.state import StepRecord

from .stage_figure import StageFigure

#: commit origins, in classification order (see the module docstring)
ORIGINS = ("suffix", "early", "forced", "confident", "rule", "eos")


class Commit(NamedTuple):
    """One committed position: ``position`` (column of the whole sequence), ``token`` id, ``origin`` (one of
    :data:`ORIGINS`), ``confidence`` at commit (None for the EOS fill)."""

    position: int
    token: int
    origin: str
    confidence: float | None


class StepTrace(NamedTuple):
    """One decoding step of the traced prompt, as plain values.

    ``step``/``block``/``block_step``: indices over the generation, of the block, inside the block;
    ``block_start``/``block_end``: the block's columns; ``active``: the row decoded at this step; ``masked``: the
    block's masked columns before the commit; ``commits``: this step's :class:`Commit` s, by position;
    ``computed``: per layer, the columns the layer recomputed (the plan's, or the plan rows a feature-caching
    hook restricted the layer to); ``refreshed``: layer → columns a sparse update recomputed (members);
    ``weight_bytes``, ``kv_bytes``, ``layer_rows``, ``proxy_rows``: the step's cost counters; ``stages``: each stage
    figure's values of this step, by the figure's key (:meth:`~polestar.tracing.stage_figure.StageFigure.read`);
    ``revoked``: the committed columns the step masked again (a revoking commit rule), by position; ``verified``:
    layer → the columns whose rows the commit rule's own pass computed there (WINO's shadow block)."""

    step: int
    block: int
    block_step: int
    block_start: int
    block_end: int
    active: bool
    masked: tuple[int, ...]
    commits: tuple[Commit, ...]
    computed: tuple[tuple[int, ...], ...]
    refreshed: dict[int, tuple[int, ...]]
    weight_bytes: int
    kv_bytes: int
    layer_rows: int
    proxy_rows: int
    stages: dict[str, Any]
    revoked: tuple[int, ...] = ()
    verified: dict[int, tuple[int, ...]] = {}


def _positions(index: torch.Tensor, valid: torch.Tensor) -> tuple[int, ...]:
    return tuple(sorted(set(index[valid].tolist())))


def region_columns(record: StepRecord, row: int = 0) -> list[int]:
    """The columns of ``record``'s commit region in ``row`` (entry ``j`` of its ``masked``, ``confidence`` and
    origins): the block's, or a sliding window's."""
    if record.region is None:
        return list(range(record.block_start, record.block_start + record.masked.shape[1]))
    return record.region[row].tolist()


def commit_origins(record: StepRecord, threshold: float | None, row: int = 0) -> dict[int, tuple[str, float | None]]:
    """Column → ``(origin, confidence at commit)`` of every position ``record`` committed in ``row`` (see the module
    docstring; ``threshold``: the commit rule's τ, None for a rule without one)."""
    o, cols = record.origins, region_columns(record, row)
    conf = record.confidence[row]
    masked = record.masked[row]
    top1 = int(conf.masked_fill(~masked, float("-inf")).argmax()) if bool(masked.any()) else -1
    out: dict[int, tuple[str, float | None]] = {}
    if o.suffix is not None:
        for pos, c, ok in zip(o.suffix.positions[row].tolist(), o.suffix.confidence[row].tolist(),
                              o.suffix.commit[row].tolist()):
            if ok:
                out[pos] = ("suffix", float(c))
    early = o.early[row].tolist() if o.early is not None else [False] * masked.numel()
    for j, (rule, forced, is_early, c) in enumerate(zip(o.rule[row].tolist(), o.forced[row].tolist(), early,
                                                         conf.tolist())):
        if not (rule or forced):
            continue
        if is_early:
            origin = "early"
        elif forced or (threshold is not None and c < threshold and j == top1):
            origin = "forced"
        elif threshold is not None and c >= threshold:
            origin = "confident"
        else:
            origin = "rule"
        out[cols[j]] = (origin, float(c))
    for pos in record.committed[row].nonzero().flatten().tolist():
        out.setdefault(pos, ("eos", None))
    return out


class TraceRecorder:
    """An ``on_step`` observer (:func:`polestar.generate`) that keeps a :class:`StepTrace` of row 0 per step.

    ``threshold``: the commit rule's τ (None for a rule without one) that splits ``confident`` from the other
    origins; ``n_layers``: the model's layers; ``figures``: the stages' figures
    (:func:`~polestar.tracing.stage_figure.figures_of`), whose values each step keeps; ``steps``: the recorded
    steps."""

    def __init__(self, threshold: float | None, n_layers: int, figures: Sequence[StageFigure] = ()):
        self.threshold, self.n_layers, self.figures = threshold, n_layers, tuple(figures)
        self.steps: list[StepTrace] = []

    def __call__(self, record: StepRecord) -> None:
        self.steps.append(step_trace(record, self.threshold, self.n_layers, figures=self.figures))


def step_trace(record: StepRecord, threshold: float | None, n_layers: int, row: int = 0,
               figures: Sequence[StageFigure] = ()) -> StepTrace:
    """The :class:`StepTrace` of ``row`` in ``record`` (``n_layers``: the model's layers; ``figures``: the stage
    figures whose values it keeps)."""
    origins = commit_origins(record, threshold, row)
    after = record.tokens_after[row].tolist()
    commits = tuple(Commit(pos, after[pos], origin, c) for pos, (origin, c) in sorted(origins.items()))
    plan = record.plan
    if plan.per_layer:
        computed = tuple(_positions(plan.index[layer][row], plan.valid[layer][row]) for layer in range(n_layers))
    else:
        computed = (_positions(plan.index[row], plan.valid[row]),) * n_layers
    detail = record.detail
    refreshed, stages, verified = {}, {}, {}
    if detail is not None:
        computed = tuple(_positions(detail.computed[layer][0][row], detail.computed[layer][1][row])
                         if layer in detail.computed else cols for layer, cols in enumerate(computed))
        refreshed = {layer: _positions(pos[row], valid[row])
                     for layer, (pos, valid) in sorted(detail.refreshed.items())}
        stages = {figure.key: figure.read(detail.stages, row) for figure in figures}
        verified = {layer: tuple(sorted(pos[row][valid[row]].tolist()))
                    for layer, (pos, valid) in sorted(getattr(detail, "verified", {}).items())}
    cols = region_columns(record, row)
    masked = tuple(cols[j] for j in record.masked[row].nonzero().flatten().tolist())
    cost = record.cost
    revoked = getattr(record.origins, "revoked", None)
    revoked = () if revoked is None else tuple(sorted(cols[j] for j in revoked[row].nonzero().flatten().tolist()))
    return StepTrace(record.step, record.block_index, record.block_step, record.block_start, record.block_end,
                     bool(record.active[row]), masked, commits, computed, refreshed,
                     cost.weight_bytes if cost else 0, cost.kv_bytes if cost else 0, cost.layer_rows if cost else 0,
                     cost.probe_rows if cost else 0, stages, revoked, verified)
