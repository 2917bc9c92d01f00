"""Polestar-Cache's per-generation state and what its hooks read of their selector.

:class:`PolestarRefreshState` is the refresh selector's per-generation state; :class:`WindowBuffers` the buffers of
one window size inside it; :class:`PolestarPhase` the selector's entry of the step phase. :class:`PolestarSelection`
is the part of the selector (:class:`~polestar.policies.refresh_polestar.PolestarRefresh`) that its layer hooks
(:mod:`polestar.policies.polestar_hooks`) read: its composed stages, its options and a few derived sizes. The hooks
are typed by it, so they do not import the selector, which imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

import attrs
import torch

from polestar.models.plan import DecodeCache
from polestar.state import DecodeState
from polestar.streams import SideStream

from .row_store import RowStore

if TYPE_CHECKING:
    from .sparse_update import Window


class PolestarSelection(Protocol):
    """What Polestar's layer hooks read of their refresh selector: ``config`` (its options: ``topk``,
    ``topk_last``, ``proxy_rope``, ...), the composed ``drift`` and ``clusterer`` stages, and the sizes and
    decisions below. :class:`~polestar.policies.refresh_polestar.PolestarRefresh` is one."""

    config: object
    drift: object
    clusterer: object
    packet_logits: bool

    def window(self, state: DecodeState, cache: DecodeCache) -> Window:
        """The current block's window."""
        ...

    def keep_window(self, window: Window, buf: WindowBuffers, cache: DecodeCache) -> None:
        """Keep the block's window in its buffers (at the block's first step)."""
        ...

    def kept_window(self, state: DecodeState, buf: WindowBuffers) -> Window:
        """The block's window as its first step kept it."""
        ...

    def refreshes_layer(self, layer: int, n_layers: int) -> bool:
        """Whether ``layer`` recomputes members in an update step."""
        ...

    def clusters_together(self, device: torch.device) -> bool:
        """Whether a block start clusters every layer in one clusterer call."""
        ...

    def layers_per_cluster_call(self, batch: int, window: int, width: int, n_layers: int) -> int:
        """Layers clustered per clusterer call at a block start."""
        ...


class PolestarPhase(NamedTuple):
    """The Polestar refresh selector's entry of the step phase: ``kind`` ``"build"`` (a block start that clusters
    and stores the window), ``"start"`` (a block start with an empty window), ``"update"`` (a sparse-update step)
    or ``"plain"``; ``n_post`` the window's suffix columns (where the step reads the window); ``span`` at a
    window-refresh block start, the length of the recomputed span (0: a full forward)."""

    kind: str
    n_post: int
    span: int


@attrs.define
class WindowBuffers:
    """The buffers of one window size (``Nw = n_pre + n_post`` columns), allocated once and reused by every block and
    generation with that window: the stores of the window's layer inputs and queries (:class:`RowStore`
    ``[B, Nw, d]`` and ``[B, Nw, H * hd]`` per layer), the k-means seeds ``keys [L, P, n]`` (one key row per layer
    and window part, shared by the batch; None for a clusterer without keys), and per layer (a tuple of ``L`` tensors
    each, the rows of a stack, as the cache's K/V) the block start's
    clusters: ``centroids [B, K, d]``, ``labels [B, Nw]`` (-1 invalid), ``counts [B, K]``, ``centroid_pos [B, K]`` and
    the last update's proxy distributions ``prev [B, H, K, T+1]``, each tuple the rows of one stack
    ``[L, ...]`` (``stacks``: a block start writes every layer's clusters with one copy per stack). ``parts``: the
    window parts' ``(lo, hi, k)`` (:func:`window_parts`)."""

    parts: tuple
    store: RowStore
    qstore: RowStore
    keys: torch.Tensor | None
    centroids: tuple[torch.Tensor, ...]
    labels: tuple[torch.Tensor, ...]
    counts: tuple[torch.Tensor, ...]
    centroid_pos: tuple[torch.Tensor, ...]
    prev: tuple[torch.Tensor, ...]
    #: each layer's member-buffer rows (:meth:`~polestar.policies.refresh_polestar.PolestarRefresh.capacities`)
    capacity: tuple[int, ...] = ()
    #: ``centroids, labels, counts, centroid_pos, prev`` stacked over the layers (the tuples above are their rows)
    stacks: WindowStacks | None = None
    #: the block's window as its first step computed it, kept for the block's update steps: ``row_slot [Nw + 1]``
    #: long each store row's cache slot (the window's positions, then the cache's trash slot for the trash row) and
    #: ``valid [B, Nw]`` bool (:class:`~polestar.policies.sparse_update.Window`)
    row_slot: torch.Tensor | None = None
    valid: torch.Tensor | None = None


class WindowStacks(NamedTuple):
    """:class:`WindowBuffers`' per-layer clusters as stacks over the layers: ``centroids [L, B, K, d]``, ``labels
    [L, B, Nw]``, ``counts [L, B, K]``, ``centroid_pos [L, B, K]``, ``prev [L, B, H, K, T+1]``."""

    centroids: torch.Tensor
    labels: torch.Tensor
    counts: torch.Tensor
    centroid_pos: torch.Tensor
    prev: torch.Tensor


@attrs.define
class PolestarRefreshState:
    """Per-generation state of the Polestar refresh selector
    (:class:`~polestar.policies.refresh_polestar.PolestarRefresh`), preallocated and written in place.

    ``side``: the side stream of the block-start work; ``since``: ``[B]`` tokens committed since each row's last
    update; ``due``: ``[B]`` rows due for an update at the next step (both reset at each block start);
    ``key_rope``: cos, -sin ``[B, 1, T + 1, hd]`` of the cache positions for
    :func:`~polestar.policies.polestar_hooks.proxy_probs`, written once per generation (None with ``proxy_rope``);
    ``windows``: the :class:`WindowBuffers` of each window suffix width met so
    far, and ``current`` the current block's (set on the host when the block starts; None for an empty window).
    """

    side: SideStream
    since: torch.Tensor
    due: torch.Tensor
    key_rope: tuple | None = None
    windows: dict = attrs.field(factory=dict)
    current: WindowBuffers | None = None
