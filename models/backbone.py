"""Plan-executing masked-diffusion transformer shared by the LLaDA and Dream families.

The family modules (``llada.py``, ``dream.py``) only lay out parameters under the real checkpoint names and
expose them through the accessors used here (``layer_parts``); all compute of the pass lives in this file (the
projections a layer hook runs on rows of its own are in :class:`~polestar.models.layer_ops.LayerOps`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from polestar.kernels.proxy_attention import proxy_attention

from . import layer_regions
from .cost import CostMeter, LayerBytes
from .hooks import CachedFeatures, ExtraRows, LayerHook, LayerQKV
from .layer_regions import CachedOutputs, LayerShape, LayerWeights
from .layers import RopeTable, Rotary
from .plan import DecodeCache, Plan, full_plan
from .spec import ModelSpec
from .text import TextDefaults


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


class FusedProjections(NamedTuple):
    """One layer's projections that read the same input, each as one weight: ``qkv [(H + 2 Hkv) hd, d]`` (q, k, v
    rows stacked) with ``qkv_bias [(H + 2 Hkv) hd]`` or None, ``gate_up [2 m, d]`` (gate, up) with ``gate_up_bias``
    or None. The layer's q/k/v and gate/up parameters are views into them (:meth:`DiffusionLM.fuse_projections`), so
    the weights are stored once and a layer's pass makes one matmul of each instead of five."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None


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
    #: the checkpoint's tokenizer (a ``transformers.PreTrainedTokenizerBase``), None without tokenizer files
    tokenizer: Any | None = None
    #: the checkpoint's stop token ids and decoding defaults (``generation_config.json``), None when unknown
    text_defaults: TextDefaults | None = None
    #: the checkpoint directory the model was loaded from, None for a model built in memory
    name_or_path: str | None = None

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.rotary = Rotary(spec.head_dim, spec.rope_theta)
        self._fused: list[FusedProjections] = []
        self._stacks: LayerWeights | None = None
        self._stacked_ids: list[int] = []
        self._weights: list[LayerWeights] = []
        self._layer_bytes: list[LayerBytes] = []

    # -- fused projections, stacked over layers ----------------------------------------------------------
    def fuse_projections(self) -> None:
        """Store every layer tensor a pass reads in one tensor per :class:`~polestar.models.layer_regions.
        LayerWeights` field, stacked over the layers (``[n_layers, ...]``), each layer's
        q/k/v rows together (:class:`FusedProjections`) and its gate/up rows together; the parameters are re-pointed
        as views into them (a layer's pass reads its rows). Parameters already in place are left as they are. The
        families call it once built; moving or casting the model (``to``, ``to_empty``, ``float``) moves each stack as
        one tensor (:meth:`_apply`), and :meth:`ensure_fused` before a decode notices parameters replaced by hand."""
        parts = [self.layer_parts(layer) for layer in range(self.spec.n_layers)]
        self._stacks = LayerWeights(*(_stacked_view(group, len(parts)) for group in _stack_groups(parts)))
        self._point_fused()

    def _point_fused(self) -> None:
        """Each layer's :class:`FusedProjections` as rows of the stacks, the lists the passes read, and which
        parameter objects the stacks hold (what :meth:`_stacks_intact` compares on the meta device)."""
        parts = [self.layer_parts(layer) for layer in range(self.spec.n_layers)]
        self._stacked_ids = [id(p) for group in _stack_groups(parts) for p in group]
        st = self._stacks
        self._fused = [FusedProjections(st.qkv[layer], None if st.qkv_bias is None else st.qkv_bias[layer],
                                        st.gate_up[layer], None if st.gate_up_bias is None else st.gate_up_bias[layer])
                       for layer in range(self.spec.n_layers)]
        self._list_weights()

    def _list_weights(self) -> None:
        """The layers' tensors as the layer regions take them, and their byte counts (:class:`LayerBytes`)."""
        layers = range(self.spec.n_layers)
        self._weights = [self._layer_weights(layer) for layer in layers]
        self._layer_bytes = [LayerBytes.of(*self.layer_parts(layer)) for layer in layers]

    def layer_bytes(self, layer: int) -> LayerBytes:
        """Layer ``layer``'s weight bytes per part (:class:`~polestar.models.cost.LayerBytes`; listed on the host
        with the weights)."""
        return self._layer_bytes[layer]

    def step_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the model a decoding step may read: parameters, buffers, the fused projections and the
        stacks (as the layers take them now; a captured step graph is dropped when one of them is replaced,
        :meth:`polestar.step_graphs.StepGraphs.keep_valid`)."""
        fused = [t for f in self._fused for t in f if t is not None]
        stacks = [t for t in self._stacks if t is not None] if self._stacks is not None else []
        return [*self.parameters(), *self.buffers(), *fused, *stacks]

    def ensure_fused(self) -> None:
        """Re-stack (:meth:`fuse_projections`) if any parameter no longer lies in its stack (a parameter assigned by
        hand, ``load_state_dict(assign=True)``). Host-side; the engine calls it before a generation's first step."""
        if not self._stacks_intact():
            self.fuse_projections()

    def _stacks_intact(self) -> bool:
        if self._stacks is None:
            return False
        parts = [self.layer_parts(layer) for layer in range(self.spec.n_layers)]
        if self._stacks.qkv.device.type == "meta":  # no addresses to compare: the same parameter objects
            return self._stacked_ids == [id(p) for group in _stack_groups(parts) for p in group]
        return all(_is_view_of(None if whole is None else _flat(whole), group)
                   for whole, group in zip(self._stacks, _stack_groups(parts)))

    def _layer_weights(self, layer: int, fused: FusedProjections | None = None) -> LayerWeights:
        p, f = self.layer_parts(layer), self._fused[layer] if fused is None else fused
        return LayerWeights(p.attn_norm.weight, p.attn_norm.bias, f.qkv, f.qkv_bias, p.o.weight, p.o.bias,
                            p.mlp_norm.weight, p.mlp_norm.bias, f.gate_up, f.gate_up_bias, p.down.weight, p.down.bias)

    @property
    def layer_shape(self) -> LayerShape:
        """The Python constants of this model's layer regions (:class:`~polestar.models.layer_regions.LayerShape`)."""
        spec = self.spec
        return LayerShape(spec.n_heads, spec.n_kv_heads, spec.norm_eps)

    def layer_weights(self, layer: int) -> LayerWeights:
        """Layer ``layer``'s tensors as the layer regions take them (:mod:`polestar.models.layer_regions`), with its
        :meth:`projections`."""
        if not torch.is_grad_enabled():  # decoding: the stored ones
            return self._weights[layer]
        fused = self.projections(layer)
        return self._weights[layer] if fused is self._fused[layer] else self._layer_weights(layer, fused)

    def projections(self, layer: int) -> FusedProjections:
        """Layer ``layer``'s :class:`FusedProjections`. Under autograd with trainable weights they are concatenated
        from the parameters (so gradients reach them); otherwise the stored fused tensors."""
        parts = self.layer_parts(layer)
        if torch.is_grad_enabled() and parts.q.weight.requires_grad:
            return FusedProjections(*(None if ps[0] is None else torch.cat(ps) for ps in _fused_groups(parts)))
        return self._fused[layer]

    def _apply(self, fn, recurse=True):
        """``Module._apply`` (``to``, ``to_empty``, casts) with each stack moved as one tensor and its parameters
        re-pointed into the result: the device holds the weights once, not the parameters and a new stack beside
        them. A model whose parameters left their stacks is moved parameter by parameter and stacked again."""
        if not self._stacks_intact():
            self._stacks, self._fused = None, []  # freed with the parameters they held
            out = super()._apply(fn, recurse)
            self.fuse_projections()
            return out
        parts = [self.layer_parts(layer) for layer in range(self.spec.n_layers)]
        owners = _owners(self, [p for group in _stack_groups(parts) for p in group if p is not None])
        for module, name, _ in owners:  # hidden from Module._apply, which skips a None parameter
            module._parameters[name] = None
        try:
            out = super()._apply(fn, recurse)
        finally:
            for module, name, param in owners:
                module._parameters[name] = param
        self._stacks = LayerWeights(*(None if t is None else fn(t) for t in self._stacks))
        views = {id(p): view for whole, group in zip(self._stacks, _stack_groups(parts)) if whole is not None
                 for p, view in zip(group, _row_views(_flat(whole), group))}
        with torch.no_grad():
            for module, name, param in owners:
                view = views[id(param)]
                if torch._has_compatible_shallow_copy_type(param, view):
                    param.data = view
                else:  # meta → a device: a new parameter object, as Module._apply makes
                    module._parameters[name] = nn.Parameter(view, requires_grad=param.requires_grad)
        self._point_fused()
        return out

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
        """A :class:`DecodeCache` for ``attention_mask [B, T]``, with the rotary factors of every position
        ``0 .. T`` (``position_rope``, built once here: a step looks its rows' factors up instead of computing them)."""
        cache = DecodeCache(self.spec, attention_mask, self.dtype, store_hidden)
        B, T = attention_mask.shape
        table = self.rotary.table(torch.arange(T + 1, device=attention_mask.device)[None])
        cache.set_rope(RopeTable(table.factors.expand(B, -1, -1, -1)))
        return cache

    def rope_of(self, cache: DecodeCache, positions: torch.Tensor) -> RopeTable:
        """Rotary factors of RoPE ``positions [B, X]``: looked up in the cache's ``position_rope`` (one gather),
        or computed (:meth:`Rotary.table`) for a cache built without it. The same values either way."""
        if cache.position_rope is None:
            return self.rotary.table(positions)
        return cache.position_rope.rows(positions)

    def slot_rope(self, cache: DecodeCache, slots: torch.Tensor) -> RopeTable:
        """Rotary factors of the positions of cache slots ``slots [B, X]``: one gather from the cache's
        ``slot_rope``, or :meth:`rope_of` their positions for a cache built without it."""
        if cache.slot_rope is None:
            return self.rope_of(cache, cache.positions.gather(1, slots))
        return cache.slot_rope.rows(slots)

    # -- plain forward --------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Full forward: ``input_ids [B, L]`` → logits ``[B, L, V]`` (shifted for Dream)."""
        B, L = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, L, dtype=torch.bool, device=input_ids.device)
        cache = self.new_cache(attention_mask)
        self.ensure_fused()
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
        hook: LayerHook | None = None,
        meter: CostMeter | None = None,
    ) -> PlanOutput:
        """Execute ``plan`` for the tokens ``ids [B, T]``, updating ``cache`` in place.

        Layer ``l`` takes the input hidden states of its slots (fresh from layer ``l-1`` when the slots are the
        same; otherwise the stored layer input, into which layer ``l-1``'s outputs were written first) and runs
        one pass over the layer's weights (see :meth:`layer_step`).

        ``hook`` (optional, a sparse-update controller, :class:`~polestar.models.hooks.LayerHook`) adds rows to each
        layer's pass: ``extra_rows(layer, h, meter)`` → :class:`ExtraRows` (through q, k, v),
        ``members(layer, LayerQKV)`` → :class:`MemberRows` (through attention, o and the MLP) and
        ``after_layer(layer, out)``; or, with ``features(layer, h, meter)`` → :class:`CachedFeatures`, restricts the
        layer's pass to some plan rows and reuses the layer's cached outputs for the others. ``meter`` (optional)
        counts what the pass reads and computes.
        """
        spec = self.spec
        meter = CostMeter() if meter is None else meter
        trash = cache.trash
        probe_out = None
        prev_index = None
        h = None
        if plan.first_layer > 0 and not plan.per_layer:
            raise ValueError("a plan that starts above layer 0 must be per layer")
        per_layer = plan.per_layer  # read once: a compiled step traces this loop's body once per layer
        shared = None if per_layer else torch.where(plan.valid, plan.index, trash)
        rope = None if shared is None else self.slot_rope(cache, shared)
        layer = plan.first_layer
        while layer < spec.n_layers:
            if shared is None:
                index, valid = plan.at(layer)
                index = torch.where(valid, index, trash)
                rope = self.slot_rope(cache, index)
            else:
                index = shared
            if layer == 0:
                tokens = torch.cat([ids, ids[:, :1]], dim=1).gather(1, index)
                h = self.embed(tokens)
                meter.embedding(self.embedding_weight(), tokens.numel())
            elif per_layer:
                if cache.hidden is None:
                    raise ValueError("a per-layer plan needs a cache made with store_hidden=True")
                if prev_index is not None:
                    _scatter_rows(cache.hidden[layer], prev_index, h)
                h = cache.hidden[layer].gather(1, index[..., None].expand(-1, -1, spec.d_model))
            if cache.hidden is not None and (layer == 0 or not per_layer):
                _scatter_rows(cache.hidden[layer], index, h)
            want_probe = probe is not None and probe.layer == layer
            h, probs = self.layer_step(layer, h, index, rope, cache, probe.rows if want_probe else None, hook, meter)
            if want_probe:
                probe_out = probs
            prev_index = index
            layer += 1
        out = self.final_norm(h)
        meter.weight(self.final_norm_weight())
        return PlanOutput(out, probe_out)

    def embedding_weight(self) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def final_norm_weight(self) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def head_weight(self) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def write_kv(self, cache: DecodeCache, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k, v [B, Hkv, X, hd]`` into layer ``layer`` of ``cache`` at positions ``index [B, X]``
        (unused slots must point at the trash slot)."""
        slot = index[:, None, :, None].expand(-1, self.spec.n_kv_heads, -1, self.spec.head_dim)
        cache.k[layer].scatter_(2, slot, k)
        cache.v[layer].scatter_(2, slot, v)

    def project_qkv(self, layer: int, rows: torch.Tensor, rope: RopeTable, meter: CostMeter):
        """Layer ``layer``'s q, k, v of ``rows [B, X, d]``: the attention norm, one matmul over the fused q/k/v weight
        (:meth:`projections`) and one rotation of the q and k heads together (``rope``: the rows' :class:`RopeTable`),
        in one compile region (:func:`~polestar.models.layer_regions.qkv_rows`) → ``q [B, H, X, hd]``,
        ``k, v [B, Hkv, X, hd]`` (views). Counted on ``meter`` as the norm's and each projection's weights."""
        spec, w = self.spec, self.layer_weights(layer)
        H = spec.n_heads
        qk, qkv = layer_regions.active().qkv_rows(rows, rope, w, self.layer_shape)
        v = qkv[:, :, H + spec.n_kv_heads :]
        meter.read(self._layer_bytes[layer].qkv_pass)
        return qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), v.transpose(1, 2)

    def _count_out_mlp(self, layer: int, meter: CostMeter) -> None:
        """Count one pass over layer ``layer``'s o, MLP norm, gate, up and down weights."""
        meter.read(self._layer_bytes[layer].out_mlp_pass)

    def layer_step(self, layer, h, index, rope: RopeTable, cache: DecodeCache, probe_rows, hook: LayerHook | None,
                   meter: CostMeter):
        """One pass over layer ``layer``'s weights: each projection (the fused q/k/v, o, the fused gate/up, down) is
        applied once, to the plan's rows ``h [B, C, d]`` (slots ``index``, rotary factors ``rope`` of ``C`` rows)
        concatenated with the hook's rows.

        1. q, k, v of [plan rows | hook's extra rows]; K/V written at their slots (extra rows that only query
           point at the trash slot);
        2. the hook picks its member rows from what it sees (:class:`LayerQKV`);
        3. [plan rows | member rows] attend over the layer's cached K/V, then o and the MLP;
        4. the members' outputs go to ``hook.after_layer``.

        With :class:`CachedFeatures` from ``hook.features`` (feature caching) the pass runs on their ``rows`` only
        and every plan row's output is its input plus the layer's cached attention and MLP outputs (see
        :meth:`_feature_step`).

        Returns the plan rows' outputs ``[B, C, d]`` and the probed attention ``[B, H, R, T+1]`` (or None).
        """
        if hook is None and probe_rows is None:
            return self._plain_step(layer, h, index, rope, cache, meter), None
        features = hook.features(layer, h, meter) if hasattr(hook, "features") else None
        if features is not None:
            if probe_rows is not None:
                raise ValueError("an attention probe cannot ride along a layer that reuses cached features")
            return self._feature_step(layer, h, index, rope, cache, hook, meter, features), None
        spec = self.spec
        B, C, _ = h.shape
        extra = hook.extra_rows(layer, h, meter) if hook is not None else None
        rows, kv_index = h, index
        if extra is not None:
            parts = (extra,) if isinstance(extra, ExtraRows) else extra
            rows = torch.cat([h, *(p.inputs.to(h.dtype) for p in parts)], dim=1)
            kv_index = torch.cat([index, *(p.kv_index for p in parts)], dim=1)
            if all(p.by_slot for p in parts):  # every row rotates by its slot: one lookup for all of them
                rope = self.slot_rope(cache, kv_index)
            else:
                rope = RopeTable.join([rope, *(self._extra_rope(cache, p) for p in parts)])
        X = rows.shape[1]
        q, k, v = self.project_qkv(layer, rows, rope, meter)
        self.write_kv(cache, layer, kv_index, k, v)
        members = hook.members(layer, LayerQKV(h, index, q, v, meter)) if hook is not None else None
        q_att, resid = q[:, :, :C], h
        if members is not None and members.joined:  # the hook gathered the attention rows, the plan's first
            q_att, resid = members.q, members.inputs
        elif members is not None:
            q_att = torch.cat([q_att, members.q.to(q.dtype)], dim=2)
            resid = torch.cat([h, members.inputs.to(h.dtype)], dim=1)
        M = resid.shape[1] - C
        meter.rows(layer_rows=B * (C + M), probe_rows=B * (X - C))
        keys, values = cache.k[layer], cache.v[layer]
        meter.attention(keys, values)
        probs = None
        if probe_rows is not None:
            rows_q = probe_rows[:, None, :, None].expand(-1, spec.n_heads, -1, spec.head_dim)
            probs = self.attention_probs(q_att.gather(2, rows_q), keys, cache.key_valid, meter)
        w = self.layer_weights(layer)
        regions = layer_regions.active()
        out = regions.attend_mlp(q_att, resid, cache.layer(layer), w, self.layer_shape)
        self._count_out_mlp(layer, meter)
        if members is not None:
            hook.after_layer(layer, out[:, C:])
            out = out[:, :C]
        return out, probs

    def _extra_rope(self, cache: DecodeCache, extra: ExtraRows) -> RopeTable:
        """The rotary factors of a hook's extra rows: given, looked up from their positions, or by their slots."""
        if extra.rope is not None:
            return extra.rope
        if extra.positions is not None:
            return self.rope_of(cache, extra.positions)
        return self.slot_rope(cache, extra.kv_index)

    def _plain_step(self, layer, h, index, rope: RopeTable, cache: DecodeCache, meter: CostMeter) -> torch.Tensor:
        """:meth:`layer_step` without a hook or a probe: the whole layer as one region
        (:meth:`~polestar.models.layer_regions.LayerPasses.decoder_layer`), its K/V written in place."""
        out = layer_regions.active().passes.decoder_layer(h, index, rope, cache.layer(layer),
                                                          self.layer_weights(layer), self.layer_shape)
        counted = self._layer_bytes[layer]  # one meter call: each call a compiled step traces at every layer
        meter.add(counted.qkv_pass + counted.out_mlp_pass, 2 * cache.layer_kv_bytes, h.shape[0] * h.shape[1])
        return out

    def _feature_step(self, layer, h, index, rope: RopeTable, cache: DecodeCache, hook: LayerHook, meter: CostMeter,
                      features: CachedFeatures) -> torch.Tensor:
        """:meth:`layer_step` with feature caching: the ``R`` rows of ``features.rows`` go through q/k/v (K/V written
        at their slots), attention over the layer's cache, o (→ ``features.attn`` at those rows), then the MLP of
        ``h + attn`` at those rows (→ ``features.mlp``); every plan row's output is ``(h + attn) + mlp`` ``[B, C, d]``.
        With ``R = 0`` no weight is read. The hook may not add extra rows or members to such a layer."""
        rows = features.rows
        B, R = rows.shape
        if R > 0:
            out = layer_regions.active().passes.feature_layer(
                h, rows, index, rope, cache.layer(layer), CachedOutputs(features.attn, features.mlp),
                self.layer_weights(layer), self.layer_shape)
            counted = self._layer_bytes[layer]
            meter.add(counted.qkv_pass + counted.out_mlp_pass, 2 * cache.layer_kv_bytes, B * R)
            return out
        return (h + features.attn) + features.mlp

    def attention_probs(self, q: torch.Tensor, keys: torch.Tensor, key_valid: torch.Tensor,
                        meter: CostMeter | None = None, key_rope: tuple | None = None) -> torch.Tensor:
        """Softmax attention of queries ``[B, H, R, hd]`` over cached keys ``[B, Hkv, T+1, hd]`` → fp32
        ``[B, H, R, T+1]`` with masked keys at probability 0 (reads the keys once; counted when ``meter``). With
        ``key_rope`` (cos, sin ``[B, 1, T+1, hd]``) the keys are rotated by it as they are read (one operation,
        :func:`~polestar.kernels.proxy_attention.proxy_attention`)."""
        if meter is not None:
            meter.attention(keys, None)
        cos, sin = key_rope if key_rope is not None else (None, None)
        return proxy_attention(q, keys, key_valid, 1.0 / math.sqrt(self.spec.head_dim), key_cos=cos, key_sin=sin)

    def logits(self, h: torch.Tensor, meter: CostMeter | None = None) -> torch.Tensor:
        """LM head of final-normed hidden states ``[B, X, d]`` → ``[B, X, V]``: one pass over the head weight."""
        if meter is not None:
            meter.weight(self.head_weight())
        return self.head(h)


def _scatter_rows(buffer: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """``buffer[b, index[b, c]] = values[b, c]`` in place; ``buffer [B, T+1, d]``, ``index [B, C]``."""
    buffer.scatter_(1, index[..., None].expand(-1, -1, buffer.shape[-1]), values)


def _fused_groups(p: LayerParts) -> tuple[tuple[torch.Tensor | None, ...], ...]:
    """The parameters of each :class:`FusedProjections` field, in its order (a bias group holds Nones without
    biases)."""
    return ((p.q.weight, p.k.weight, p.v.weight), (p.q.bias, p.k.bias, p.v.bias), (p.gate.weight, p.up.weight),
            (p.gate.bias, p.up.bias))


def _is_view_of(whole: torch.Tensor | None, params: tuple[torch.Tensor | None, ...]) -> bool:
    """Whether ``params`` lie back to back in ``whole`` (the fused tensor they were made views of). On the meta
    device, which has no addresses, never."""
    if whole is None or params[0] is None:
        return whole is None and params[0] is None
    if whole.device.type == "meta":
        return False
    row, ptr = whole.stride(0) * whole.element_size(), whole.data_ptr()
    for p in params:
        if p.data_ptr() != ptr or p.dtype != whole.dtype:
            return False
        ptr += p.shape[0] * row
    return ptr == whole.data_ptr() + whole.shape[0] * row


def _stack_groups(parts: list[LayerParts]) -> tuple[tuple[torch.Tensor | None, ...], ...]:
    """The parameters of each :class:`~polestar.models.layer_regions.LayerWeights` field over all layers, in its
    order: layer 0's (q, k, v for ``qkv``), then layer 1's, ... (a bias group holds Nones without biases)."""
    fields = ([(p.attn_norm.weight,) for p in parts], [(p.attn_norm.bias,) for p in parts],
              [g[0] for g in map(_fused_groups, parts)], [g[1] for g in map(_fused_groups, parts)],
              [(p.o.weight,) for p in parts], [(p.o.bias,) for p in parts],
              [(p.mlp_norm.weight,) for p in parts], [(p.mlp_norm.bias,) for p in parts],
              [g[2] for g in map(_fused_groups, parts)], [g[3] for g in map(_fused_groups, parts)],
              [(p.down.weight,) for p in parts], [(p.down.bias,) for p in parts])
    return tuple(tuple(t for layer in field for t in layer) for field in fields)


def _flat(whole: torch.Tensor) -> torch.Tensor:
    """A stack ``[n_layers, rows, ...]`` as its rows back to back ``[n_layers · rows, ...]`` (a view)."""
    return whole.view(-1, *whole.shape[2:])


def _stacked_view(params: tuple[torch.Tensor | None, ...], n_layers: int) -> torch.Tensor | None:
    """:func:`_fused_view` of one field's parameters over all layers, shaped ``[n_layers, rows, ...]``."""
    whole = _fused_view(params)
    return None if whole is None else whole.view(n_layers, -1, *whole.shape[1:])


def _row_views(whole: torch.Tensor, params: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Consecutive rows of ``whole``, one view per parameter of ``params`` with its row count."""
    views, offset = [], 0
    for p in params:
        views.append(whole[offset : offset + p.shape[0]])
        offset += p.shape[0]
    return views


def _point_into(whole: torch.Tensor, params: tuple[torch.Tensor, ...]) -> None:
    """Re-point ``params`` (``.data``) at consecutive rows of ``whole``."""
    for p, view in zip(params, _row_views(whole, params)):
        p.data = view


def _owners(model: nn.Module, params: list[torch.Tensor]) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """``(module, name, parameter)`` of each of ``params`` among ``model``'s modules."""
    wanted = {id(p) for p in params}
    return [(module, name, p) for module in model.modules() for name, p in module._parameters.items()
            if p is not None and id(p) in wanted]


def _fused_view(params: tuple[torch.Tensor | None, ...]) -> torch.Tensor | None:
    """One tensor holding ``params`` stacked along their output rows, each parameter a view (``.data``) of its rows:
    the parameters' own storage when they already lie back to back in it, else a new tensor they are copied into
    and re-pointed at. None when they have none (no bias)."""
    if params[0] is None:
        return None
    first = params[0]
    rows = sum(p.shape[0] for p in params)
    if first.device.type != "meta" and all(p.is_contiguous() and p.dtype == first.dtype for p in params):
        storage, ptr = first.untyped_storage(), first.data_ptr()
        for p in params:
            if p.untyped_storage().data_ptr() != storage.data_ptr() or p.data_ptr() != ptr:
                break
            ptr += p.numel() * p.element_size()
        else:
            return first.data.new_empty(0).set_(storage, first.storage_offset(), (rows, *first.shape[1:]),
                                                first.stride())
    with torch.no_grad():
        whole = torch.cat([p.data for p in params])
        _point_into(whole, params)
    return whole
