"""Architecture description shared by every backbone: what the engine needs to know about a model."""

from __future__ import annotations

from typing import Any

import attrs
from attrs import validators as v


def _positive(_inst, attribute, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{attribute.name} must be a positive number, got {value!r}")


#: what a config.json field of each kind must hold, in words
_KIND_WORDS = {"integer": "an integer", "number": "a number", "boolean": "true or false"}


def config_field(cfg: dict[str, Any], key: str, kind: str, default: Any = None) -> Any:
    """config.json field ``key`` checked to be ``kind`` (``"integer"``, ``"number"`` or ``"boolean"``), or
    ``default`` when the field is absent or null. A value of another type (``"n_layers": "4"``) is one ValueError
    naming the field, what it must be and what it holds, before anything is built from it. An integral float
    (``4.0``) is an integer; a number is returned as float."""
    value = cfg.get(key)
    if value is None:
        return default
    if kind == "integer":
        ok = not isinstance(value, bool) and (isinstance(value, int)
                                              or (isinstance(value, float) and value.is_integer()))
        value = int(value) if ok else value
    elif kind == "number":
        ok = not isinstance(value, bool) and isinstance(value, (int, float))
        value = float(value) if ok else value
    elif kind == "boolean":
        ok = isinstance(value, bool)
    else:
        raise ValueError(f"unknown config field kind {kind!r}; kinds: {', '.join(_KIND_WORDS)}")
    if not ok:
        raise ValueError(f"config.json field {key} must be {_KIND_WORDS[kind]}, got {value!r} "
                         f"({type(value).__name__}); correct it in the checkpoint's config.json")
    return value


@attrs.frozen
class ModelSpec:
    """Shape and token facts of a masked-diffusion transformer (LLaDA or Dream family).

    Attributes mirror the fields of the checkpoint's ``config.json`` after family-specific names are resolved:
    ``d_model`` (LLaDA ``d_model`` / Dream ``hidden_size``), ``n_heads``, ``n_kv_heads`` (GQA when smaller),
    ``mlp_hidden`` (SwiGLU inner width), ``vocab_size`` (width of the logits), ``logit_shift`` (1 for Dream,
    whose ``logits[i]`` come from hidden state ``i-1``; 0 for LLaDA).
    """

    family: str = attrs.field(validator=v.in_(("llada", "dream")))
    n_layers: int = attrs.field(validator=_positive)
    d_model: int = attrs.field(validator=_positive)
    n_heads: int = attrs.field(validator=_positive)
    n_kv_heads: int = attrs.field(validator=_positive)
    mlp_hidden: int = attrs.field(validator=_positive)
    vocab_size: int = attrs.field(validator=_positive)
    embedding_size: int = attrs.field(validator=_positive)
    rope_theta: float = attrs.field(validator=_positive)
    norm_eps: float = attrs.field(validator=_positive)
    max_seq_len: int = attrs.field(validator=_positive)
    mask_id: int = attrs.field(validator=v.ge(0))
    eos_id: int = attrs.field(validator=v.ge(0))
    pad_id: int = attrs.field(validator=v.ge(0))
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    norm_bias: bool = False
    tie_embeddings: bool = False
    logit_shift: int = attrs.field(default=0, validator=v.in_((0, 1)))

    def __attrs_post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.embedding_size < self.vocab_size:
            raise ValueError(f"embedding_size {self.embedding_size} < vocab_size {self.vocab_size}")
        if self.mask_id >= self.embedding_size:
            raise ValueError(f"mask token id {self.mask_id} is outside the embedding table ({self.embedding_size})")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def unsupported_values(cfg: dict[str, Any], supported: dict[str, tuple[Any, ...]]) -> list[str]:
    """``key=value (supported: ...)`` for every key of ``supported`` that ``cfg`` sets to another value."""
    return [f"{key}={cfg[key]!r} (supported: {', '.join(map(repr, allowed))})"
            for key, allowed in supported.items() if key in cfg and cfg[key] not in allowed]
