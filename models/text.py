"""Text side of a checkpoint directory: the ``transformers`` tokenizer, the chat template and the stop tokens.

Loads the tokenizer the way the published checkpoints expect (``AutoTokenizer`` on the local directory, never
``trust_remote_code``), maps the custom tokenizer classes of published diffusion checkpoints onto the stock
classes they are built on (Dream's ``DreamTokenizer`` is a Qwen2 byte-level BPE over ``vocab.json`` +
``merges.txt``), wraps a bare ``tokenizer.json`` (the shipped tiny checkpoints) in a
``PreTrainedTokenizerFast``, and reads the stop tokens and decoding defaults from ``generation_config.json``.
Sources: LLaDA-8B-Instruct and Dream-v0-Instruct-7B model cards (chat usage with ``apply_chat_template``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

# tokenizer_class names of published checkpoints that need remote code, → the stock transformers classes they
# wrap, fastest first (transformers 4.x has a slow Qwen2Tokenizer and a fast Qwen2TokenizerFast; 5.x one class)
CUSTOM_TOKENIZER_CLASSES: dict[str, tuple[str, ...]] = {"DreamTokenizer": ("Qwen2TokenizerFast", "Qwen2Tokenizer")}
# tokens that end an assistant turn in the chat formats of the supported families (Llama-3 style, ChatML)
END_OF_TURN_TOKENS: tuple[str, ...] = ("<|eot_id|>", "<|im_end|>")
# names of the diffusion mask token in the supported tokenizers (LLaDA, Dream, the shipped char tokenizer)
MASK_TOKENS: tuple[str, ...] = ("<|mdm_mask|>", "<|mask|>")
# generation_config.json fields that become defaults of polestar.generate (field → generate keyword)
GENERATION_DEFAULTS: dict[str, str] = {"temperature": "temperature"}


@attrs.frozen
class TextDefaults:
    """Stop tokens and decoding defaults of a checkpoint.

    ``stop_ids``: token ids that end a sequence (EOS of config.json and generation_config.json, plus the
    end-of-turn token of the chat format when the tokenizer has one); ``decoding``: keyword defaults for
    :func:`polestar.generate` taken from ``generation_config.json`` (e.g. ``temperature``).
    """

    stop_ids: tuple[int, ...]
    decoding: dict[str, Any] = attrs.field(factory=dict)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); restore it from the published checkpoint") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object; restore it from the published checkpoint")
    return data


def load_tokenizer(directory: Path):
    """The checkpoint's tokenizer as a ``transformers.PreTrainedTokenizerBase``, or None without tokenizer files.

    ``tokenizer_config.json`` present: ``AutoTokenizer.from_pretrained(directory)`` (no remote code), with the
    custom classes of :data:`CUSTOM_TOKENIZER_CLASSES` replaced by their stock class. Only ``tokenizer.json``:
    a ``PreTrainedTokenizerFast`` over it that keeps spaces exactly (``clean_up_tokenization_spaces=False``).
    Raises ValueError naming the file when a tokenizer file is not readable.
    """
    import transformers
    from transformers.utils import logging as hf_logging

    config_path = directory / "tokenizer_config.json"
    tokenizer_json = directory / "tokenizer.json"
    if tokenizer_json.is_file():
        _check_tokenizer_json(tokenizer_json)
    if config_path.is_file():
        config = _read_json(config_path)
        class_name = config.get("tokenizer_class")
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # AutoTokenizer warns that config.json's model_type is not a transformers one
        try:
            if class_name in CUSTOM_TOKENIZER_CLASSES:
                stock = next(n for n in CUSTOM_TOKENIZER_CLASSES[class_name] if hasattr(transformers, n))
                return getattr(transformers, stock).from_pretrained(str(directory))
            return transformers.AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)
        except (OSError, ValueError, TypeError, KeyError) as err:
            raise ValueError(
                f"{config_path}: the tokenizer of {directory} could not be loaded ({err}); check that its "
                "tokenizer files (tokenizer.json, or vocab.json + merges.txt) are complete"
            ) from err
        finally:
            hf_logging.set_verbosity(verbosity)
    if not tokenizer_json.is_file():
        return None
    from tokenizers import Tokenizer

    return as_transformers_tokenizer(Tokenizer.from_file(str(tokenizer_json)))


def as_transformers_tokenizer(backend):
    """Wrap a ``tokenizers.Tokenizer`` (e.g. the project's character tokenizer) in a ``PreTrainedTokenizerFast``
    with the same ids and texts: no space clean-up, the backend model's unknown token as ``unk_token``."""
    import transformers

    unk = getattr(backend.model, "unk_token", None)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, clean_up_tokenization_spaces=False, **({"unk_token": unk} if unk else {})
    )


def _check_tokenizer_json(path: Path) -> None:
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for malformed files
        raise ValueError(f"{path} is not a valid tokenizer file ({err}); "
                         "restore it from the published checkpoint") from err


def text_defaults(directory: Path, tokenizer, config_eos: int) -> TextDefaults:
    """Stop ids and decoding defaults from ``generation_config.json`` (optional), config.json's EOS and the
    tokenizer's end-of-turn token."""
    gen = read_json_if_present(directory / "generation_config.json")
    decoding = {keyword: gen[field] for field, keyword in GENERATION_DEFAULTS.items() if gen.get(field) is not None}
    vocab = tokenizer.get_vocab() if tokenizer is not None else None
    return TextDefaults(stop_ids(config_eos, gen.get("eos_token_id"), vocab), decoding)


def stop_ids(config_eos: int, generation_eos, vocab: Mapping[str, int] | None) -> tuple[int, ...]:
    """The ids that end a sequence: config.json's EOS, generation_config.json's ``eos_token_id`` (an int or a
    list), and the chat format's end-of-turn token when ``vocab`` (token → id; None without a tokenizer) has it."""
    stops = [config_eos]
    for i in generation_eos if isinstance(generation_eos, list) else [generation_eos]:
        if isinstance(i, int) and i not in stops:
            stops.append(i)
    for token in END_OF_TURN_TOKENS if vocab is not None else ():
        if token in vocab and vocab[token] not in stops:
            stops.append(vocab[token])
    return tuple(stops)


def read_json_if_present(path: Path) -> dict[str, Any]:
    """The JSON object in ``path`` (see :func:`_read_json`), or ``{}`` when the file does not exist."""
    return _read_json(path) if path.is_file() else {}


def check_mask_id(directory: Path, tokenizer, mask_id: int) -> None:
    """Raise ValueError when the tokenizer's mask token and config.json's ``mask_token_id`` disagree."""
    if tokenizer is None:
        return
    vocab = tokenizer.get_vocab()
    for token in MASK_TOKENS:
        if token in vocab and vocab[token] != mask_id:
            raise ValueError(
                f"{directory}: config.json says mask_token_id={mask_id} but the tokenizer has {token} at id "
                f"{vocab[token]}; fix mask_token_id in config.json (or the tokenizer files) so they agree"
            )


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text``; raises ValueError when characters of ``text`` fall outside the vocabulary (they
    would silently become the unknown token)."""
    ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    unk_id = tokenizer.unk_token_id
    if unk_id is not None and unk_id in ids and not (tokenizer.unk_token and tokenizer.unk_token in text):
        unknown = sorted({ch for ch in text if unk_id in tokenizer(ch, add_special_tokens=False)["input_ids"]})
        raise ValueError(
            f"prompt {text!r} has characters outside the tokenizer's vocabulary: {unknown}; remove or replace them"
        )
    return ids


def chat_prompt_ids(tokenizer, prompt: str, system: str | None = None) -> list[int]:
    """Token ids of one user turn (after an optional system turn) in the checkpoint's chat template, ending with
    the assistant header (``add_generation_prompt=True``)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "chat=True needs a chat template, but this checkpoint's tokenizer_config.json has none; "
            "pass chat=False (CLI: drop --chat) or use an instruct checkpoint"
        )
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": prompt}
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return encode_text(tokenizer, text, add_special_tokens=False)


def decode_texts(tokenizer, rows: Sequence[Sequence[int]], stop_ids: Sequence[int]) -> list[str]:
    """Decode generated rows up to the first stop id, without special tokens."""
    stops = set(stop_ids)
    texts = []
    for row in rows:
        cut = next((i for i, t in enumerate(row) if t in stops), len(row))
        texts.append(tokenizer.decode(list(row[:cut]), skip_special_tokens=True))
    return texts
