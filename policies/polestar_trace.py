"""Polestar-Cache's figure in ``polestar trace``: each sparse update's cluster drifts per layer and the clusters
whose members it recomputed (:class:`ClusterDriftFigure`, declared by the ``polestar`` refresh selector; its hooks
gather a :class:`~polestar.policies.polestar_hooks.ClusterDrift` per layer under ``"clusters"``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import NamedTuple

from polestar.tracing.html import LEFT, POLICY_COLORS, svg_figure, svg_rect, svg_text

#: where the hooks keep each layer's :class:`~polestar.policies.polestar_hooks.ClusterDrift` in ``detail.stages``
CLUSTERS = "clusters"


class ClusterStep(NamedTuple):
    """One row's clusters at one layer of one sparse update: per cluster its ``drift`` and whether its members were
    ``chosen`` for recompute (the members themselves are the step's ``refreshed`` columns)."""

    drift: tuple[float, ...]
    chosen: tuple[bool, ...]


class DriftSeries(NamedTuple):
    """Polestar-Cache's cluster drift: ``steps`` the sparse-update steps and ``blocks`` their blocks (the clusters
    are re-formed at each block start); ``layers`` the layers that scored their clusters (every layer but the last
    unless the commit rule reads the last layer's packet); per entry ``j`` of ``layers``, ``drift[j][i]`` the
    clusters' drifts at ``steps[i]`` and ``chosen[j][i]`` whether each was chosen for recompute; ``metric`` what
    the drifts measure (:func:`drift_metric`)."""

    steps: tuple[int, ...]
    blocks: tuple[int, ...]
    layers: tuple[int, ...]
    drift: tuple[tuple[tuple[float, ...], ...], ...]
    chosen: tuple[tuple[tuple[bool, ...], ...], ...]
    metric: str

    def html(self, policy, trace) -> list[str]:
        """The page's cluster-drift section: one heatmap per layer (:func:`drift_svg`)."""
        return [f"<h2>Cluster drift per layer ({escape(policy.policy)}, {escape(self.metric.split(':')[0])})</h2>",
                f'<p class="note">Drift metric: {escape(self.metric)}, where cur is a cluster\'s proxy attention '
                "at this sparse update and prev at the previous one. Rows: clusters of the local window "
                "(re-formed at each block start); columns: sparse-update steps, a line where a new block "
                "starts; colour: drift (log scale); dot: clusters whose members were recomputed.</p>",
                *(drift_svg(self, j) for j in range(len(self.layers)))]

    def png(self, policy, trace, out: Path) -> list[Path]:
        """``drift-<policy>.png``."""
        from polestar.tracing.png import slug

        return [drift_png(self, policy.policy, out / f"drift-{slug(policy.policy)}.png")]


class ClusterDriftFigure:
    """The ``drift`` figure of a trace (:class:`~polestar.tracing.stage_figure.StageFigure`)."""

    key = "drift"

    def read(self, stages: dict, row: int) -> dict[int, ClusterStep]:
        """Layer → the row's :class:`ClusterStep` at this step (empty at a step without a sparse update)."""
        return {layer: ClusterStep(tuple(c.drift[row].tolist()), tuple(c.chosen[row].tolist()))
                for layer, c in sorted(stages.get(CLUSTERS, {}).items())}

    def series(self, steps: Sequence, n_layers: int, stage_names: dict[str, str]) -> DriftSeries | None:
        """The :class:`DriftSeries`, or None when no step recorded cluster drifts."""
        update = [s for s in steps if s.stages.get(self.key)]
        if not update:
            return None
        layers = tuple(layer for layer in range(n_layers) if all(layer in s.stages[self.key] for s in update))
        drift = tuple(tuple(s.stages[self.key][layer].drift for s in update) for layer in layers)
        chosen = tuple(tuple(s.stages[self.key][layer].chosen for s in update) for layer in layers)
        return DriftSeries(tuple(s.step for s in update), tuple(s.block for s in update), layers, drift, chosen,
                           drift_metric(stage_names))


CLUSTER_DRIFT = ClusterDriftFigure()


def drift_metric(stages: dict[str, str]) -> str:
    """What the cluster drifts of a policy with ``stages`` measure, for the drift figure's title and colour scale:
    its ``drift`` stage and the first sentence of that stage's docstring, e.g. ``drift=kl: KL(cur ‖ prev) per
    head, averaged over heads (Polestar's drift)`` (``cur``: a cluster's proxy attention at this sparse update,
    ``prev``: at the previous one); just ``drift=NAME`` when the stage has no docstring."""
    from polestar import registry

    name = stages.get("drift")
    if name is None:
        return "drift"
    try:
        doc = registry.lookup("drift", name).__doc__ or ""
    except (KeyError, ValueError):
        doc = ""
    first = " ".join(doc.split()).replace("``", "").split(". ")[0].rstrip(".")
    return f"drift={name}: {first}" if first else f"drift={name}"


def _drift_color(value: float, lo: float, hi: float) -> str:
    """Log-scaled white → dark red."""
    t = 0.0 if hi <= lo else (math.log10(max(value, 1e-12)) - lo) / (hi - lo)
    t = min(max(t, 0.0), 1.0)
    r, g, b = 255 - int(t * 90), 255 - int(t * 220), 255 - int(t * 220)
    return f"rgb({r},{g},{b})"


def drift_svg(series: DriftSeries, j: int) -> str:
    """Cluster × update-step heatmap of the drifts of layer ``series.layers[j]`` (log colour), chosen clusters
    dotted, a line where a new block re-forms the clusters."""
    layer = series.layers[j]
    values = [d for layer_d in series.drift for step in layer_d for d in step if d > 0]
    lo = math.log10(min(values)) if values else 0.0
    hi = math.log10(max(values)) if values else 1.0
    k = len(series.drift[j][0])
    cell, row = 22, 14
    width, height = LEFT + len(series.steps) * cell + 10, 18 + k * row + 22
    body = [svg_text(LEFT - 8, 18 + c * row + 10, f"c{c}", 9, "end") for c in range(k)]
    for i, step in enumerate(series.steps):
        body.append(svg_text(LEFT + i * cell + cell / 2, 18 + k * row + 14, str(step), 9))
        for c, (d, chosen) in enumerate(zip(series.drift[j][i], series.chosen[j][i])):
            body.append(svg_rect(LEFT + i * cell, 18 + c * row, cell - 1, row - 1, _drift_color(d, lo, hi),
                                 f"layer {layer} · step {step} · cluster {c} · drift {d:.4g}"
                                 + (" · chosen" if chosen else "")))
            if chosen:
                body.append(f'<circle cx="{LEFT + i * cell + cell / 2 - 0.5:.1f}" '
                            f'cy="{18 + c * row + row / 2 - 0.5:.1f}" '
                            f'r="3" fill="{POLICY_COLORS[0]}" stroke="#ffffff" stroke-width="1"/>')
        if i and series.blocks[i] != series.blocks[i - 1]:
            xb = LEFT + i * cell - 0.5
            body.append(f'<line x1="{xb:.1f}" y1="14" x2="{xb:.1f}" y2="{18 + k * row + 2}" stroke="#212529" '
                        'stroke-width="1.5"/>')
    body.append(svg_text(4, 12, f"layer {layer}", 10, "start"))
    return svg_figure(width, height, body)


def drift_png(series: DriftSeries, policy: str, path: Path) -> Path:
    """The cluster drift per layer of ``policy`` as a PNG at ``path``."""
    import numpy as np
    from matplotlib.colors import LogNorm

    from polestar.tracing.png import new_figure, save_figure

    n_layers = len(series.layers)
    k = len(series.drift[0][0])
    values = np.array(series.drift, dtype=float)  # [layers, S, K]
    positive = values[values > 0]
    norm = LogNorm(positive.min() if positive.size else 1e-6, positive.max() if positive.size else 1.0)
    n = len(series.steps)
    fig = new_figure(max(6.0, 0.32 * n + 2.2), (0.16 * k + 0.45) * n_layers + 0.8)
    axes = fig.subplots(n_layers, 1, squeeze=False, sharex=True)[:, 0]
    image = None
    for j, ax in enumerate(axes):
        layer = series.layers[j]
        image = ax.imshow(np.maximum(values[j].T, norm.vmin), aspect="auto", cmap="Reds", norm=norm)
        chosen = [(i, c) for i in range(n) for c in range(k) if series.chosen[j][i][c]]
        ax.scatter([i for i, _ in chosen], [c for _, c in chosen], marker="o", s=10, color="#1c7ed6",
                   edgecolors="white", linewidths=0.6)
        for i in range(1, n):
            if series.blocks[i] != series.blocks[i - 1]:
                ax.axvline(i - 0.5, color="#212529", lw=1.2)
        ax.set_yticks(range(k), [f"c{c}" for c in range(k)], fontsize=6)
        ax.set_ylabel(f"layer {layer}", fontsize=7)
    axes[-1].set_xticks(range(n), [str(s) for s in series.steps], fontsize=7)
    axes[-1].set_xlabel("sparse-update step (line: new block, new clusters; dot: recomputed)", fontsize=8)
    metric = series.metric
    axes[0].set_title(f"{policy}: cluster drift per layer\n{metric}\n(cur: a cluster's proxy attention at this "
                      "sparse update, prev: at the previous one)", fontsize=8, loc="left")
    fig.colorbar(image, ax=list(axes), label=f"{metric.split(':')[0]} (log scale)", shrink=0.8)
    return save_figure(fig, path)
