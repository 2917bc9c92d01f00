"""The layer-hook contract: how a per-step controller adds rows to the backbone's one pass over each layer.

The backbone (:meth:`polestar.models.backbone.DiffusionLM.run_plan`) calls a hook three times per layer; a refresh
selector makes one hook per step for sparse updates (Polestar's update packets, Elastic-Cache's members). The
protocol lives with the model so the backbone can type the argument it calls; the core's stage base class
:class:`polestar.stages.LayerHook` is this protocol with do-nothing defaults. A hook holds no model: what it runs on
the model's weights goes through the :class:`~polestar.models.layer_ops.LayerOps` view its selector gives it.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from .cost import CostMeter
from .layers import RopeTable


class ExtraRows(NamedTuple):
    """Rows a layer hook adds to one layer's input projections (q, k, v), after the plan's rows.

    ``inputs``: ``[B, R, d_model]`` layer inputs; ``positions``: ``[B, R]`` RoPE positions, or None; ``kv_index``:
    ``[B, R]`` cache slots their K/V are written to (the trash slot for rows that only need a query: proxy queries,
    probes); ``rope``: their rotary factors (a :class:`~polestar.models.layers.RopeTable` ``[B, R, 2, hd]``) when the
    hook has them at hand, else None. The rows rotate by ``rope`` if given, else by ``positions`` if given, else by
    the positions of their slots (:attr:`by_slot`; the trash slot stands at position 0, where the rotation is the
    identity): when every extra row of a layer rotates by its slot, the layer looks up the factors of all its rows,
    the plan's included, in one gather. They go through the q, k and v projections in the same matmuls as the plan's
    rows. A hook may return several (a tuple), joined in one concatenation per field.
    """

    inputs: torch.Tensor
    positions: torch.Tensor | None
    kv_index: torch.Tensor
    rope: RopeTable | None = None

    @property
    def by_slot(self) -> bool:
        """Whether these rows rotate by the positions of their cache slots (neither ``rope`` nor ``positions``)."""
        return self.rope is None and self.positions is None


class LayerQKV(NamedTuple):
    """What a layer hook sees after the layer's one q/k/v pass and its K/V writes (before any query attends).

    ``h``: ``[B, C, d]`` the plan rows' inputs; ``index``: ``[B, C]`` their cache slots; ``q``: ``[B, H, C + R, hd]``
    queries after RoPE of the plan rows then the hook's extra rows; ``v``: ``[B, Hkv, C + R, hd]`` their values;
    ``meter``: the pass's :class:`~polestar.models.cost.CostMeter` (for proxy attention reads).
    """

    h: torch.Tensor
    index: torch.Tensor
    q: torch.Tensor
    v: torch.Tensor
    meter: CostMeter

    @property
    def n_plan(self) -> int:
        return self.h.shape[1]


class MemberRows(NamedTuple):
    """Rows a layer hook adds to the layer's attention, output projection and MLP, after the plan's rows.

    ``q``: ``[B, H, M, hd]`` their queries (after RoPE); ``inputs``: ``[B, M, d_model]`` their layer inputs (the
    residual stream). The layer's outputs for them (``[B, M, d_model]``) go to the hook's ``after_layer``. With
    ``joined``, ``q`` and ``inputs`` are the whole attention rows, the plan's first (``[B, H, C + M, hd]``,
    ``[B, C + M, d_model]``, gathered by the hook in one operation), and the layer uses them as they are.
    """

    q: torch.Tensor
    inputs: torch.Tensor
    joined: bool = False


class CachedFeatures(NamedTuple):
    """Feature caching at one layer: only some plan rows go through the layer; the others reuse its cached outputs.

    Source: dLLM-Cache (Liu et al. 2025, "dLLM-Cache: Accelerating Diffusion Large Language Models with Adaptive
    Caching"), which keeps each layer's attention and MLP outputs per position and recomputes only some rows.
    ``rows``: ``[B, R]`` long, the plan rows (indices ``0 .. C-1`` into the plan's slots) that go through the layer's
    q/k/v (their K/V written at their slots), attention, o and MLP; ``attn``, ``mlp``: ``[B, C, d_model]`` the layer's
    cached attention output (after o) and MLP output of every plan row, rewritten in place at ``rows``. Every plan
    row's output is ``(h + attn) + mlp``; the MLP of a recomputed row reads ``h + attn`` after that write.
    """

    rows: torch.Tensor
    attn: torch.Tensor
    mlp: torch.Tensor


class LayerHook(Protocol):
    """A per-layer controller of one forward pass (sparse updates).

    At layer ``l`` the backbone's one pass over the layer's weights calls, in order:

    1. ``extra_rows(l, h, meter)`` → :class:`~polestar.models.hooks.ExtraRows` or None: rows that go through the
       layer's q, k, v together with the plan's rows ``h [B, C, d]``;
    2. after the K/V writes, ``members(l, qkv)`` with :class:`~polestar.models.hooks.LayerQKV` →
       :class:`~polestar.models.hooks.MemberRows` or None: rows that go through attention, o and the MLP with
       the plan's rows;
    3. ``after_layer(l, out [B, M, d])`` with those rows' outputs.

    Or, for feature caching, first ``features(l, h, meter)`` → :class:`~polestar.models.hooks.CachedFeatures`:
    the layer then recomputes only those plan rows and reuses its cached attention and MLP outputs for the others
    (and calls none of the three).

    Attributes read after the pass: ``evals`` ``[B]`` long, positions of each sequence the hook computed (counted
    as that sequence's compute; with feature caching, the rows the layers recomputed minus the plan rows, which
    the engine counts as computed at every layer); ``head_rows`` ``[B, M, d]`` last-layer rows that want logits with
    the block's (an update packet), with ``head_positions`` and ``head_valid`` ``[B, M]``.
    """

    evals: torch.Tensor
    head_rows: torch.Tensor | None = None
    head_positions: torch.Tensor | None = None
    head_valid: torch.Tensor | None = None

    def features(self, layer: int, h: torch.Tensor, meter: CostMeter) -> CachedFeatures | None:
        """The rows layer ``layer`` recomputes and its cached outputs for the others (feature caching), or None
        (default: the layer recomputes every plan row)."""
        return None

    def extra_rows(self, layer: int, h: torch.Tensor, meter: CostMeter) -> ExtraRows | tuple[ExtraRows, ...] | None:
        """Rows to add to layer ``layer``'s q/k/v pass (one :class:`ExtraRows` or several), or None (default)."""
        return None

    def members(self, layer: int, qkv: LayerQKV) -> MemberRows | None:
        """Rows to add to layer ``layer``'s attention, o and MLP, picked from ``qkv``, or None (default)."""
        return None

    def after_layer(self, layer: int, out: torch.Tensor) -> None:
        """Receives the outputs ``[B, M, d]`` of the rows ``members`` returned."""
