"""Figure data of a trace, computed from the per-step :class:`~polestar.tracing.record.StepTrace` s of one policy:
what the HTML page and the PNG figures draw, as plain values (so a test can check them against the records).

* :class:`CommitGrid` — position × step: the step each generated position was committed, its origin and
  confidence, the positions that were still masked in the current block at each step, the final tokens;
* :class:`RefreshGrid` — per layer, position × step: the columns the step's plan recomputed and the members each
  sparse update recomputed;
* :class:`CostSeries` — per step: rows computed, weight bytes, proxy rows and K/V bytes;
* the stages' own figures (:mod:`polestar.tracing.stage_figure`: Polestar-Cache's cluster drifts, Elastic-Cache's
  trigger layer), made by the figures the stages declare.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from .record import StepTrace
from .stage_figure import StageFigure


class CommitCell(NamedTuple):
    """A generated ``position`` (column of the sequence), the ``step`` that committed it, its ``origin``, its
    ``confidence`` at commit (None for the EOS fill) and its final ``token`` id."""

    position: int
    step: int
    origin: str
    confidence: float | None
    token: int


class CommitGrid(NamedTuple):
    """``cells``: one :class:`CommitCell` per committed position, by position; ``waiting``: ``(position, step)``
    of every position masked in the current block at a step that did not commit it; ``start``/``end``: the
    generated columns ``[start, end)``; ``block_starts``: each block's first column; ``n_steps``: steps taken;
    ``revoked``: ``(position, step)`` of every committed position a step masked again (a revoking commit rule)."""

    cells: tuple[CommitCell, ...]
    waiting: tuple[tuple[int, int], ...]
    start: int
    end: int
    block_starts: tuple[int, ...]
    n_steps: int
    revoked: tuple[tuple[int, int], ...] = ()


class RefreshGrid(NamedTuple):
    """Per layer and step (``[layer][step]``): ``computed`` the columns the forward's plan recomputed,
    ``refreshed`` the columns a sparse update recomputed (empty where none ran); ``length``: the sequence's
    columns; ``has_updates``: any sparse update ran; ``verified``: the columns of the rows the commit rule's own
    pass computed (WINO's shadow block; empty where none ran)."""

    computed: tuple[tuple[tuple[int, ...], ...], ...]
    refreshed: tuple[tuple[tuple[int, ...], ...], ...]
    length: int
    verified: tuple[tuple[tuple[int, ...], ...], ...] = ()

    @property
    def has_updates(self) -> bool:
        return any(cols for layer in self.refreshed for cols in layer)


class CostSeries(NamedTuple):
    """Per step: ``layer_rows`` rows through a layer's MLP (summed over layers), ``weight_bytes``, ``proxy_rows``
    query-only rows, ``kv_bytes``."""

    layer_rows: tuple[int, ...]
    weight_bytes: tuple[int, ...]
    proxy_rows: tuple[int, ...]
    kv_bytes: tuple[int, ...]


def commit_grid(steps: Sequence[StepTrace], start: int, end: int, block_length: int,
                final: Sequence[int]) -> CommitGrid:
    """The :class:`CommitGrid` of a generation over columns ``[start, end)``; ``final``: the tokens of the whole
    sequence after decoding."""
    cells = []
    waiting = []
    revoked = [(p, s.step) for s in steps for p in getattr(s, "revoked", ()) if start <= p < end]
    for s in steps:
        done = {c.position for c in s.commits}
        waiting += [(p, s.step) for p in s.masked if p not in done]
        cells += [CommitCell(c.position, s.step, c.origin, c.confidence, final[c.position])
                  for c in s.commits if start <= c.position < end]
    return CommitGrid(tuple(sorted(cells)), tuple(waiting), start, end, tuple(range(start, end, block_length)),
                      len(steps), tuple(revoked))


def refresh_grid(steps: Sequence[StepTrace], n_layers: int, length: int) -> RefreshGrid:
    """The :class:`RefreshGrid` of a generation with ``n_layers`` layers and ``length`` columns."""
    computed = tuple(tuple(s.computed[layer] for s in steps) for layer in range(n_layers))
    refreshed = tuple(tuple(s.refreshed.get(layer, ()) for s in steps) for layer in range(n_layers))
    verified = tuple(tuple(getattr(s, "verified", {}).get(layer, ()) for s in steps) for layer in range(n_layers))
    return RefreshGrid(computed, refreshed, length, verified)


def cost_series(steps: Sequence[StepTrace]) -> CostSeries:
    """The :class:`CostSeries` of the steps."""
    return CostSeries(tuple(s.layer_rows for s in steps), tuple(s.weight_bytes for s in steps),
                      tuple(s.proxy_rows for s in steps), tuple(s.kv_bytes for s in steps))


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where two token sequences differ (the shorter one's end when one is a prefix of the
    other), None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class PolicyFigures(NamedTuple):
    """Every figure's data for one policy: ``policy`` its name, ``stages`` its stage names, ``tokens`` the whole
    sequence after decoding, ``labels`` a short label per column (its final token), ``text`` the decoded
    generation, ``nfe`` steps taken, ``stage_figures`` the stages' figure data by figure key
    (:class:`~polestar.tracing.stage_figure.FigureData`; only those with something to draw)."""

    policy: str
    stages: dict[str, str]
    commit: CommitGrid
    refresh: RefreshGrid
    cost: CostSeries
    tokens: tuple[int, ...]
    labels: tuple[str, ...]
    text: str
    nfe: int
    stage_figures: dict[str, Any]


def policy_figures(policy: str, stages: dict[str, str], steps: Sequence[StepTrace], prompt_len: int,
                   block_length: int, final: Sequence[int], labels: Sequence[str], text: str,
                   n_layers: int, figures: Sequence[StageFigure] = ()) -> PolicyFigures:
    """Every figure's data for one policy's decode (``final``: the whole sequence's tokens, ``labels`` one short
    label per column; ``figures``: the stages' figures)."""
    length = len(final)
    made = {figure.key: figure.series(steps, n_layers, dict(stages)) for figure in figures}
    return PolicyFigures(policy, dict(stages), commit_grid(steps, prompt_len, length, block_length, final),
                         refresh_grid(steps, n_layers, length), cost_series(steps), tuple(final), tuple(labels), text,
                         len(steps), {key: data for key, data in made.items() if data is not None})
