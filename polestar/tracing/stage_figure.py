"""Figures a stage adds to a trace: the core draws what every policy has (commits, the recomputed positions, the
cost); a stage that gathers something of its own while an observer records (Polestar-Cache's cluster drifts,
Elastic-Cache's trigger layer) declares a :class:`StageFigure` in ``Stage.trace_figures`` that reads it back and
draws it. Its figure data is a :class:`FigureData`: plain values (written to ``trace.json``) that draw themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol


class FigureData(Protocol):
    """A stage figure's data for one policy's decode (a NamedTuple of plain values: ``trace.json`` holds its
    fields), with its drawings."""

    def html(self, policy, trace) -> list[str]:
        """The page's section for ``policy`` (a :class:`~polestar.tracing.figures.PolicyFigures`) of ``trace`` (a
        :class:`~polestar.tracing.run.Trace`): HTML parts (headings, notes, inline SVG)."""
        ...

    def png(self, policy, trace, out: Path) -> list[Path]:
        """The PNG figures for ``policy`` written into the folder ``out`` (matplotlib); their paths."""
        ...


class StageFigure(Protocol):
    """A figure of one stage. ``key``: the figure's name (its entry in ``PolicyFigures.stage_figures`` and in
    ``trace.json``). :meth:`read` turns one step's records (``detail.stages``: name → layer → tensors, see
    :class:`~polestar.state.StepDetail`) into plain values of one row; :meth:`series` makes the figure data from the
    steps' values (each :class:`~polestar.tracing.record.StepTrace` holds them in ``stages[key]``), or None when
    no step had any."""

    key: str

    def read(self, stages: dict[str, dict[int, Any]], row: int) -> Any:
        ...

    def series(self, steps: Sequence, n_layers: int, stage_names: dict[str, str]) -> FigureData | None:
        ...


def figures_of(pipeline) -> tuple[StageFigure, ...]:
    """The stage figures of every stage of ``pipeline``, in stage order."""
    return tuple(figure for stage in pipeline.stages.values() for figure in getattr(stage, "trace_figures", ()))
