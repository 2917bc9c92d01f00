"""The trace's PNG figures (matplotlib, the ``bench`` extra), drawn from the same figure data as the HTML page:

* ``commits.png`` — the commit grids of the policies, one above the other, with the final tokens and the first
  difference;
* ``recompute-<policy>.png`` — per layer, the plan's columns and the sparse updates' members per step;
* the stages' own figures (``drift-<policy>.png``: Polestar-Cache's cluster drift per layer;
  ``trigger-<policy>.png``: Elastic-Cache's attention similarity per layer and its trigger layer);
* ``cost.png`` — rows computed, weight bytes and proxy rows per step, the policies side by side.
"""

from __future__ import annotations

from pathlib import Path

from .html import (
    COMPUTED_COLOR,
    DIFF_COLOR,
    ORIGIN_COLORS,
    ORIGIN_LABELS,
    POLICY_COLORS,
    REFRESHED_COLOR,
    REVOKED_COLOR,
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


def new_figure(width: float, height: float):
    """A matplotlib figure of ``width`` × ``height`` inches (constrained layout, the trace's DPI)."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def save_figure(fig, path: Path) -> Path:
    """Save ``fig`` as a PNG at ``path``; returns ``path``."""
    fig.savefig(path, dpi=DPI)
    return path


def slug(name: str) -> str:
    """A policy name as a file-name part."""
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)


def commits_png(trace, path: Path) -> Path:
    """``commits.png`` (see the module docstring)."""
    from matplotlib.patches import Patch, Rectangle

    figs = trace.figures
    grid0 = figs[0].commit
    cols = grid0.end - grid0.start
    heights = [f.commit.n_steps + 2.5 for f in figs]
    fig = new_figure(max(6.0, 0.2 * cols + 1.4), 0.2 * sum(heights) + 1.6)
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
        for pos, step in getattr(grid, "revoked", ()):
            ax.add_patch(Rectangle((pos - 0.45, step - 0.4), 0.85, 0.8, fill=False, ec=REVOKED_COLOR, lw=1.2))
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
    if any(getattr(f.commit, "revoked", ()) for f in figs):
        handles.append(Patch(fill=False, ec=REVOKED_COLOR, label="revoked: masked again"))
    if trace.first_difference is not None:
        handles.append(Patch(fill=False, ec=DIFF_COLOR, label="first difference"))
    fig.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=7, frameon=False)
    return save_figure(fig, path)


def recompute_png(trace, f, path: Path) -> Path:
    """``recompute-<policy>.png`` (see the module docstring)."""
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    grid, n_layers = f.refresh, trace.n_layers
    n_steps = len(grid.computed[0])
    cmap = ListedColormap(["#ffffff", COMPUTED_COLOR, REFRESHED_COLOR])
    fig = new_figure(max(6.0, 0.075 * grid.length + 1.6), 0.09 * n_steps * n_layers + 0.5 * n_layers + 1.0)
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
    return save_figure(fig, path)


def cost_png(trace, path: Path) -> Path:
    """``cost.png`` (see the module docstring)."""
    figs = trace.figures
    n = max(len(f.cost.layer_rows) for f in figs)
    fig = new_figure(max(6.0, 0.22 * n * len(figs) + 1.5), 5.2)
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
    return save_figure(fig, path)


def write_pngs(trace, out: Path) -> list[Path]:
    """Every PNG figure of ``trace`` (a :class:`~polestar.tracing.run.Trace`) into ``out``; returns their paths."""
    check_backend()
    paths = [commits_png(trace, out / "commits.png")]
    for f in trace.figures:
        paths.append(recompute_png(trace, f, out / f"recompute-{slug(f.policy)}.png"))
        for data in f.stage_figures.values():  # the stages' own figures
            paths += data.png(f, trace, out)
    paths.append(cost_png(trace, out / "cost.png"))
    return paths
