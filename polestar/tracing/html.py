"""The trace's self-contained HTML page: inline SVG drawn here from the figure data, one small plain-JavaScript
handler (hovering a cell shows its details in the status line), no network, no external file.

The page sets ``data-ready="1"`` on ``<body>`` once its script has run (a headless-browser check reads it)."""

from __future__ import annotations

from html import escape

from .figures import CommitGrid, CostSeries, RefreshGrid
from .record import ORIGINS

#: fill colour per commit origin (also used by the PNG figures)
ORIGIN_COLORS = {"confident": "#2b8a3e", "forced": "#e8590c", "early": "#7048e8", "rule": "#1971c2",
                 "suffix": "#c2255c", "eos": "#868e96"}
#: legend text per commit origin
ORIGIN_LABELS = {"confident": "confidence ≥ τ", "forced": "forced top-1 (< τ)", "early": "early (drift gate)",
                 "rule": "rule's pick", "suffix": "suffix block", "eos": "EOS fill"}
WAITING_COLOR, COMPUTED_COLOR, REFRESHED_COLOR, DIFF_COLOR = "#e9ecef", "#a5d8ff", "#d9480f", "#e03131"
#: outline of a committed position a step masked again (a revoking commit rule, WINO's narrow-out), and of the
#: columns whose rows a commit rule's own pass computed (WINO's shadow block) in the recompute grid
REVOKED_COLOR = "#c92a2a"
POLICY_COLORS = ("#1c7ed6", "#f08c00")

CELL, ROW, LEFT, TOP = 18, 16, 64, 30

_SCRIPT = """
(function () {
  var status = document.getElementById('status');
  document.querySelectorAll('[data-info]').forEach(function (el) {
    el.addEventListener('mouseenter', function () { status.textContent = el.getAttribute('data-info'); });
  });
  document.body.setAttribute('data-ready', '1');
})();
"""

_STYLE = """
body { font-family: sans-serif; margin: 16px 24px 64px; color: #212529; }
h1 { font-size: 20px; } h2 { font-size: 17px; margin-top: 28px; } h3 { font-size: 14px; margin: 14px 0 4px; }
pre { background: #f8f9fa; padding: 6px 10px; display: inline-block; margin: 2px 0; }
.legend span { display: inline-block; margin-right: 14px; font-size: 13px; }
.legend i { display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: -1px; }
#status { position: fixed; bottom: 0; left: 0; right: 0; background: #212529; color: #f8f9fa; padding: 6px 12px;
          font-family: monospace; font-size: 13px; min-height: 16px; }
svg text { font-family: sans-serif; }
.note { color: #495057; font-size: 13px; max-width: 60em; }
"""


def _info(text: str) -> str:
    return f'data-info="{escape(text)}"'


def svg_rect(x: float, y: float, w: float, h: float, fill: str, info: str | None = None, opacity: float = 1.0,
             stroke: str | None = None) -> str:
    """An SVG ``<rect>``; ``info``: the text the page's status line shows when the pointer is over it."""
    extra = f' fill-opacity="{opacity:.2f}"' if opacity < 1 else ""
    extra += f' stroke="{stroke}" stroke-width="1.5"' if stroke else ""
    attr = f" {_info(info)}" if info else ""
    title = f"<title>{escape(info)}</title>" if info else ""
    return f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{fill}"{extra}{attr}>{title}</rect>'


def svg_text(x: float, y: float, s: str, size: int = 11, anchor: str = "middle", fill: str = "#212529",
             rotate: bool = False) -> str:
    """An SVG ``<text>`` at ``(x, y)``."""
    turn = f' transform="rotate(-90 {x:.1f} {y:.1f})"' if rotate else ""
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" fill="{fill}"{turn}>'
            f"{escape(s)}</text>")


def svg_figure(width: float, height: float, body: list[str]) -> str:
    """An inline ``<svg>`` of ``width`` × ``height`` holding the elements ``body``."""
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}">' + "".join(body) + "</svg>")


def commit_svg(grid: CommitGrid, labels: tuple[str, ...], diff: int | None) -> str:
    """Position × step grid: each committed position at its commit step, coloured by origin (opacity and the
    printed two digits: confidence at commit), waiting positions in grey, the final tokens under it."""
    cols = grid.end - grid.start
    width, height = LEFT + cols * CELL + 10, TOP + grid.n_steps * ROW + 34

    def x(pos: int) -> float:
        return LEFT + (pos - grid.start) * CELL

    body = [svg_text(LEFT - 8, TOP + i * ROW + 12, f"{i}", 10, "end") for i in range(grid.n_steps)]
    body.append(svg_text(12, TOP + grid.n_steps * ROW / 2, "step", 11, "middle", rotate=True))
    for b, start in enumerate(grid.block_starts):
        body.append(f'<line x1="{x(start):.1f}" y1="{TOP - 14}" x2="{x(start):.1f}" y2="{height - 4}" '
                    'stroke="#495057" stroke-width="1"/>')
        body.append(svg_text(x(start) + 3, TOP - 4, f"block {b}", 10, "start"))
    for pos, step in grid.waiting:
        body.append(svg_rect(x(pos), TOP + step * ROW, CELL - 1, ROW - 1, WAITING_COLOR,
                          f"position {pos} · step {step} · masked, not committed"))
    for c in grid.cells:
        conf = "-" if c.confidence is None else f"{c.confidence:.3f}"
        info = f"position {c.position} · step {c.step} · {ORIGIN_LABELS[c.origin]} · confidence {conf} · " \
               f"token {labels[c.position]!r}"
        opacity = 1.0 if c.confidence is None else 0.35 + 0.65 * c.confidence
        y = TOP + c.step * ROW
        body.append(svg_rect(x(c.position), y, CELL - 1, ROW - 1, ORIGIN_COLORS[c.origin], info, opacity))
        if c.confidence is not None:
            body.append(svg_text(x(c.position) + CELL / 2, y + 11, f"{min(int(c.confidence * 100), 99):02d}", 8,
                              fill="#ffffff"))
    for pos, step in getattr(grid, "revoked", ()):
        body.append(svg_rect(x(pos) + 1, TOP + step * ROW + 1, CELL - 3, ROW - 3, "none",
                             f"position {pos} · step {step} · revoked: masked again", stroke=REVOKED_COLOR))
    base = TOP + grid.n_steps * ROW + 16
    body.append(svg_text(LEFT - 8, base, "final", 10, "end"))
    for pos in range(grid.start, grid.end):
        body.append(svg_text(x(pos) + CELL / 2, base, labels[pos][:2], 12))
    if diff is not None:
        body.append(svg_rect(x(diff), TOP - 2, CELL - 1, height - TOP - 2, "none", f"first difference: position {diff}",
                          stroke=DIFF_COLOR))
    return svg_figure(width, height, body)


def _runs(cols: tuple[int, ...]) -> list[tuple[int, int]]:
    """Sorted columns → ``(first, count)`` runs of consecutive columns."""
    runs: list[tuple[int, int]] = []
    for c in cols:
        if runs and runs[-1][0] + runs[-1][1] == c:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((c, 1))
    return runs


def refresh_svg(grid: RefreshGrid, layer: int, prompt_len: int) -> str:
    """One layer's position × step grid: the plan's columns (light) and the sparse update's members (dark)."""
    cell, row = 6, 8
    n_steps = len(grid.computed[layer])
    width, height = LEFT + grid.length * cell + 10, 16 + n_steps * row + 6
    body = [svg_text(LEFT - 8, 16 + i * row + 7, f"{i}", 8, "end") for i in range(0, n_steps, 2)]
    for step in range(n_steps):
        y = 16 + step * row
        for first, n in _runs(grid.computed[layer][step]):
            body.append(svg_rect(LEFT + first * cell, y, n * cell, row - 1, COMPUTED_COLOR,
                              f"layer {layer} · step {step} · plan recomputed columns {first}-{first + n - 1}"))
        for first, n in _runs(grid.refreshed[layer][step]):
            body.append(svg_rect(LEFT + first * cell, y, n * cell, row - 1, REFRESHED_COLOR,
                              f"layer {layer} · step {step} · sparse update recomputed columns "
                              f"{first}-{first + n - 1}"))
        for first, n in _runs(grid.verified[layer][step] if getattr(grid, "verified", ()) else ()):
            body.append(svg_rect(LEFT + first * cell, y + 1, n * cell, row - 3, "none",
                                 f"layer {layer} · step {step} · the commit rule's own rows (shadow block) at "
                                 f"columns {first}-{first + n - 1}", stroke=REVOKED_COLOR))
    xp = LEFT + prompt_len * cell
    body.append(f'<line x1="{xp}" y1="4" x2="{xp}" y2="{height}" stroke="#495057" stroke-dasharray="3 2"/>')
    body.append(svg_text(xp - 3, 11, "prompt | generation", 9, "middle"))
    body.append(svg_text(4, 16 + n_steps * row / 2, f"layer {layer}", 10, "start"))
    return svg_figure(width, height, body)


def cost_svg(costs: list[CostSeries], names: list[str], field: str, unit: float, label: str) -> str:
    """Bars per step of one cost counter, the policies side by side."""
    series = [getattr(c, field) for c in costs]
    n = max(len(s) for s in series)
    top = max(max(s, default=0) for s in series) / unit or 1.0
    group, plot_h = 8 * len(series) + 4, 90
    width, height = max(LEFT + n * group + 10, LEFT + 7 * len(label)), plot_h + 40
    body = [svg_text(LEFT - 6, 14, f"{top:.3g}", 9, "end"), svg_text(LEFT - 6, plot_h + 10, "0", 9, "end"),
            svg_text(LEFT, plot_h + 36, label, 11, "start")]
    for p, (s, color) in enumerate(zip(series, POLICY_COLORS)):
        for step, v in enumerate(s):
            h = plot_h * (v / unit) / top
            body.append(svg_rect(LEFT + step * group + p * 8, 10 + plot_h - h, 7, h, color,
                              f"{names[p]} · step {step} · {label}: {v / unit:.4g}"))
    for step in range(0, n, 5):
        body.append(svg_text(LEFT + step * group + group / 2, plot_h + 22, str(step), 9))
    return svg_figure(width, height, body)


def _legend(items: list[tuple[str, str]]) -> str:
    return '<div class="legend">' + "".join(f'<span><i style="background:{c}"></i>{escape(t)}</span>'
                                            for c, t in items) + "</div>"


def render_html(trace) -> str:
    """The whole page of a :class:`~polestar.tracing.run.Trace`."""
    figs = trace.figures
    names = [f.policy for f in figs]
    parts = [f"<h1>{escape(trace.title)}</h1>", "<div>prompt</div>", f"<pre>{escape(trace.prompt)}</pre>"]
    if trace.reference is not None:
        parts += ["<div>reference</div>", f"<pre>{escape(trace.reference)}</pre>"]
    for f in figs:
        stages = ", ".join(f"{k}={v}" for k, v in f.stages.items())
        parts += [f"<div><b>{escape(f.policy)}</b> ({escape(stages)}) · {f.nfe} steps</div>",
                  f"<pre>{escape(f.text)}</pre>"]
    if len(figs) == 2:
        diff = trace.first_difference
        parts.append('<p class="note">' + ("the two outputs are identical" if diff is None else
                     f"first position where the outputs differ: column {diff} (generated position "
                     f"{diff - trace.prompt_len}), outlined in red") + "</p>")
    parts.append("<h2>Commits: the step each position was committed</h2>")
    revoking = [(REVOKED_COLOR, "revoked (outlined): masked again")] if any(
        getattr(f.commit, "revoked", ()) for f in figs) else []
    parts.append(_legend([(ORIGIN_COLORS[o], ORIGIN_LABELS[o]) for o in ORIGINS] +
                         [(WAITING_COLOR, "masked in the current block, not committed")] + revoking))
    parts.append('<p class="note">Opacity and the printed digits: confidence at commit (percent). Columns: '
                 "generated positions; rows: steps.</p>")
    for f in figs:
        parts += [f"<h3>{escape(f.policy)}</h3>", commit_svg(f.commit, f.labels, trace.first_difference)]
    parts.append("<h2>Recompute: positions each layer computed, per step</h2>")
    shadow = [(REVOKED_COLOR, "commit rule's own rows (outlined: WINO's shadow block)")] if any(
        cols for f in figs for layer in getattr(f.refresh, "verified", ()) for cols in layer) else []
    parts.append(_legend([(COMPUTED_COLOR, "the step's plan (block, or everything at a refresh)"),
                          (REFRESHED_COLOR, "sparse update's members")] + shadow))
    for f in figs:
        parts.append(f"<h3>{escape(f.policy)}</h3>")
        parts += [refresh_svg(f.refresh, layer, trace.prompt_len) for layer in range(trace.n_layers)]
    for f in figs:  # the stages' own figures (Polestar-Cache's cluster drift, Elastic-Cache's trigger, ...)
        for data in f.stage_figures.values():
            parts += data.html(f, trace)
    parts.append("<h2>Cost per step</h2>")
    parts.append(_legend(list(zip(POLICY_COLORS, names))))
    costs = [f.cost for f in figs]
    parts += [cost_svg(costs, names, "layer_rows", 1, "rows computed (summed over layers)"),
              cost_svg(costs, names, "weight_bytes", 1e6, "weight MB read"),
              cost_svg(costs, names, "proxy_rows", 1, "proxy (query-only) rows")]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(trace.title)}</title><style>{_STYLE}</style></head><body>"
            + "\n".join(parts) + '<div id="status">hover a cell for its details</div>'
            + f"<script>{_SCRIPT}</script></body></html>\n")
