"""Plan-executing masked-diffusion transformer shared by the LLaDA and Dream families.

The family modules (``llada.py``, ``dream.py``) only lay out parameters under the real checkpoint names and
expose them through the accessors used here (``layer_parts``); all compute lives in this file.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from polestar.kernels.proxy_attention import proxy_attention

from .layers import Rotary
from .plan import DecodeCache, Plan, full_plan
from .spec import ModelSpec


class LayerParts(NamedTuple):
    """The modules of one transformer layer, whatever the checkpoint calls them."""

    attn_norm: nn.Module
    q: nn.Linear
    k: nn.Linear
    v: nn.Linear
    o: nn.Linear
    mlp_norm: nn.Module
    gate: nn.Linear
    up: nn.Linear
    down: nn.Linear


class AttentionProbe(NamedTuple):
    """Ask a forward pass for the attention probabilities of some query rows at one layer.

    ``layer``: int; ``rows``: LongTensor ``[B, R]`` of slot indices into that layer's plan slots.
    The forward returns them as ``[B, n_heads, R, T + 1]`` fp32 (the trash slot and padding get probability 0).
    """

    layer: int
    rows: torch.Tensor


class PlanOutput(NamedTuple):
    """Result of executing a plan.

    ``hidden``: ``[B, C, d_model]`` final-norm hidden states of the last layer's slots;
    ``probe``: ``[B, n_heads, R, T + 1]`` attention probabilities when an :class:`AttentionProbe` was given.
    """

    hidden: torch.Tensor
    probe: torch.Tensor | None = None


class DiffusionLM(nn.Module):
    """Bidirectional transformer (no causal mask) that executes refresh plans against a :class:`DecodeCache`.

    Subclasses register parameters under the checkpoint's tensor names and implement ``embed``,
    ``layer_parts``, ``final_norm`` and ``head``. ``model(input_ids [B, L])`` gives full-forward logits
    ``[B, L, V]``; for Dream they are already shifted (``logits[:, i]`` from hidden state ``i-1``,
    ``logits[:, 0]`` from hidden state 0), as Dream's generation code uses them.
    """

    spec: ModelSpec

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.rotary = Rotary(spec.head_dim, spec.rope_theta)

    # -- family hooks -------------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def layer_parts(self, layer: int) -> LayerParts:  # pragma: no cover - abstract
        raise NotImplementedError

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def head(self, h: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        """Final-normed hidden ``[..., d]`` → logits ``[..., V]``."""
        raise NotImplementedError

    # -- properties ---------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.rotary.inv_freq.device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def new_cache(self, attention_mask: torch.Tensor, store_hidden: bool = False) -> DecodeCache:
        return DecodeCache(self.spec, attention_mask, self.dtype, store_hidden)

    # -- plain forward --------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Full forward: ``input_ids [B, L]`` → logits ``[B, L, V]`` (shifted for Dream)."""
        B, L = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, L, dtype=torch.bool, device=input_ids.device)
        cache = self.new_cache(attention_mask)
        out = self.run_plan(input_ids, cache, full_plan(B, L, input_ids.device))
        logits = self.head(out.hidden)
        if self.spec.logit_shift:
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        return logits

    # -- plan execution -----------------------------------------------------------------------------------
    def run_plan(
        self,
        ids: torch.Tensor,
        cache: DecodeCache,
        plan: Plan,
        probe: AttentionProbe | None = None,
        hook=None,
    ) -> PlanOutput:
        """Execute ``plan`` for the tokens ``ids [B, T]``, updating ``cache`` in place.

        Layer ``l`` takes the input hidden states of its slots (fresh from layer ``l-1`` when the slots are the
        same; otherwise the stored layer input, into which layer ``l-1``'s outputs were written first), writes
        their K/V (and stored input) into the cache, attends over every valid cached key, and applies the MLP.

        ``hook`` (optional, a sparse-refresh controller, :class:`polestar.stages.LayerHook`) is called at each
        layer with ``before_attention(layer, h, index)`` after the slots' K/V are written and before any query
        attends (it may write more K/V and recompute more rows).
        """
        spec = self.spec
        trash = cache.trash
        probe_out = None
        prev_index = None
        h = None
        for layer in range(spec.n_layers):
            index, valid = plan.at(layer)
            index = torch.where(valid, index, trash)
            if layer == 0:
                tokens = torch.cat([ids, ids[:, :1]], dim=1).gather(1, index)
                h = self.embed(tokens)
            elif plan.per_layer:
                if cache.hidden is None:
                    raise ValueError("a per-layer plan needs a cache made with store_hidden=True")
                _scatter_rows(cache.hidden[layer], prev_index, h)
                h = cache.hidden[layer].gather(1, index[..., None].expand(-1, -1, spec.d_model))
            if cache.hidden is not None and (layer == 0 or not plan.per_layer):
                _scatter_rows(cache.hidden[layer], index, h)
            positions = cache.positions.gather(1, index)
            want_probe = probe is not None and probe.layer == layer
            h, probs = self._layer(layer, h, index, positions, cache, probe.rows if want_probe else None, hook)
            if want_probe:
                probe_out = probs
            prev_index = index
        return PlanOutput(self.final_norm(h), probe_out)

    def layer_kv(self, layer: int, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (after RoPE) and values of inputs ``h [B, X, d]`` at ``positions [B, X]`` → ``[B, Hkv, X, hd]`` each."""
        spec = self.spec
        parts = self.layer_parts(layer)
        B, X, _ = h.shape
        x = parts.attn_norm(h)
        k = parts.k(x).view(B, X, spec.n_kv_heads, spec.head_dim).transpose(1, 2)
        v = parts.v(x).view(B, X, spec.n_kv_heads, spec.head_dim).transpose(1, 2)
        cos, sin = self.rotary.cos_sin(positions)
        return Rotary.apply(k, cos, sin), v

    def write_kv(self, cache: DecodeCache, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k, v [B, Hkv, X, hd]`` into layer ``layer`` of ``cache`` at positions ``index [B, X]``
        (unused slots must point at the trash slot)."""
        slot = index[:, None, :, None].expand(-1, self.spec.n_kv_heads, -1, self.spec.head_dim)
        cache.k[layer].scatter_(2, slot, k)
        cache.v[layer].scatter_(2, slot, v)

    def layer_rows(
        self, layer: int, h: torch.Tensor, positions: torch.Tensor, cache: DecodeCache, probe_rows=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Queries of ``h [B, X, d]`` at ``positions [B, X]`` attend over layer ``layer``'s cached K/V, then the MLP:
        the layer's output ``[B, X, d]`` for those rows (their own K/V are not written)."""
        spec = self.spec
        parts = self.layer_parts(layer)
        B, X, _ = h.shape
        x = parts.attn_norm(h)
        q = parts.q(x).view(B, X, spec.n_heads, spec.head_dim).transpose(1, 2)
        cos, sin = self.rotary.cos_sin(positions)
        q = Rotary.apply(q, cos, sin)
        keys, values = cache.k[layer], cache.v[layer]
        att = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=cache.key_valid[:, None, None, :], enable_gqa=spec.n_kv_heads != spec.n_heads
        )
        probs = None
        if probe_rows is not None:
            rows = probe_rows[:, None, :, None].expand(-1, spec.n_heads, -1, spec.head_dim)
            probs = self.attention_probs(q.gather(2, rows), keys, cache.key_valid)
        h = h + parts.o(att.transpose(1, 2).reshape(B, X, spec.d_model))
        y = parts.mlp_norm(h)
        return h + parts.down(F.silu(parts.gate(y)) * parts.up(y)), probs

    def _layer(self, layer, h, index, positions, cache: DecodeCache, probe_rows, hook=None):
        k, v = self.layer_kv(layer, h, positions)
        self.write_kv(cache, layer, index, k, v)
        if hook is not None:
            hook.before_attention(layer, h, index)
        return self.layer_rows(layer, h, positions, cache, probe_rows)

    def query_probs(self, layer: int, h: torch.Tensor, positions: torch.Tensor, cache: DecodeCache) -> torch.Tensor:
        """Attention probabilities ``[B, H, X, T+1]`` of inputs ``h [B, X, d]`` at ``positions`` over layer
        ``layer``'s cached keys (nothing written)."""
        spec = self.spec
        parts = self.layer_parts(layer)
        B, X, _ = h.shape
        q = parts.q(parts.attn_norm(h)).view(B, X, spec.n_heads, spec.head_dim).transpose(1, 2)
        cos, sin = self.rotary.cos_sin(positions)
        return self.attention_probs(Rotary.apply(q, cos, sin), cache.k[layer], cache.key_valid)

    def attention_probs(self, q: torch.Tensor, keys: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
        """Softmax attention of queries ``[B, H, R, hd]`` over cached keys ``[B, Hkv, T+1, hd]`` → fp32
        ``[B, H, R, T+1]`` with masked keys at probability 0."""
        return proxy_attention(q, keys, key_valid, 1.0 / math.sqrt(self.spec.head_dim))

    def proxy_attention(
        self, layer: int, vectors: torch.Tensor, cache: DecodeCache, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Score probe vectors against layer ``layer``'s cached keys.

        ``vectors [B, P, d_model]`` go through the layer's input norm and query projection (RoPE at
        ``positions [B, P]`` when given) and attend over the cached keys; returns fp32 ``[B, n_heads, P, T+1]``.
        """
        spec = self.spec
        parts = self.layer_parts(layer)
        B, P, _ = vectors.shape
        q = parts.q(parts.attn_norm(vectors.to(self.dtype))).view(B, P, spec.n_heads, spec.head_dim).transpose(1, 2)
        if positions is not None:
            cos, sin = self.rotary.cos_sin(positions)
            q = Rotary.apply(q, cos, sin)
        return self.attention_probs(q, cache.k[layer], cache.key_valid)


def _scatter_rows(buffer: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """``buffer[b, index[b, c]] = values[b, c]`` in place; ``buffer [B, T+1, d]``, ``index [B, C]``."""
    buffer.scatter_(1, index[..., None].expand(-1, -1, buffer.shape[-1]), values)
