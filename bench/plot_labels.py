"""Point labels that do not overlap: each label tries a ring of offsets around its point and takes the first whose
text box (in display pixels) stays inside the axes and overlaps no label placed before it and no other point's
marker (the labelled points and the ``avoid`` points); when none is free, it goes to the farthest offset tried
with a leader line back to its point. Used by the frontier and Pareto plots."""

from __future__ import annotations

from collections.abc import Sequence

#: offsets (points) tried in order, nearest first; the later rings carry a leader line
RINGS: tuple[tuple[float, float], ...] = (
    (4, 4), (4, -10), (-4, 4), (-4, -10), (4, 12), (4, -18), (-4, 12), (-4, -18),
    (14, 20), (14, -26), (-14, 20), (-14, -26), (24, 30), (24, -36), (-24, 30), (-24, -36),
)


def _overlaps(a, b) -> bool:
    return not (a.x1 <= b.x0 or b.x1 <= a.x0 or a.y1 <= b.y0 or b.y1 <= a.y0)


def place_labels(ax, xs: Sequence[float], ys: Sequence[float], texts: Sequence[str], fontsize: float = 7,
                 marker_px: float = 4.0, avoid: Sequence[tuple[float, float]] = ()) -> list:
    """Annotate point ``i`` at ``(xs[i], ys[i])`` with ``texts[i]`` so that no two labels overlap and no label
    covers another point (nor a point of ``avoid``); returns the annotations. Call after the axes' data and
    limits are set."""
    from matplotlib.transforms import Bbox

    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    centres = [ax.transData.transform((x, y)) for x, y in zip(xs, ys)]
    markers = [Bbox.from_extents(cx - marker_px, cy - marker_px, cx + marker_px, cy + marker_px) for cx, cy in centres]
    extra = [ax.transData.transform(p) for p in avoid]
    fixed = [Bbox.from_extents(cx - marker_px, cy - marker_px, cx + marker_px, cy + marker_px) for cx, cy in extra]
    frame = ax.get_window_extent(renderer)
    placed, out = [], []
    for i, (x, y, text) in enumerate(zip(xs, ys, texts)):
        others = [m for j, m in enumerate(markers) if j != i] + fixed
        chosen = None
        for k, (dx, dy) in enumerate(RINGS):
            ha = "left" if dx >= 0 else "right"
            ann = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=fontsize, ha=ha,
                              arrowprops=dict(arrowstyle="-", lw=0.5, color="0.4") if k >= 8 else None)
            box = ann.get_window_extent(renderer).expanded(1.05, 1.1)
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            if inside and not any(_overlaps(box, b) for b in placed) and not any(_overlaps(box, m) for m in others):
                chosen = (ann, box)
                break
            ann.remove()
        if chosen is None:  # crowded: the farthest offset with a leader line
            dx, dy = RINGS[-1]
            ann = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=fontsize,
                              ha="right", arrowprops=dict(arrowstyle="-", lw=0.5, color="0.4"))
            chosen = (ann, ann.get_window_extent(renderer))
        placed.append(chosen[1])
        out.append(chosen[0])
    return out
