"""The published checkpoints' metadata, and checkpoint directories in their shapes with random weights.

Holds every field of the published ``config.json``, ``generation_config.json``, ``tokenizer_config.json``
(chat template and added tokens) and ``special_tokens_map.json`` of GSAI-ML/LLaDA-8B-Instruct, GSAI-ML/LLaDA-1.5 and
Dream-org/Dream-v0-Instruct-7B (plus Dream's ``added_tokens.json``), and builds models of their shapes in memory
(:func:`published_model`, for step-cost benchmarks). :mod:`polestar.fixtures` writes checkpoint directories laid
out like the published ones from these facts.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from .layers import Rotary
from .loading import FAMILIES, build_on_meta

_TEMPLATES = Path(__file__).parent / "chat_templates"


def _token(content: str) -> dict[str, Any]:
    """An added token as the published tokenizer files spell it (``special_tokens_map.json`` style)."""
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}


# --- LLaDA-8B-Instruct (GSAI-ML/LLaDA-8B-Instruct) -----------------------------------------------------------------
# The published config.json has no torch_dtype key: the weights' dtype is only in the safetensors headers (bf16).
LLADA_8B_INSTRUCT_CONFIG: dict[str, Any] = {
    "activation_type": "silu",
    "alibi": False,
    "alibi_bias_max": 8.0,
    "architectures": ["LLaDAModelLM"],
    "attention_dropout": 0.0,
    "attention_layer_norm": False,
    "attention_layer_norm_with_affine": True,
    "auto_map": {
        "AutoConfig": "configuration_llada.LLaDAConfig",
        "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
        "AutoModel": "modeling_llada.LLaDAModelLM",
    },
    "bias_for_layer_norm": False,
    "block_group_size": 1,
    "block_type": "llama",
    "d_model": 4096,
    "embedding_dropout": 0.0,
    "embedding_size": 126464,
    "eos_token_id": 126081,
    "flash_attention": False,
    "include_bias": False,
    "include_qkv_bias": False,
    "init_cutoff_factor": None,
    "init_device": "meta",
    "init_fn": "mitchell",
    "init_std": 0.02,
    "input_emb_norm": False,
    "layer_norm_type": "rms",
    "layer_norm_with_affine": True,
    "mask_token_id": 126336,
    "max_sequence_length": 4096,
    "mlp_hidden_size": 12288,
    "mlp_ratio": 4,
    "model_type": "llada",
    "multi_query_attention": None,
    "n_heads": 32,
    "n_kv_heads": 32,
    "n_layers": 32,
    "pad_token_id": 126081,
    "precision": "amp_bf16",
    "residual_dropout": 0.0,
    "rms_norm_eps": 1e-05,
    "rope": True,
    "rope_full_precision": True,
    "rope_theta": 500000.0,
    "scale_logits": False,
    "transformers_version": "4.46.3",
    "use_cache": False,
    "vocab_size": 126464,
    "weight_tying": False,
}
LLADA_CHAT_TEMPLATE = (_TEMPLATES / "llada-8b-instruct.jinja").read_text()
#: LLaDA's named added tokens at their published ids; the other ids of 126080..126348 are reserved tokens.
LLADA_NAMED_TOKENS: dict[int, str] = {
    126080: "<|startoftext|>", 126081: "<|endoftext|>", 126082: "[CLS]", 126083: "[gMASK]", 126336: "<|mdm_mask|>",
    126340: "<role>", 126341: "</role>", 126342: "<|arithmetic_start|>", 126343: "<|arithmetic_end|>",
    126344: "<|number_start|>", 126345: "<|number_end|>", 126346: "<|start_header_id|>",
    126347: "<|end_header_id|>", 126348: "<|eot_id|>",
}
_LLADA_FIRST_RESERVED = 126084  # <|reserved_token_N|> sits at id 126084 + N
#: every added token of LLaDA's tokenizer, id → text (269 tokens, ids 126080..126348, all special)
LLADA_ADDED_TOKENS: dict[int, str] = {
    i: LLADA_NAMED_TOKENS.get(i, f"<|reserved_token_{i - _LLADA_FIRST_RESERVED}|>") for i in range(126080, 126349)
}
#: name → id, for the tokens the engine and the tests look up
LLADA_SPECIAL_TOKENS: dict[str, int] = {t: i for i, t in LLADA_NAMED_TOKENS.items()}
_LLADA_EXTRA_SPECIALS = ["<role>", "</role>", "<|arithmetic_start|>", "<|arithmetic_end|>", "<|number_start|>",
                         "<|number_end|>"]
LLADA_TOKENIZER_CONFIG: dict[str, Any] = {
    "add_bos_token": False,
    "add_eos_token": False,
    "added_tokens_decoder": {str(i): {**_token(t), "special": True} for i, t in LLADA_ADDED_TOKENS.items()},
    "additional_special_tokens": _LLADA_EXTRA_SPECIALS,
    "bos_token": "<|startoftext|>",
    "chat_template": LLADA_CHAT_TEMPLATE,
    "clean_up_tokenization_spaces": False,
    "cls_token": "[CLS]",
    "eos_token": "<|endoftext|>",
    "fast_tokenizer": True,
    "gmask_token": "[gMASK]",
    "merges_file": None,
    "model_input_names": ["input_ids", "attention_mask"],
    "model_max_length": 1000000000000000019884624838656,
    "pad_token": "<|endoftext|>",
    "tokenizer_class": "PreTrainedTokenizerFast",
    "trust_remote_code": True,
    "vocab_file": None,
}
LLADA_SPECIAL_TOKENS_MAP: dict[str, Any] = {
    "additional_special_tokens": _LLADA_EXTRA_SPECIALS,
    "bos_token": _token("<|startoftext|>"),
    "cls_token": _token("[CLS]"),
    "eos_token": _token("<|endoftext|>"),
    "pad_token": _token("<|endoftext|>"),
}
LLADA_GENERATION_CONFIG: dict[str, Any] = {
    "_from_model_config": True,
    "bos_token_id": 126080,
    "eos_token_id": 126081,
    "transformers_version": "4.38.2",
}

# --- Dream-v0-Instruct-7B (Dream-org/Dream-v0-Instruct-7B) ---------------------------------------------------------
DREAM_7B_INSTRUCT_CONFIG: dict[str, Any] = {
    "_name_or_path": "Dream-org/Dream-v0-Instruct-7B",
    "architectures": ["DreamModel"],
    "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "mask_token_id": 151666,
    "max_position_embeddings": 131072,
    "max_window_layers": 28,
    "model_type": "Dream",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "pad_token_id": 151643,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.46.2",
    "use_cache": True,
    "use_mrope": False,
    "use_sliding_window": False,
    "vocab_size": 152064,
}
#: the Qwen2.5 chat template (tool calls included) as Dream publishes it
DREAM_CHAT_TEMPLATE = (_TEMPLATES / "dream-v0-instruct-7b.jinja").read_text()
_DREAM_ADDED = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<|beginoftext|>", "<|mask|>",
]
#: Dream's added tokens (Qwen2.5's, then Dream's BOS and mask), contiguous from 151643, text → id
DREAM_SPECIAL_TOKENS: dict[str, int] = {tok: 151643 + i for i, tok in enumerate(_DREAM_ADDED)}
#: added tokens that are not special (tool-call and fill-in-the-middle markers: decoded like text)
DREAM_NOT_SPECIAL: frozenset[int] = frozenset(range(151657, 151665))
DREAM_TOKENIZER_CONFIG: dict[str, Any] = {
    "add_bos_token": False,
    "add_prefix_space": False,
    "added_tokens_decoder": {
        str(i): {**_token(t), "special": i not in DREAM_NOT_SPECIAL} for t, i in DREAM_SPECIAL_TOKENS.items()
    },
    "additional_special_tokens": ["<|beginoftext|>", "<|mask|>"],
    "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
    "bos_token": "<|beginoftext|>",
    "chat_template": DREAM_CHAT_TEMPLATE,
    "clean_up_tokenization_spaces": False,
    "eos_token": "<|endoftext|>",
    "errors": "replace",
    "mask_token": "<|mask|>",
    "model_max_length": 131072,
    "pad_token": "<|endoftext|>",
    "split_special_tokens": False,
    "tokenizer_class": "DreamTokenizer",
    "unk_token": None,
}
DREAM_SPECIAL_TOKENS_MAP: dict[str, Any] = {
    "additional_special_tokens": ["<|beginoftext|>", "<|mask|>"],
    "bos_token": _token("<|beginoftext|>"),
    "eos_token": _token("<|endoftext|>"),
    "mask_token": _token("<|mask|>"),
    "pad_token": _token("<|endoftext|>"),
}
DREAM_ADDED_TOKENS: dict[str, int] = dict(sorted(DREAM_SPECIAL_TOKENS.items()))
DREAM_GENERATION_CONFIG: dict[str, Any] = {
    "_from_model_config": True,
    "alg": "origin",
    "alg_temp": None,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "eps": 0.001,
    "mask_token_id": None,
    "output_history": False,
    "pad_token_id": 151643,
    "steps": 512,
    "temperature": 0.0,
    "top_k": None,
    "top_p": None,
    "transformers_version": "4.46.2",
}


@attrs.frozen
class PublishedModel:
    """The non-weight files of one published checkpoint: ``files`` maps a file name (``config.json``,
    ``generation_config.json``, ``tokenizer_config.json``, ``special_tokens_map.json``, ...) to its JSON content;
    ``layers_key``: the config.json key of the layer count; ``verified``: what these values were checked against."""

    name: str
    repo_id: str
    family: str
    files: Mapping[str, dict[str, Any]]
    layers_key: str
    verified: str

    @property
    def config(self) -> dict[str, Any]:
        return self.files["config.json"]


_LLADA_FILES = {
    "config.json": LLADA_8B_INSTRUCT_CONFIG,
    "generation_config.json": LLADA_GENERATION_CONFIG,
    "tokenizer_config.json": LLADA_TOKENIZER_CONFIG,
    "special_tokens_map.json": LLADA_SPECIAL_TOKENS_MAP,
}
#: published checkpoints by name (the preset names)
PUBLISHED_MODELS: dict[str, PublishedModel] = {
    m.name: m for m in (
        PublishedModel("llada-8b-instruct", "GSAI-ML/LLaDA-8B-Instruct", "llada", _LLADA_FILES, "n_layers",
                       "field for field against the published files"),
        PublishedModel("llada-1.5", "GSAI-ML/LLaDA-1.5", "llada", _LLADA_FILES, "n_layers",
                       "not checked: no copy of its files was reachable; LLaDA-8B-Instruct's files (its config.json "
                       "has the same size, 1,385 bytes)"),
        PublishedModel("dream-v0-instruct-7b", "Dream-org/Dream-v0-Instruct-7B", "dream", {
            "config.json": DREAM_7B_INSTRUCT_CONFIG,
            "generation_config.json": DREAM_GENERATION_CONFIG,
            "tokenizer_config.json": DREAM_TOKENIZER_CONFIG,
            "special_tokens_map.json": DREAM_SPECIAL_TOKENS_MAP,
            "added_tokens.json": DREAM_ADDED_TOKENS,
        }, "num_hidden_layers", "field for field against the published files"),
    )
}
#: family → its default published model
FAMILY_MODELS: dict[str, str] = {"llada": "llada-8b-instruct", "dream": "dream-v0-instruct-7b"}
#: family → (config.json, tokenizer_config.json, generation_config.json, config key of the layer count)
PUBLISHED: dict[str, tuple[dict, dict, dict, str]] = {
    family: (m.config, m.files["tokenizer_config.json"], m.files["generation_config.json"], m.layers_key)
    for family, m in ((f, PUBLISHED_MODELS[n]) for f, n in FAMILY_MODELS.items())
}


def published(name_or_family: str) -> PublishedModel:
    """The published model called ``name_or_family`` (a :data:`PUBLISHED_MODELS` name, or ``llada`` / ``dream``
    for the family's instruct model); ValueError listing the names otherwise."""
    name = FAMILY_MODELS.get(name_or_family, name_or_family)
    if name not in PUBLISHED_MODELS:
        raise ValueError(f"unknown published model {name_or_family!r}; known: "
                         f"{', '.join([*PUBLISHED_MODELS, *FAMILY_MODELS])}")
    return PUBLISHED_MODELS[name]


def published_model(family: str, n_layers: int = 1, width: dict[str, Any] | None = None,
                    dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu", seed: int = 0):
    """A model shaped like the published ``family`` checkpoint, built in memory with random weights (nothing is
    written to disk): the published ``config.json`` with ``n_layers`` layers and the keys of ``width`` replaced,
    allocated once in ``dtype`` on ``device``; norm weights 1, every other tensor N(0, 0.02). No tokenizer is
    attached, so prompts are token ids. For step-cost benchmarks, where only the shapes matter."""
    model_info = published(family)
    family = model_info.family
    cfg = {**model_info.config, model_info.layers_key: n_layers, **(width or {})}
    spec_fn, cls, _ = FAMILIES[family]
    spec = spec_fn(cfg)
    model = build_on_meta(cls, spec).to(dtype=dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name or name.endswith("ln_f.weight")):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.rotary = Rotary(spec.head_dim, spec.rope_theta).to(device)  # a buffer computed at init, lost on meta
    return model.eval()
