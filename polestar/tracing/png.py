"""The trace's PNG figures (matplotlib, the ``bench`` extra), drawn from the same figure data as the HTML page:

* ``commits.png`` — the commit grids of the policies, one above the other, with the final tokens and the first
  difference;
* ``recompute-<policy>.png`` — per layer, the plan's columns and the sparse updates' members per step;
* ``drift-<policy>.png`` — Polestar-Cache's cluster drift per layer (policies with a drift-aware refresh);
* ``trigger-<policy>.png`` — Elastic-Cache's attention similarity per layer and its trigger layer;
* ``cost.png`` — rows computed, weight bytes and proxy rows per step, the policies side by side.
"""

from __future__ import annotations

from pathlib import Path

from .figures import drift_metric
from .html import (
    COMPUTED_COLOR,
    DIFF_COLOR,
    ORIGIN_COLORS,
    ORIGIN_LABELS,
    POLICY_COLORS,
    REFRESHED_COLOR,
    WAITING_COLOR,
)
from .record import ORIGINS

DPI = 100


def check_backend() -> None:
    """matplotlib is importable (one ValueError saying how to get it otherwise)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("PNG figures need matplotlib: pip install 'polestar-dllm[bench]', or write the HTML page "
                         "alone (png=False, --no-png)") from None


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=DPI)
    return path


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)


def commits_png(trace, path: Path) -> Path:
    """``commits.png`` (see the module docstring)."""
    from matplotlib.patches import Patch, Rectangle

    figs = trace.figures
    grid0 = figs[0].commit
    cols = grid0.end - grid0.start
    heights = [f.commit.n_steps + 2.5 for f in figs]
    fig = _figure(max(6.0, 0.2 * cols + 1.4), 0.2 * sum(heights) + 1.6)
    axes = fig.subplots(len(figs), 1, squeeze=False, height_ratios=heights)[:, 0]
    for ax, f in zip(axes, figs):
        grid = f.commit
        for pos, step in grid.waiting:
            ax.add_patch(Rectangle((pos - 0.5, step - 0.5), 0.95, 0.9, color=WAITING_COLOR, lw=0))
        for c in grid.cells:
            alpha = 1.0 if c.confidence is None else 0.35 + 0.65 * c.confidence
            ax.add_patch(Rectangle((c.position - 0.5, c.step - 0.5), 0.95, 0.9, color=ORIGIN_COLORS[c.origin],
                                   alpha=alpha, lw=0))
            if c.confidence is not None:
                ax.text(c.position - 0.025, c.step, f"{min(int(c.confidence * 100), 99):02d}", ha="center",
                        va="center", fontsize=5.5, color="white")
        final = grid.n_steps + 0.6
        for pos in range(grid.start, grid.end):
            ax.text(pos, final, f.labels[pos][:2], ha="center", va="center", fontsize=7, family="DejaVu Sans Mono")
        for start in grid.block_starts:
            ax.axvline(start - 0.5, color="#495057", lw=0.8)
        if trace.first_difference is not None:
            ax.add_patch(Rectangle((trace.first_difference - 0.5, -0.5), 1.0, grid.n_steps + 1.6, fill=False,
                                   ec=DIFF_COLOR, lw=1.5))
        ax.set_xlim(grid.start - 0.5, grid.end - 0.5)
        ax.set_ylim(final + 0.9, -0.5)
        ax.set_yticks(list(range(0, grid.n_steps, 2)) + [final], [*map(str, range(0, grid.n_steps, 2)), "final"],
                      fontsize=7)
        ax.set_xticks(list(grid.block_starts), [f"block {b} (col {s})" for b, s in enumerate(grid.block_starts)],
                      fontsize=7, ha="left")
        ax.set_ylabel("step", fontsize=8)
        ax.set_title(f"{f.policy}: {f.nfe} steps", fontsize=9, loc="left")
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    handles = [Patch(color=ORIGIN_COLORS[o], label=ORIGIN_LABELS[o]) for o in ORIGINS]
    handles.append(Patch(color=WAITING_COLOR, label="masked, not committed"))
    if trace.first_difference is not None:
        handles.append(Patch(fill=False, ec=DIFF_COLOR, label="first difference"))
    fig.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=7, frameon=False)
    return _save(fig, path)


def recompute_png(trace, f, path: Path) -> Path:
    """``recompute-<policy>.png`` (see the module docstring)."""
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    grid, n_layers = f.refresh, trace.n_layers
    n_steps = len(grid.computed[0])
    cmap = ListedColormap(["#ffffff", COMPUTED_COLOR, REFRESHED_COLOR])
    fig = _figure(max(6.0, 0.075 * grid.length + 1.6), 0.09 * n_steps * n_layers + 0.5 * n_layers + 1.0)
    axes = fig.subplots(n_layers, 1, squeeze=False, sharex=True)[:, 0]
    for layer, ax in enumerate(axes):
        codes = np.zeros((n_steps, grid.length), dtype=np.int8)
        for step in range(n_steps):
            codes[step, list(grid.computed[layer][step])] = 1
            codes[step, list(grid.refreshed[layer][step])] = 2
        ax.imshow(codes, aspect="auto", cmap=cmap, vmin=0, vmax=2, interpolation="nearest")
        ax.axvline(trace.prompt_len - 0.5, color="#495057", lw=0.8, ls="--")
        ax.set_ylabel(f"layer {layer}\nstep", fontsize=7)
        ax.tick_params(labelsize=7)
    axes[-1].set_xlabel(f"column (prompt | generation at {trace.prompt_len})", fontsize=8)
    axes[0].set_title(f"{f.policy}: positions recomputed per step", fontsize=9, loc="left")
    fig.legend(handles=[Patch(color=COMPUTED_COLOR, label="the step's plan"),
                        Patch(color=REFRESHED_COLOR, label="sparse update's members")],
               loc="outside lower center", ncol=2, fontsize=7, frameon=False)
    return _save(fig, path)


def drift_png(trace, f, path: Path) -> Path:
    """``drift-<policy>.png`` (see the module docstring)."""
    import numpy as np
    from matplotlib.colors import LogNorm

    series = f.drift
    n_layers = len(series.layers)
    k = len(series.drift[0][0])
    values = np.array(series.drift, dtype=float)  # [layers, S, K]
    positive = values[values > 0]
    norm = LogNorm(positive.min() if positive.size else 1e-6, positive.max() if positive.size else 1.0)
    n = len(series.steps)
    fig = _figure(max(6.0, 0.32 * n + 2.2), (0.16 * k + 0.45) * n_layers + 0.8)
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
    metric = drift_metric(f.stages)
    axes[0].set_title(f"{f.policy}: cluster drift per layer\n{metric}\n(cur: a cluster's proxy attention at this "
                      "sparse update, prev: at the previous one)", fontsize=8, loc="left")
    fig.colorbar(image, ax=list(axes), label=f"{metric.split(':')[0]} (log scale)", shrink=0.8)
    return _save(fig, path)


def trigger_png(trace, f, path: Path) -> Path:
    """``trigger-<policy>.png`` (see the module docstring)."""
    import numpy as np

    series, n_layers = f.trigger, trace.n_layers
    n = len(series.steps)
    fig = _figure(max(6.0, 0.32 * n + 2.2), 0.3 * n_layers + 1.6)
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
    ax.set_title(f"{f.policy}: tracked-attention similarity and trigger layer", fontsize=9, loc="left")
    fig.colorbar(image, ax=ax, label="cosine similarity")
    return _save(fig, path)


def cost_png(trace, path: Path) -> Path:
    """``cost.png`` (see the module docstring)."""
    figs = trace.figures
    n = max(len(f.cost.layer_rows) for f in figs)
    fig = _figure(max(6.0, 0.22 * n * len(figs) + 1.5), 5.2)
    axes = fig.subplots(3, 1, sharex=True)
    width = 0.8 / len(figs)
    for ax, (field, unit, label) in zip(axes, (("layer_rows", 1, "rows computed"), ("weight_bytes", 1e6, "weight MB"),
                                              ("proxy_rows", 1, "proxy rows"))):
        for p, (f, color) in enumerate(zip(figs, POLICY_COLORS)):
            values = [v / unit for v in getattr(f.cost, field)]
            ax.bar([i + (p - (len(figs) - 1) / 2) * width for i in range(len(values))], values, width, color=color,
                   label=f.policy)
        ax.set_ylabel(label, fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].legend(fontsize=7, frameon=False, ncol=len(figs), loc="lower left", bbox_to_anchor=(0.0, 1.0))
    axes[-1].set_xlabel("step", fontsize=8)
    return _save(fig, path)


def write_pngs(trace, out: Path) -> list[Path]:
    """Every PNG figure of ``trace`` (a :class:`~polestar.tracing.run.Trace`) into ``out``; returns their paths."""
    check_backend()
    paths = [commits_png(trace, out / "commits.png")]
    for f in trace.figures:
        slug = _slug(f.policy)
        paths.append(recompute_png(trace, f, out / f"recompute-{slug}.png"))
        if f.drift is not None:
            paths.append(drift_png(trace, f, out / f"drift-{slug}.png"))
        if f.trigger is not None:
            paths.append(trigger_png(trace, f, out / f"trigger-{slug}.png"))
    paths.append(cost_png(trace, out / "cost.png"))
    return paths
