"""The published checkpoints' metadata, and checkpoint directories in their shapes with random weights.

Holds the ``config.json``, ``tokenizer_config.json`` (chat template) and ``generation_config.json`` fields of
GSAI-ML/LLaDA-8B-Instruct and Dream-org/Dream-v0-Instruct-7B, and writes directories laid out like the published
ones (sharded safetensors, tokenizer files with the special tokens at their real ids over a filler vocabulary,
random weights) for the tests and ``bench/gpu/check.py``. Weights are written one tensor at a time in small
chunks, so building an 8B-wide checkpoint needs little memory.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .layers import Rotary
from .loading import FAMILIES

# --- LLaDA-8B-Instruct -------------------------------------------------------------------------------------------
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
    "torch_dtype": "bfloat16",
    "transformers_version": "4.46.3",
    "use_cache": False,
    "vocab_size": 126464,
    "weight_tying": False,
}
LLADA_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
)
#: LLaDA special tokens at their ids in the published tokenizer.
LLADA_SPECIAL_TOKENS: dict[str, int] = {
    "<|startoftext|>": 126080,
    "<|endoftext|>": 126081,
    "<|mdm_mask|>": 126336,
    "<|start_header_id|>": 126346,
    "<|end_header_id|>": 126347,
    "<|eot_id|>": 126348,
}
LLADA_TOKENIZER_CONFIG: dict[str, Any] = {
    "add_bos_token": False,
    "add_eos_token": False,
    "bos_token": "<|startoftext|>",
    "chat_template": LLADA_CHAT_TEMPLATE,
    "clean_up_tokenization_spaces": False,
    "eos_token": "<|endoftext|>",
    "fast_tokenizer": True,
    "model_max_length": 1000000000000000019884624838656,
    "pad_token": "<|endoftext|>",
    "tokenizer_class": "PreTrainedTokenizerFast",
    "trust_remote_code": True,
}
LLADA_GENERATION_CONFIG: dict[str, Any] = {
    "_from_model_config": True,
    "bos_token_id": 126080,
    "eos_token_id": 126081,
    "pad_token_id": 126081,
    "transformers_version": "4.46.3",
}

# --- Dream-v0-Instruct-7B ----------------------------------------------------------------------------------------
DREAM_7B_INSTRUCT_CONFIG: dict[str, Any] = {
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
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.46.2",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 152064,
}
# ChatML with Dream's default system turn (the Qwen2.5 template without its tool-calling branch)
DREAM_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
#: Dream's added tokens (Qwen2.5's, then Dream's BOS and mask), contiguous from 151643.
DREAM_SPECIAL_TOKENS: dict[str, int] = {
    tok: 151643 + i
    for i, tok in enumerate([
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
        "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
        "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
        "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<|beginoftext|>",
        "<|mask|>",
    ])
}
DREAM_TOKENIZER_CONFIG: dict[str, Any] = {
    "add_prefix_space": False,
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

#: family → (config.json, tokenizer_config.json, generation_config.json, config key of the layer count)
PUBLISHED: dict[str, tuple[dict, dict, dict, str]] = {
    "llada": (LLADA_8B_INSTRUCT_CONFIG, LLADA_TOKENIZER_CONFIG, LLADA_GENERATION_CONFIG, "n_layers"),
    "dream": (DREAM_7B_INSTRUCT_CONFIG, DREAM_TOKENIZER_CONFIG, DREAM_GENERATION_CONFIG, "num_hidden_layers"),
}


def _byte_alphabet() -> list[str]:
    """The 256 printable stand-ins of GPT-2 byte-level BPE, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def _filler_vocab(size: int) -> dict[str, int]:
    """Byte-level vocabulary of ``size`` entries: the 256 byte symbols, then unused filler words."""
    vocab = {ch: i for i, ch in enumerate(_byte_alphabet())}
    vocab.update({f"<filler_{i}>": i for i in range(256, size)})
    return vocab


def write_llada_tokenizer(directory: Path) -> None:
    """``tokenizer.json`` (byte-level BPE without merges, filler vocabulary) with LLaDA's special tokens at their
    published ids, plus LLaDA-8B-Instruct's ``tokenizer_config.json``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = _filler_vocab(min(LLADA_SPECIAL_TOKENS.values()))
    for tok, i in LLADA_SPECIAL_TOKENS.items():
        vocab[tok] = i
    for i in range(min(LLADA_SPECIAL_TOKENS.values()), max(LLADA_SPECIAL_TOKENS.values())):
        if i not in vocab.values():
            vocab[f"<|reserved_{i}|>"] = i
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLADA_SPECIAL_TOKENS])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(LLADA_TOKENIZER_CONFIG, indent=2))


def write_dream_tokenizer(directory: Path) -> None:
    """Qwen2-style ``vocab.json`` + ``merges.txt`` (byte symbols and filler words, no merges) and Dream's
    ``tokenizer_config.json`` with the special tokens at their published ids."""
    vocab = _filler_vocab(min(DREAM_SPECIAL_TOKENS.values()))
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    config = dict(DREAM_TOKENIZER_CONFIG)
    config["added_tokens_decoder"] = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": True}
        for t, i in DREAM_SPECIAL_TOKENS.items()
    }
    config["additional_special_tokens"] = ["<|im_start|>", "<|im_end|>"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))


_WRITERS = {"llada": write_llada_tokenizer, "dream": write_dream_tokenizer}
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _random_chunks(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int,
                   pool_bytes: int = 16 << 20) -> Iterator[bytes | memoryview]:
    """Bytes of one random tensor: norm weights 1, everything else N(0, 0.02) values.

    A pool of at most ``pool_bytes`` random values is drawn once and written over and over, rotated by a
    different pseudo-random offset each time, so an 8B-wide tensor costs little more than its disk write.
    """
    numel = int(torch.Size(shape).numel())
    if len(shape) == 1 and ("norm" in name or name.endswith("ln_f.weight")):
        yield torch.ones(numel, dtype=dtype).view(torch.uint8).numpy().tobytes()
        return
    gen = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    pool_n = min(numel, max(1, pool_bytes // size))
    pool = torch.empty(pool_n, dtype=torch.float32).normal_(0.0, 0.02, generator=gen).to(dtype)
    raw = memoryview(pool.view(torch.uint8).numpy()).cast("B")
    left = numel
    while left:
        n = min(pool_n, left)
        shift = int(torch.randint(0, pool_n, (1,), generator=gen)) if n == pool_n else 0
        rotated = (raw[shift * size :], raw[: shift * size])
        want = n * size
        for part in rotated:
            take = part[: want]
            want -= len(take)
            if len(take):
                yield take
        left -= n


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, seed: int) -> int:
    """Stream random tensors ``[(name, shape)]`` of ``dtype`` into a safetensors file; returns its tensor bytes."""
    size = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        n = size * int(torch.Size(shape).numel())
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for k, (name, shape) in enumerate(tensors):
            for chunk in _random_chunks(name, shape, dtype, seed * 100003 + k):
                f.write(chunk)
    return offset


def write_published_checkpoint(
    directory: str | Path,
    family: str,
    n_layers: int = 1,
    width: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> Path:
    """Write a checkpoint directory shaped like the published ``family`` model (``"llada"`` or ``"dream"``).

    ``config.json`` is the published one with the layer count set to ``n_layers`` and the keys of ``width``
    replaced (e.g. a narrow variant for fast tests); ``torch_dtype`` follows ``dtype``. Weights are random, one
    shard for the embedding, one per layer and one for the final norm and head, with an index file.
    Returns the directory.
    """
    if family not in PUBLISHED:
        raise ValueError(f"unknown family {family!r}; known: {sorted(PUBLISHED)}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg_src, _, gen_cfg, layers_key = PUBLISHED[family]
    cfg = dict(cfg_src)
    cfg[layers_key] = n_layers
    cfg.update(width or {})
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    spec_fn, cls, _ = FAMILIES[family]
    with torch.device("meta"):
        model = cls(spec_fn(cfg))
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    groups: dict[str, list[str]] = {}
    for name in shapes:
        layer = next((part for part in name.split(".") if part.isdigit()), None)
        key = f"layer{layer}" if layer is not None else ("embed" if "wte" in name or "embed_tokens" in name else "head")
        groups.setdefault(key, []).append(name)
    order = ["embed"] + [f"layer{i}" for i in range(n_layers)] + ["head"]
    weight_map, total = {}, 0
    for i, key in enumerate(order):
        shard = f"model-{i + 1:05d}-of-{len(order):05d}.safetensors"
        names = groups[key]
        total += write_safetensors(directory / shard, [(n, shapes[n]) for n in names], dtype, seed * 1000 + i)
        weight_map.update(dict.fromkeys(names, shard))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    (directory / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    _WRITERS[family](directory)
    return directory


def published_model(family: str, n_layers: int = 1, width: dict[str, Any] | None = None,
                    dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu", seed: int = 0):
    """A model shaped like the published ``family`` checkpoint, built in memory with random weights (nothing is
    written to disk): the published ``config.json`` with ``n_layers`` layers and the keys of ``width`` replaced,
    allocated once in ``dtype`` on ``device``; norm weights 1, every other tensor N(0, 0.02). No tokenizer is
    attached, so prompts are token ids. For step-cost benchmarks, where only the shapes matter."""
    if family not in PUBLISHED:
        raise ValueError(f"unknown family {family!r}; known: {sorted(PUBLISHED)}")
    cfg_src, _, _, layers_key = PUBLISHED[family]
    cfg = {**cfg_src, layers_key: n_layers, **(width or {})}
    spec_fn, cls, _ = FAMILIES[family]
    spec = spec_fn(cfg)
    with torch.device("meta"):
        model = cls(spec)
    model = model.to(dtype=dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name or name.endswith("ln_f.weight")):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.rotary = Rotary(spec.head_dim, spec.rope_theta).to(device)  # a buffer computed at init, lost on meta
    return model.eval()
