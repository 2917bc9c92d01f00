"""Checkpoint directories shaped like the published models, with random weights, for tests and GPU checks.

A directory holds every published non-weight file of the model (:data:`polestar.models.published.PUBLISHED_MODELS`),
tokenizer files with every added token at its published id over a filler vocabulary (the published vocabularies
are not reproduced), and sharded safetensors with random weights, one shard for the embedding, one per layer and
one for the final norm and head, with an index file. Weights are written one tensor at a time in small chunks, so
building an 8B-wide checkpoint needs little memory.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from polestar.models.loading import FAMILIES, dtype_name, expected_shapes
from polestar.models.published import DREAM_SPECIAL_TOKENS, LLADA_ADDED_TOKENS, published


def _byte_alphabet() -> list[str]:
    """The 256 printable stand-ins of GPT-2 byte-level BPE, in byte order."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
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


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def write_llada_tokenizer(directory: Path) -> None:
    """``tokenizer.json``: byte-level BPE without merges over a filler vocabulary, with LLaDA's 269 added
    tokens at their published ids (the published vocabulary itself is not reproduced)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    first = min(LLADA_ADDED_TOKENS)
    vocab = _filler_vocab(first)
    vocab.update({t: i for i, t in LLADA_ADDED_TOKENS.items()})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLADA_ADDED_TOKENS.values()])
    tokenizer.save(str(directory / "tokenizer.json"))


def write_dream_tokenizer(directory: Path) -> None:
    """Qwen2-style ``vocab.json`` + ``merges.txt`` (byte symbols and filler words, no merges); the added tokens
    come from the published ``tokenizer_config.json`` / ``added_tokens.json``."""
    vocab = _filler_vocab(min(DREAM_SPECIAL_TOKENS.values()))
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (directory / "merges.txt").write_text("#version: 0.2\n")


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
    """Write a checkpoint directory shaped like a published model: ``family`` is a :data:`PUBLISHED_MODELS` name
    (``llada-8b-instruct``, ``llada-1.5``, ``dream-v0-instruct-7b``) or ``llada`` / ``dream``.

    Every published non-weight file is written with its published fields; ``config.json`` has its layer count
    set to ``n_layers`` and the keys of ``width`` replaced (e.g. a narrow variant for fast tests), and a
    ``torch_dtype`` key, where the published file has one, names ``dtype``. Weights are random, in ``dtype``, one
    shard for the embedding, one per layer and one for the final norm and head, with an index file.
    Returns the directory.
    """
    model_info = published(family)
    family = model_info.family
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = dict(model_info.config)
    cfg[model_info.layers_key] = n_layers
    cfg.update(width or {})
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = dtype_name(dtype)
    shapes = expected_shapes(FAMILIES[family][0](cfg))
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
    write_published_files(directory, model_info.name, cfg)
    return directory


def write_published_files(directory: str | Path, name: str, config: dict[str, Any] | None = None) -> Path:
    """Write the non-weight files of published model ``name`` into ``directory``: every JSON file it publishes
    (``config`` replacing its config.json when given) and tokenizer files over a filler vocabulary. Returns the
    directory."""
    model_info = published(name)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for file_name, content in model_info.files.items():
        _write_json(directory / file_name, config if file_name == "config.json" and config is not None else content)
    _WRITERS[model_info.family](directory)
    return directory


