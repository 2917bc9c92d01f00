"""Figure data of a trace, computed from the per-step :class:`~polestar.tracing.record.StepTrace` s of one policy:
what the HTML page and the PNG figures draw, as plain values (so a test can check them against the records).

* :class:`CommitGrid` — position × step: the step each generated position was committed, its origin and
  confidence, the positions that were still masked in the current block at each step, the final tokens;
* :class:`RefreshGrid` — per layer, position × step: the columns the step's plan recomputed and the members each
  sparse update recomputed;
* :class:`DriftSeries` — per layer, cluster × step: Polestar-Cache's cluster drifts and the chosen clusters;
* :class:`TriggerSeries` — per step: Elastic-Cache's attention similarity per layer and its trigger layer;
* :class:`CostSeries` — per step: rows computed, weight bytes, proxy rows and K/V bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .record import StepTrace


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
    generated columns ``[start, end)``; ``block_starts``: each block's first column; ``n_steps``: steps taken."""

    cells: tuple[CommitCell, ...]
    waiting: tuple[tuple[int, int], ...]
    start: int
    end: int
    block_starts: tuple[int, ...]
    n_steps: int


class RefreshGrid(NamedTuple):
    """Per layer and step (``[layer][step]``): ``computed`` the columns the forward's plan recomputed,
    ``refreshed`` the columns a sparse update recomputed (empty where none ran); ``length``: the sequence's
    columns; ``has_updates``: any sparse update ran."""

    computed: tuple[tuple[tuple[int, ...], ...], ...]
    refreshed: tuple[tuple[tuple[int, ...], ...], ...]
    length: int

    @property
    def has_updates(self) -> bool:
        return any(cols for layer in self.refreshed for cols in layer)


class DriftSeries(NamedTuple):
    """Polestar-Cache's cluster drift: ``steps`` the sparse-update steps and ``blocks`` their blocks (the clusters
    are re-formed at each block start); ``layers`` the layers that scored their clusters (every layer but the last
    unless the commit rule reads the last layer's packet); per entry ``j`` of ``layers``, ``drift[j][i]`` the
    clusters' drifts at ``steps[i]`` and ``chosen[j][i]`` whether each was chosen for recompute."""

    steps: tuple[int, ...]
    blocks: tuple[int, ...]
    layers: tuple[int, ...]
    drift: tuple[tuple[tuple[float, ...], ...], ...]
    chosen: tuple[tuple[tuple[bool, ...], ...], ...]


class TriggerSeries(NamedTuple):
    """Elastic-Cache's trigger: ``steps`` with a sparse update; ``similarity[i][layer]`` the tracked keys'
    attention similarity at ``steps[i]``; ``trigger[i]`` the first triggered layer (None: no recompute)."""

    steps: tuple[int, ...]
    similarity: tuple[tuple[float, ...], ...]
    trigger: tuple[int | None, ...]


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
    for s in steps:
        done = {c.position for c in s.commits}
        waiting += [(p, s.step) for p in s.masked if p not in done]
        cells += [CommitCell(c.position, s.step, c.origin, c.confidence, final[c.position])
                  for c in s.commits if start <= c.position < end]
    return CommitGrid(tuple(sorted(cells)), tuple(waiting), start, end, tuple(range(start, end, block_length)),
                      len(steps))


def refresh_grid(steps: Sequence[StepTrace], n_layers: int, length: int) -> RefreshGrid:
    """The :class:`RefreshGrid` of a generation with ``n_layers`` layers and ``length`` columns."""
    computed = tuple(tuple(s.computed[layer] for s in steps) for layer in range(n_layers))
    refreshed = tuple(tuple(s.refreshed.get(layer, ()) for s in steps) for layer in range(n_layers))
    return RefreshGrid(computed, refreshed, length)


def drift_series(steps: Sequence[StepTrace], n_layers: int) -> DriftSeries | None:
    """The :class:`DriftSeries`, or None when no step recorded cluster drifts."""
    update = [s for s in steps if s.clusters]
    if not update:
        return None
    layers = tuple(layer for layer in range(n_layers) if all(layer in s.clusters for s in update))
    drift = tuple(tuple(s.clusters[layer].drift for s in update) for layer in layers)
    chosen = tuple(tuple(s.clusters[layer].chosen for s in update) for layer in layers)
    return DriftSeries(tuple(s.step for s in update), tuple(s.block for s in update), layers, drift, chosen)


def trigger_series(steps: Sequence[StepTrace], n_layers: int) -> TriggerSeries | None:
    """The :class:`TriggerSeries`, or None when no step recorded an Elastic-Cache trigger."""
    update = [s for s in steps if s.similarity]
    if not update:
        return None
    return TriggerSeries(tuple(s.step for s in update),
                         tuple(tuple(s.similarity[layer] for layer in range(n_layers)) for s in update),
                         tuple(s.trigger_layer for s in update))


def cost_series(steps: Sequence[StepTrace]) -> CostSeries:
    """The :class:`CostSeries` of the steps."""
    return CostSeries(tuple(s.layer_rows for s in steps), tuple(s.weight_bytes for s in steps),
                      tuple(s.proxy_rows for s in steps), tuple(s.kv_bytes for s in steps))


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
    generation, ``nfe`` steps taken."""

    policy: str
    stages: dict[str, str]
    commit: CommitGrid
    refresh: RefreshGrid
    drift: DriftSeries | None
    trigger: TriggerSeries | None
    cost: CostSeries
    tokens: tuple[int, ...]
    labels: tuple[str, ...]
    text: str
    nfe: int


def policy_figures(policy: str, stages: dict[str, str], steps: Sequence[StepTrace], prompt_len: int,
                   block_length: int, final: Sequence[int], labels: Sequence[str], text: str,
                   n_layers: int) -> PolicyFigures:
    """Every figure's data for one policy's decode (``final``: the whole sequence's tokens, ``labels`` one short
    label per column)."""
    length = len(final)
    return PolicyFigures(policy, dict(stages), commit_grid(steps, prompt_len, length, block_length, final),
                         refresh_grid(steps, n_layers, length), drift_series(steps, n_layers),
                         trigger_series(steps, n_layers), cost_series(steps), tuple(final), tuple(labels), text,
                         len(steps))
