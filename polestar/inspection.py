"""What a checkpoint directory is and what it needs, from its JSON files and safetensors headers only.

:func:`inspect_checkpoint` reads ``config.json``, the safetensors headers (never a weight byte), the tokenizer and
generation files, and answers what a user needs before a 16 GB load: the family, parameter count, dtype on disk
and the dtype the weights will load in, bytes of weights and of K/V per token, whether a tokenizer, chat template
and stop ids are there, which preset matched and why, and every config.json field the engine refuses. ``polestar
inspect`` prints it; ``generate``, ``bench`` and ``lm-eval`` print its one-line summary before loading.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import attrs
import torch

from polestar.models.loading import (
    FAMILIES,
    REFUSALS,
    DtypeChoice,
    choose_dtype,
    dtype_name,
    expected_shapes,
    family_of,
    format_bytes,
    read_config,
    resolve_checkpoint,
    tensor_entries,
    tensor_problems,
)
from polestar.models.text import read_json_if_present, stop_ids
from polestar.presets import Preset, explain_preset

#: generation length used for the K/V figure when no preset matches
DEFAULT_LENGTH = 256


@attrs.frozen
class TokenizerFacts:
    """The tokenizer files of a checkpoint as their JSON states them (no tokenizer is built).

    ``files``: the tokenizer files present; ``chat_template``: whether ``tokenizer_config.json`` has one;
    ``bos``: the BOS token's text and id (None when absent); ``stop_ids``: the ids that end a generation (config
    EOS, generation_config EOS, the chat format's end-of-turn token), as :func:`polestar.load` computes them.
    """

    files: tuple[str, ...]
    chat_template: bool
    bos: tuple[str, int | None] | None
    stop_ids: tuple[int, ...]

    @property
    def found(self) -> bool:
        return bool(self.files)


@attrs.frozen
class CheckpointReport:
    """Facts of one checkpoint directory (see the module docstring); ``refused``: config.json fields the
    engine cannot honour and tensor mismatches, each a sentence; empty when the checkpoint loads."""

    directory: str
    family: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    max_seq_len: int
    n_params: int
    weight_bytes_on_disk: int
    dtype: DtypeChoice
    tokenizer: TokenizerFacts
    preset: Preset | None
    preset_reason: str
    length: int
    batch_size: int
    refused: tuple[str, ...]

    @property
    def weight_bytes_loaded(self) -> int:
        """Bytes the weights take once loaded (parameters × the load dtype's size)."""
        return self.n_params * self.dtype.dtype.itemsize

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token of one sequence, in the load dtype."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype.dtype.itemsize

    @property
    def kv_bytes(self) -> int:
        """K/V bytes of ``batch_size`` sequences of ``length`` tokens."""
        return self.kv_bytes_per_token * self.length * self.batch_size

    def summary(self) -> str:
        """One line: model, parameters, dtype on disk → load dtype, preset (or that none matched)."""
        preset = f"preset {self.preset.name}" if self.preset is not None else "no preset (command defaults apply)"
        refused = f"; REFUSED: {self.refused[0]}" if self.refused else ""
        return (f"[model] {self.directory}: {self.family}, {_count(self.n_params)} parameters, "
                f"{self.dtype.disk_dtype or 'no floating tensors'} on disk, loads in {dtype_name(self.dtype.dtype)}; "
                f"{preset}{refused}")

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready facts (``polestar inspect --json``)."""
        return {
            "directory": self.directory,
            "family": self.family,
            "shape": {"n_layers": self.n_layers, "d_model": self.d_model, "n_heads": self.n_heads,
                      "n_kv_heads": self.n_kv_heads, "head_dim": self.head_dim, "vocab_size": self.vocab_size,
                      "max_seq_len": self.max_seq_len},
            "n_params": self.n_params,
            "dtype_on_disk": dict(self.dtype.on_disk),
            "load_dtype": dtype_name(self.dtype.dtype),
            "load_dtype_source": self.dtype.source,
            "weight_bytes_on_disk": self.weight_bytes_on_disk,
            "weight_bytes_loaded": self.weight_bytes_loaded,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes": {"length": self.length, "batch_size": self.batch_size, "bytes": self.kv_bytes},
            "tokenizer": {"files": list(self.tokenizer.files), "chat_template": self.tokenizer.chat_template,
                          "bos": list(self.tokenizer.bos) if self.tokenizer.bos else None,
                          "stop_ids": list(self.tokenizer.stop_ids)},
            "preset": None if self.preset is None else {
                "name": self.preset.name, "chat": self.preset.chat, "add_bos": self.preset.add_bos,
                "text_source": self.preset.text_source},
            "preset_reason": self.preset_reason,
            "refused": list(self.refused),
        }

    def lines(self) -> list[str]:
        """The report as text lines (``polestar inspect``)."""
        tok = self.tokenizer
        out = [
            f"directory     {self.directory}",
            f"family        {self.family}: {self.n_layers} layers, d_model {self.d_model}, {self.n_heads} heads "
            f"({self.n_kv_heads} K/V), head dim {self.head_dim}, vocabulary {self.vocab_size}, context "
            f"{self.max_seq_len}",
            f"parameters    {_count(self.n_params)} ({self.n_params:,})",
            f"dtype         {self.dtype.line()}",
            f"weights       {format_bytes(self.weight_bytes_on_disk)} on disk, "
            f"{format_bytes(self.weight_bytes_loaded)} loaded",
            f"K/V cache     {format_bytes(self.kv_bytes_per_token)} per token; {format_bytes(self.kv_bytes)} for batch "
            f"{self.batch_size} × {self.length} tokens",
            f"tokenizer     {', '.join(tok.files) if tok.found else 'none (prompts must be token ids)'}",
            f"chat template {'yes' if tok.chat_template else 'no'}",
            f"BOS           {f'{tok.bos[0]} (id {tok.bos[1]})' if tok.bos else 'none'}",
            f"stop ids      {', '.join(map(str, tok.stop_ids))}",
            f"preset        {self.preset.name if self.preset else 'none'}: {self.preset_reason}",
        ]
        if self.preset is not None:
            text = "chat template" if self.preset.chat else ("BOS prefix" if self.preset.add_bos else "plain text")
            out.append(f"eval prompts  {text} ({self.preset.text_source})")
        out += [f"REFUSED       {r}" for r in self.refused] or ["refused       nothing: the checkpoint loads"]
        return out


def inspect_checkpoint(path_or_name: str | Path, batch_size: int = 1, length: int | None = None,
                       dtype: torch.dtype | str | None = None) -> CheckpointReport:
    """Facts of a checkpoint directory (or shipped name) from its JSON files and safetensors headers.

    ``length``: tokens per sequence for the K/V figure (default: the matched preset's generation length, else
    256, at most the model's context); ``batch_size``: sequences; ``dtype``: the dtype a load would be asked for
    (None: the checkpoint's own). Raises only for what makes the directory unreadable (no config.json, an unknown
    family, unreadable headers); every field the engine refuses is reported in ``refused`` instead.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    directory = resolve_checkpoint(path_or_name)
    cfg = read_config(directory)
    family = family_of(cfg, directory)
    refused = REFUSALS[family](cfg)
    refused_keys = {r.split("=", 1)[0] for r in refused}
    spec = FAMILIES[family][0]({k: val for k, val in cfg.items() if k not in refused_keys})
    entries = tensor_entries(directory)
    problems = tensor_problems(expected_shapes(spec), entries)
    preset, reason = explain_preset(cfg, directory)
    if length is None:
        length = preset.decoding.get("gen_length", DEFAULT_LENGTH) if preset is not None else DEFAULT_LENGTH
        length = min(length, spec.max_seq_len)
    return CheckpointReport(
        directory=str(directory), family=family, n_layers=spec.n_layers, d_model=spec.d_model,
        n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads, head_dim=spec.head_dim, vocab_size=spec.vocab_size,
        max_seq_len=spec.max_seq_len,
        n_params=sum(int(torch.Size(e.shape).numel()) for e in entries.values()),
        weight_bytes_on_disk=sum(e.end - e.start for e in entries.values()),
        dtype=choose_dtype(cfg, entries, dtype), tokenizer=tokenizer_facts(directory, spec.eos_id),
        preset=preset, preset_reason=reason, length=length, batch_size=batch_size,
        refused=tuple(f"config.json {r}" for r in refused) + tuple(problems),
    )


def tokenizer_facts(directory: Path, config_eos: int) -> TokenizerFacts:
    """:class:`TokenizerFacts` of ``directory`` from its JSON files."""
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "added_tokens.json")
    files = tuple(n for n in names if (directory / n).is_file())
    tok_config = read_json_if_present(directory / "tokenizer_config.json")
    added = _added_tokens(directory, tok_config)
    generation_eos = read_json_if_present(directory / "generation_config.json").get("eos_token_id")
    stops = stop_ids(config_eos, generation_eos, added if files else None)
    bos = tok_config.get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    return TokenizerFacts(files, bool(tok_config.get("chat_template")),
                          (bos, added.get(bos)) if isinstance(bos, str) else None, stops)


def _added_tokens(directory: Path, tok_config: dict[str, Any]) -> dict[str, int]:
    """Added-token text → id from tokenizer.json, added_tokens.json and tokenizer_config.json."""
    added: dict[str, int] = {}
    for entry in read_json_if_present(directory / "tokenizer.json").get("added_tokens", []):
        added[entry["content"]] = int(entry["id"])
    added.update({k: int(i) for k, i in read_json_if_present(directory / "added_tokens.json").items()})
    for i, entry in tok_config.get("added_tokens_decoder", {}).items():
        added[entry["content"]] = int(i)
    return added


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def announce_model(model: str | Path, dtype: torch.dtype | str | None = None) -> None:
    """Print the one-line facts of checkpoint ``model`` (family, parameters, dtype on disk and loaded, preset)
    on stderr before it is loaded (``generate``, ``bench``, ``anatomy`` and ``lm-eval`` do). Prints nothing when
    the headers cannot be read: the load that follows names the problem as a loading failure."""
    try:
        line = inspect_checkpoint(model, dtype=dtype).summary()
    except (OSError, ValueError):
        return
    print(line, file=sys.stderr, flush=True)
