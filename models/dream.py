"""Dream backbone (``model_type: Dream``, Qwen2.5 layout) under the real checkpoint tensor names.

Tensor names: ``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`` (q/k/v with
``.bias``), ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``, ``model.layers.{i}.input_layernorm.weight``,
``model.layers.{i}.post_attention_layernorm.weight``, ``model.norm.weight``, ``lm_head.weight``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .backbone import DiffusionLM, LayerParts
from .layers import RMSNorm
from .spec import ModelSpec, config_field, unsupported_values

# config.json values the Dream backbone implements (full attention in every layer, plain 1-D RoPE, SwiGLU)
_REQUIRED = {
    "use_sliding_window": (False, None),
    "use_mrope": (False, None),
    "rope_scaling": (None,),
    "hidden_act": ("silu",),
}


def refused_fields(cfg: dict[str, Any]) -> list[str]:
    """The config.json fields whose values the Dream backbone cannot honour, each with the values it supports."""
    return unsupported_values(cfg, _REQUIRED)


def dream_spec(cfg: dict[str, Any]) -> ModelSpec:
    """Build a :class:`ModelSpec` from a Dream ``config.json`` dict (field names of ``DreamConfig``)."""
    missing = [
        k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")
        if k not in cfg
    ]
    if missing:
        raise ValueError(f"config.json is missing Dream fields {missing}")
    refused = refused_fields(cfg)
    if refused:
        raise ValueError(f"config.json: {'; '.join(refused)}: not supported by polestar's Dream backbone, which "
                         "implements Dream-7B's full-attention, plain-RoPE layers; use a checkpoint with those values")
    eos = cfg.get("eos_token_id", 151643)
    if isinstance(eos, list) and eos:
        eos = eos[0]
    eos = config_field({"eos_token_id": eos}, "eos_token_id", "integer", 151643)
    n_heads = config_field(cfg, "num_attention_heads", "integer")
    vocab = config_field(cfg, "vocab_size", "integer")
    return ModelSpec(
        family="dream",
        n_layers=config_field(cfg, "num_hidden_layers", "integer"),
        d_model=config_field(cfg, "hidden_size", "integer"),
        n_heads=n_heads,
        n_kv_heads=config_field(cfg, "num_key_value_heads", "integer") or n_heads,
        mlp_hidden=config_field(cfg, "intermediate_size", "integer"),
        vocab_size=vocab,
        embedding_size=vocab,
        rope_theta=config_field(cfg, "rope_theta", "number", 10000.0),
        norm_eps=config_field(cfg, "rms_norm_eps", "number", 1e-6),
        max_seq_len=config_field(cfg, "max_position_embeddings", "integer", 4096),
        mask_id=config_field(cfg, "mask_token_id", "integer", 151666),
        eos_id=eos,
        pad_id=config_field(cfg, "pad_token_id", "integer", eos),
        qkv_bias=True,
        out_bias=False,
        mlp_bias=False,
        tie_embeddings=config_field(cfg, "tie_word_embeddings", "boolean", False),
        logit_shift=1,
    )


def dream_config(spec: ModelSpec) -> dict[str, Any]:
    """The ``config.json`` Dream's own code reads for ``spec``."""
    return {
        "architectures": ["DreamModel"],
        "model_type": "Dream",
        "hidden_size": spec.d_model,
        "intermediate_size": spec.mlp_hidden,
        "num_attention_heads": spec.n_heads,
        "num_key_value_heads": spec.n_kv_heads,
        "num_hidden_layers": spec.n_layers,
        "vocab_size": spec.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": spec.max_seq_len,
        "tie_word_embeddings": spec.tie_embeddings,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "mask_token_id": spec.mask_id,
        "eos_token_id": spec.eos_id,
        "pad_token_id": spec.pad_id,
        "bos_token_id": spec.eos_id,
        "torch_dtype": "float32",
        "use_cache": False,
    }


class _Attn(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        d, kv = spec.d_model, spec.n_kv_heads * spec.head_dim
        self.q_proj = nn.Linear(d, d, bias=True)
        self.k_proj = nn.Linear(d, kv, bias=True)
        self.v_proj = nn.Linear(d, kv, bias=True)
        self.o_proj = nn.Linear(d, d, bias=False)


class _MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.d_model, spec.mlp_hidden, bias=False)
        self.up_proj = nn.Linear(spec.d_model, spec.mlp_hidden, bias=False)
        self.down_proj = nn.Linear(spec.mlp_hidden, spec.d_model, bias=False)


class _DreamLayer(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.self_attn = _Attn(spec)
        self.mlp = _MLP(spec)
        self.input_layernorm = RMSNorm(spec.d_model, spec.norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.d_model, spec.norm_eps)


class Dream(DiffusionLM):
    """Dream masked-diffusion LM (Ye et al. 2025, "Dream 7B"), Qwen2 architecture, plan-executing.

    Shapes: ``input_ids [B, L]`` → logits ``[B, L, vocab]`` shifted one position right (``logits[:, i]`` is
    predicted from hidden state ``i-1``), GQA with ``n_kv_heads`` key/value heads, q/k/v bias.
    """

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(spec.vocab_size, spec.d_model)
        self.model.layers = nn.ModuleList(_DreamLayer(spec) for _ in range(spec.n_layers))
        self.model.norm = RMSNorm(spec.d_model, spec.norm_eps)
        if not spec.tie_embeddings:
            self.lm_head = nn.Linear(spec.d_model, spec.vocab_size, bias=False)
        self._parts = [
            LayerParts(
                layer.input_layernorm, layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                layer.self_attn.o_proj, layer.post_attention_layernorm, layer.mlp.gate_proj, layer.mlp.up_proj,
                layer.mlp.down_proj,
            )
            for layer in self.model.layers
        ]
        self.fuse_projections()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def layer_parts(self, layer: int) -> LayerParts:
        return self._parts[layer]

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.norm(h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        if self.spec.tie_embeddings:
            return torch.nn.functional.linear(h, self.model.embed_tokens.weight)
        return self.lm_head(h)

    def embedding_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight

    def final_norm_weight(self) -> torch.Tensor:
        return self.model.norm.weight

    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.spec.tie_embeddings else self.lm_head.weight
