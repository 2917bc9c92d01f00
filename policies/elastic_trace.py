"""Elastic-Cache's figure in ``polestar trace``: per step, the tracked keys' attention similarity at each layer and
the layer from which the step recomputed every position (:class:`TriggerFigure`, declared by the ``elastic``
refresh selector; its hooks gather ``(similarity [B], triggered [B])`` per layer under ``"trigger"``)."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import NamedTuple

from polestar.tracing.html import LEFT, svg_figure, svg_rect, svg_text

#: where the hooks keep each layer's ``(similarity [B], triggered [B] bool)`` in ``detail.stages``
TRIGGER = "trigger"


class TriggerStep(NamedTuple):
    """One row at one step: ``similarity`` per layer (layer → cosine similarity of the tracked keys' attention with
    the previous step's) and ``layer``, the first layer where it triggered (recomputed from there up), else None."""

    similarity: dict[int, float]
    layer: int | None


class TriggerSeries(NamedTuple):
    """Elastic-Cache's trigger: ``steps`` with a trigger test; ``similarity[i][layer]`` the tracked keys'
    attention similarity at ``steps[i]``; ``trigger[i]`` the first triggered layer (None: no recompute)."""

    steps: tuple[int, ...]
    similarity: tuple[tuple[float, ...], ...]
    trigger: tuple[int | None, ...]

    def html(self, policy, trace) -> list[str]:
        """The page's trigger section (:func:`trigger_svg`)."""
        return [f"<h2>Trigger layer ({escape(policy.policy)})</h2>",
                '<p class="note">Colour: similarity of the tracked keys\' attention with the previous step (white = '
                "1); outlined: the layer from which the step recomputed everything.</p>",
                trigger_svg(self, trace.n_layers)]

    def png(self, policy, trace, out: Path) -> list[Path]:
        """``trigger-<policy>.png``."""
        from polestar.tracing.png import slug

        return [trigger_png(self, policy.policy, trace.n_layers, out / f"trigger-{slug(policy.policy)}.png")]


class TriggerFigure:
    """The ``trigger`` figure of a trace (:class:`~polestar.tracing.stage_figure.StageFigure`)."""

    key = "trigger"

    def read(self, stages: dict, row: int) -> TriggerStep | None:
        """The row's :class:`TriggerStep` at this step (None at a step without a trigger test)."""
        entries = stages.get(TRIGGER, {})
        if not entries:
            return None
        similarity = {layer: float(sim[row]) for layer, (sim, _hit) in sorted(entries.items())}
        first = next((layer for layer, (_sim, hit) in sorted(entries.items()) if bool(hit[row])), None)
        return TriggerStep(similarity, first)

    def series(self, steps: Sequence, n_layers: int, stage_names: dict[str, str]) -> TriggerSeries | None:
        """The :class:`TriggerSeries`, or None when no step ran the trigger test."""
        update = [s for s in steps if s.stages.get(self.key) is not None]
        if not update:
            return None
        return TriggerSeries(tuple(s.step for s in update),
                             tuple(tuple(s.stages[self.key].similarity[layer] for layer in range(n_layers))
                                   for s in update),
                             tuple(s.stages[self.key].layer for s in update))


TRIGGER_LAYER = TriggerFigure()


def trigger_svg(series: TriggerSeries, n_layers: int) -> str:
    """Layer × step heatmap of Elastic-Cache's attention similarity, the trigger layer outlined."""
    cell, row = 22, 16
    width, height = LEFT + len(series.steps) * cell + 10, 8 + n_layers * row + 22
    body = [svg_text(LEFT - 8, 8 + layer * row + 12, f"layer {layer}", 9, "end") for layer in range(n_layers)]
    for i, step in enumerate(series.steps):
        body.append(svg_text(LEFT + i * cell + cell / 2, 8 + n_layers * row + 14, str(step), 9))
        for layer in range(n_layers):
            sim = series.similarity[i][layer]
            shade = int(255 * min(max(sim, 0.0), 1.0))
            trig = series.trigger[i] == layer
            body.append(svg_rect(LEFT + i * cell, 8 + layer * row, cell - 1, row - 1, f"rgb(255,{shade},{shade})",
                                 f"step {step} · layer {layer} · similarity {sim:.3f}"
                                 + (" · trigger layer" if trig else ""),
                                 stroke="#212529" if trig else None))
    return svg_figure(width, height, body)


def trigger_png(series: TriggerSeries, policy: str, n_layers: int, path: Path) -> Path:
    """The similarity per layer and trigger layer of ``policy`` as a PNG at ``path``."""
    import numpy as np

    from polestar.tracing.png import new_figure, save_figure

    n = len(series.steps)
    fig = new_figure(max(6.0, 0.32 * n + 2.2), 0.3 * n_layers + 1.6)
    ax = fig.subplots()
    image = ax.imshow(np.array(series.similarity, dtype=float).T, aspect="auto", cmap="Reds_r", vmin=0.0, vmax=1.0)
    hit = [(i, layer) for i, layer in enumerate(series.trigger) if layer is not None]
    if hit:
        ax.scatter([i for i, _ in hit], [layer for _, layer in hit], marker="x", color="#212529", s=24,
                   label="trigger layer (recomputed from here up)")
        ax.legend(loc="upper left", bbox_to_anchor=(0.0, -0.22), fontsize=7, frameon=False)
    ax.set_yticks(range(n_layers), [f"layer {layer}" for layer in range(n_layers)], fontsize=7)
    ax.set_xticks(range(n), [str(s) for s in series.steps], fontsize=7)
    ax.set_xlabel("step", fontsize=8)
    ax.set_title(f"{policy}: tracked-attention similarity and trigger layer", fontsize=9, loc="left")
    fig.colorbar(image, ax=ax, label="cosine similarity")
    return save_figure(fig, path)
