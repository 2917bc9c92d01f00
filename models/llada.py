"""LLaDA backbone (``model_type: llada``) under the real checkpoint tensor names.

Tensor names (LLaDA-8B): ``model.transformer.wte.weight``, ``model.transformer.blocks.{i}.{q_proj,k_proj,v_proj,
attn_out,ff_proj,up_proj,ff_out,attn_norm,ff_norm}.weight``, ``model.transformer.ln_f.weight``,
``model.transformer.ff_out.weight`` (absent with ``weight_tying``). SwiGLU MLP
``ff_out(silu(ff_proj(x)) * up_proj(x))``, half-split RoPE, RMSNorm, bidirectional attention.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .backbone import DiffusionLM, LayerParts
from .layers import RMSNorm
from .spec import ModelSpec, config_field, unsupported_values

# config.json values our LLaDA backbone implements; anything else is refused with the field named.
_REQUIRED = {
    "block_type": ("llama",),
    "layer_norm_type": ("rms",),
    "activation_type": ("silu",),
    "rope": (True,),
    "alibi": (False, None),
    "attention_layer_norm": (False, None),
    "input_emb_norm": (False, None),
    "scale_logits": (False, None),
    "multi_query_attention": (None, False),
    "layer_norm_with_affine": (True, None),
    "rope_full_precision": (True, None),
    "yarn": (False, None),
    "rope_scaling": (None,),
}


def refused_fields(cfg: dict[str, Any]) -> list[str]:
    """The config.json fields whose values the LLaDA backbone cannot honour, each with the values it supports."""
    return unsupported_values(cfg, _REQUIRED)


def llada_spec(cfg: dict[str, Any]) -> ModelSpec:
    """Build a :class:`ModelSpec` from a LLaDA ``config.json`` dict (field names of ``LLaDAConfig``)."""
    refused = refused_fields(cfg)
    if refused:
        raise ValueError(f"config.json: {'; '.join(refused)}: not supported by polestar's LLaDA backbone, which "
                         "implements LLaDA-8B's plain-RoPE 'llama' blocks; use a checkpoint with those values")
    missing = [k for k in ("d_model", "n_heads", "n_layers", "vocab_size") if k not in cfg]
    if missing:
        raise ValueError(f"config.json is missing LLaDA fields {missing}")
    d = config_field(cfg, "d_model", "integer")
    include_bias = config_field(cfg, "include_bias", "boolean", False)
    mlp_hidden = config_field(cfg, "mlp_hidden_size", "integer") or config_field(cfg, "mlp_ratio", "integer", 4) * d
    vocab = config_field(cfg, "vocab_size", "integer")
    emb = config_field(cfg, "embedding_size", "integer") or vocab
    n_heads = config_field(cfg, "n_heads", "integer")
    eos = config_field(cfg, "eos_token_id", "integer", 126081)
    norm_bias = config_field(cfg, "bias_for_layer_norm", "boolean")
    return ModelSpec(
        family="llada",
        n_layers=config_field(cfg, "n_layers", "integer"),
        d_model=d,
        n_heads=n_heads,
        n_kv_heads=config_field(cfg, "n_kv_heads", "integer") or n_heads,
        mlp_hidden=mlp_hidden,
        vocab_size=emb,
        embedding_size=emb,
        rope_theta=config_field(cfg, "rope_theta", "number", 10000.0),
        norm_eps=config_field(cfg, "rms_norm_eps", "number", 1e-5),
        max_seq_len=config_field(cfg, "max_sequence_length", "integer", 4096),
        mask_id=config_field(cfg, "mask_token_id", "integer", 126336),
        eos_id=eos,
        pad_id=config_field(cfg, "pad_token_id", "integer", eos),
        qkv_bias=include_bias or config_field(cfg, "include_qkv_bias", "boolean", False),
        out_bias=include_bias,
        mlp_bias=include_bias,
        norm_bias=include_bias if norm_bias is None else norm_bias,
        tie_embeddings=config_field(cfg, "weight_tying", "boolean", False),
        logit_shift=0,
    )


def llada_config(spec: ModelSpec) -> dict[str, Any]:
    """The ``config.json`` LLaDA's own code reads for ``spec`` (used when the project writes checkpoints)."""
    return {
        "architectures": ["LLaDAModelLM"],
        "model_type": "llada",
        "d_model": spec.d_model,
        "n_heads": spec.n_heads,
        "n_kv_heads": spec.n_kv_heads,
        "n_layers": spec.n_layers,
        "mlp_hidden_size": spec.mlp_hidden,
        "mlp_ratio": 4,
        "vocab_size": spec.vocab_size,
        "embedding_size": spec.embedding_size,
        "rope": True,
        "rope_theta": spec.rope_theta,
        "rope_full_precision": True,
        "rms_norm_eps": spec.norm_eps,
        "layer_norm_type": "rms",
        "layer_norm_with_affine": True,
        "bias_for_layer_norm": spec.norm_bias,
        "block_type": "llama",
        "activation_type": "silu",
        "alibi": False,
        "attention_layer_norm": False,
        "input_emb_norm": False,
        "scale_logits": False,
        "include_bias": spec.out_bias,
        "include_qkv_bias": spec.qkv_bias,
        "weight_tying": spec.tie_embeddings,
        "max_sequence_length": spec.max_seq_len,
        "mask_token_id": spec.mask_id,
        "eos_token_id": spec.eos_id,
        "pad_token_id": spec.pad_id,
        "attention_dropout": 0.0,
        "residual_dropout": 0.0,
        "embedding_dropout": 0.0,
        "block_group_size": 1,
        "flash_attention": False,
        "init_fn": "mitchell",
        "use_cache": False,
    }


class _LLaDABlock(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        d, kv = spec.d_model, spec.n_kv_heads * spec.head_dim
        self.attn_norm = RMSNorm(d, spec.norm_eps, bias=spec.norm_bias)
        self.ff_norm = RMSNorm(d, spec.norm_eps, bias=spec.norm_bias)
        self.q_proj = nn.Linear(d, d, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(d, kv, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(d, kv, bias=spec.qkv_bias)
        self.attn_out = nn.Linear(d, d, bias=spec.out_bias)
        self.ff_proj = nn.Linear(d, spec.mlp_hidden, bias=spec.mlp_bias)
        self.up_proj = nn.Linear(d, spec.mlp_hidden, bias=spec.mlp_bias)
        self.ff_out = nn.Linear(spec.mlp_hidden, d, bias=spec.mlp_bias)


class LLaDA(DiffusionLM):
    """LLaDA masked-diffusion LM (Nie et al. 2025, "Large Language Diffusion Models"), plan-executing.

    Shapes: ``input_ids [B, L]`` → logits ``[B, L, embedding_size]``. Parameters live under
    ``model.transformer.*`` exactly as in LLaDA's Hugging Face checkpoints.
    """

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(spec.embedding_size, spec.d_model),
                "blocks": nn.ModuleList(_LLaDABlock(spec) for _ in range(spec.n_layers)),
                "ln_f": RMSNorm(spec.d_model, spec.norm_eps, bias=spec.norm_bias),
            }
        )
        if not spec.tie_embeddings:
            transformer["ff_out"] = nn.Linear(spec.d_model, spec.embedding_size, bias=spec.out_bias)
        self.model = nn.Module()
        self.model.transformer = transformer
        self._parts = [
            LayerParts(b.attn_norm, b.q_proj, b.k_proj, b.v_proj, b.attn_out, b.ff_norm, b.ff_proj, b.up_proj, b.ff_out)
            for b in transformer["blocks"]
        ]
        self.fuse_projections()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.transformer["wte"](ids)

    def layer_parts(self, layer: int) -> LayerParts:
        return self._parts[layer]

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.transformer["ln_f"](h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        t = self.model.transformer
        if self.spec.tie_embeddings:
            return F.linear(h, t["wte"].weight)
        return t["ff_out"](h)

    def embedding_weight(self) -> torch.Tensor:
        return self.model.transformer["wte"].weight

    def final_norm_weight(self) -> torch.Tensor:
        return self.model.transformer["ln_f"].weight

    def head_weight(self) -> torch.Tensor:
        t = self.model.transformer
        return t["wte"].weight if self.spec.tie_embeddings else t["ff_out"].weight
