"""What a layer hook may run on the model: a narrow view of a :class:`~polestar.models.backbone.DiffusionLM`.

A layer hook (:mod:`polestar.models.hooks`) runs inside the backbone's one pass over each layer. Besides the rows
that pass shows it, the only model operations it gets are a :class:`LayerOps`: a query or value projection of rows
of its own, proxy attention over a layer's keys and a token-embedding lookup, each counted on the pass's
:class:`~polestar.models.cost.CostMeter`. A refresh selector receives the model and hands its hooks this view, so
a hook's calls go one way, down to the model's leaf operations (the family's ``layer_parts`` weights and ``embed``,
the attention kernel of :meth:`~polestar.models.backbone.DiffusionLM.attention_probs`), and never back into the
backbone's layer step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import layer_regions
from .cost import CostMeter, LayerBytes
from .layer_regions import LayerWeights
from .layers import Rotary
from .spec import ModelSpec

if TYPE_CHECKING:  # the view's source, for annotations only (the backbone imports this module)
    from .backbone import DiffusionLM


class LayerOps:
    """The model operations a layer hook may run (see the module docstring), made from a model by its refresh
    selector once per step.

    ``spec``: the model's :class:`~polestar.models.spec.ModelSpec` (layer count, head shapes). Every operation takes
    the pass's ``meter`` and counts what it reads and computes there; rows are ``B`` sequences by ``X`` rows:

    * :meth:`project_queries`: ``h [B, X, d]`` → queries ``[B, H, X, hd]`` (a pass over a layer's q weight);
    * :meth:`project_values`: ``h [B, X, d]`` → values ``[B, Hkv, X, hd]`` (a pass over a layer's v weight);
    * :meth:`attention_probs`: queries ``[B, H, R, hd]`` over cached keys → fp32 ``[B, H, R, T + 1]``;
    * :meth:`embed`: token ids ``[B, X]`` → layer-0 inputs ``[B, X, d]``.
    """

    def __init__(self, model: DiffusionLM):
        self._model = model
        self.spec: ModelSpec = model.spec

    def project_queries(self, layer: int, h: torch.Tensor, positions: torch.Tensor | None,
                        meter: CostMeter) -> torch.Tensor:
        """Queries after RoPE ``[B, H, X, hd]`` of inputs ``h [B, X, d]`` at ``positions [B, X]`` (None: no RoPE, the
        queries as at position 0): a pass over the layer's q weight of its own (a hook that needs queries it could not
        ride along the layer's pass), its rows counted as probe rows."""
        parts = self._model.layer_parts(layer)
        q = self._project(parts, parts.q, self.query_bytes(layer), self.spec.n_heads, h, meter)
        if positions is None:
            return q
        cos, sin = self._model.rotary.cos_sin(positions)
        return Rotary.apply(q, cos, sin)

    def project_values(self, layer: int, h: torch.Tensor, meter: CostMeter) -> torch.Tensor:
        """Values ``[B, Hkv, X, hd]`` of inputs ``h [B, X, d]``: a pass over the layer's v weight of its own, its rows
        counted as probe rows (a hook that compares values before it picks the rows the layer recomputes)."""
        parts, counted = self._model.layer_parts(layer), self._model.layer_bytes(layer)
        return self._project(parts, parts.v, counted.attn_norm + counted.v, self.spec.n_kv_heads, h, meter)

    def _project(self, parts, linear, weight_bytes: int, n_heads: int, h: torch.Tensor,
                 meter: CostMeter) -> torch.Tensor:
        """``linear(attn_norm(h))`` for ``h [B, X, d]`` as heads ``[B, n_heads, X, hd]``, the norm's and the
        projection's weights (``weight_bytes``) and ``B · X`` probe rows counted."""
        B, X, _ = h.shape
        meter.read(weight_bytes)
        meter.rows(probe_rows=B * X)
        norm = parts.attn_norm
        out = layer_regions.active().project_rows(h, norm.weight, norm.bias, linear.weight, linear.bias, norm.eps)
        return out.view(B, X, n_heads, self.spec.head_dim).transpose(1, 2)

    def attention_probs(self, q: torch.Tensor, keys: torch.Tensor, key_valid: torch.Tensor,
                        meter: CostMeter | None = None, key_rope: tuple | None = None) -> torch.Tensor:
        """Proxy attention (:meth:`~polestar.models.backbone.DiffusionLM.attention_probs`, the kernel the pass's
        attention probe uses): ``q [B, H, R, hd]`` over ``keys [B, Hkv, T+1, hd]`` (``key_valid [B, T+1]``; keys
        rotated by ``key_rope`` first when given) → fp32 ``[B, H, R, T+1]``, masked keys at probability 0."""
        return self._model.attention_probs(q, keys, key_valid, meter, key_rope)

    def layer_weights(self, layer: int) -> LayerWeights:
        """Layer ``layer``'s tensors as the layer regions take them (for a hook that runs the layer as a region of
        its own; it counts their reads itself, from :meth:`layer_bytes`)."""
        return self._model.layer_weights(layer)

    def query_bytes(self, layer: int) -> int:
        """Bytes :meth:`project_queries` reads (the attention norm's and the q projection's weights)."""
        counted = self._model.layer_bytes(layer)
        return counted.attn_norm + counted.q

    def layer_bytes(self, layer: int) -> LayerBytes:
        """Layer ``layer``'s weight bytes per part (:class:`~polestar.models.cost.LayerBytes`)."""
        return self._model.layer_bytes(layer)

    def slot_rope(self, cache, slots: torch.Tensor):
        """Rotary factors (:class:`~polestar.models.layers.RopeTable` ``[B, X, 2, hd]``) of the positions of cache
        slots ``slots [B, X]`` (one gather)."""
        return self._model.slot_rope(cache, slots)

    def rope_of(self, cache, positions: torch.Tensor):
        """Rotary factors (:class:`~polestar.models.layers.RopeTable` ``[B, X, 2, hd]``) of RoPE ``positions [B, X]``
        (one gather)."""
        return self._model.rope_of(cache, positions)

    def embed(self, tokens: torch.Tensor, meter: CostMeter) -> torch.Tensor:
        """Layer-0 inputs ``[B, X, d]`` of token ids ``tokens [B, X]`` (the lookup reads only those embedding rows)."""
        meter.embedding(self._model.embedding_weight(), tokens.numel())
        return self._model.embed(tokens)
