"""Presets: the paper's decoding settings for the published checkpoints, by name or recognised from config.json.

Settings (Lee et al. 2026, Table 1 and its text): generation length 256, block 32, steps = generation length
(steps are left unset so they follow whatever generation length a run uses), temperature 0, confidence threshold
τ_s = 0.9, early-commit band from 0.7, drift window 5 steps, α = 10, Polestar-Cache with 8 clusters over a window
of 2 prefix + 1 suffix blocks, top-4 clusters per layer (top-1 at the last), τ_upd = 1, a window-only refresh every
4th block (the released code's values).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
from attrs import validators as v

PAPER_SOURCE = "Lee et al. 2026 (Polestar), Table 1 settings; released code defaults for the window and clusters"

#: decoding settings shared by every published preset (keywords of polestar.generate)
#: (no ``steps``: one step per generated token at any ``gen_length``, as the paper's runs at 256 and 512 do)
PAPER_DECODING: dict[str, Any] = {"gen_length": 256, "block_length": 32, "temperature": 0.0}
#: stage options shared by every published preset, optional (``?``) so they apply to whichever policy runs
PAPER_OPTIONS: dict[str, Any] = {
    "threshold?": 0.9,
    "commit.min_confidence?": 0.7,
    "commit.window?": 5,
    "commit.alpha?": 10.0,
    "refresh.n_clusters?": 8,
    "refresh.prefix_blocks?": 2,
    "refresh.suffix_blocks?": 1,
    "refresh.topk?": 4,
    "refresh.topk_last?": 1,
    "refresh.tau_upd?": 1,
    "refresh.window_refresh_every?": 4,
}


@attrs.frozen
class Preset:
    """Decoding settings for one published checkpoint.

    ``match``: config.json fields (any of the family's spellings) that identify the checkpoint's architecture;
    ``aliases``: substrings of a checkpoint directory name that single this preset out among presets with the
    same architecture (LLaDA-8B-Instruct and LLaDA-1.5 share one config.json); ``policy``: the policy to run;
    ``decoding``: :func:`polestar.generate` keywords; ``options``: stage options (``polestar.assemble``
    overrides); ``source``: where the values come from. ``chat`` / ``add_bos``: how the paper's evaluation turns
    a benchmark prompt into ids for this checkpoint: wrapped as a user turn in the chat template, or prefixed
    with the tokenizer's BOS token (Dream's ``add_bos_token``); ``text_source``: which evaluation code says so.
    """

    name: str = attrs.field(validator=v.instance_of(str))
    description: str = attrs.field(validator=v.instance_of(str))
    match: Mapping[str, Any] = attrs.field(validator=v.instance_of(Mapping))
    aliases: tuple[str, ...] = attrs.field(converter=tuple)
    policy: str = "polestar"
    decoding: Mapping[str, Any] = attrs.field(factory=lambda: dict(PAPER_DECODING))
    options: Mapping[str, Any] = attrs.field(factory=lambda: dict(PAPER_OPTIONS))
    source: str = PAPER_SOURCE
    chat: bool = attrs.field(default=False, validator=v.instance_of(bool))
    add_bos: bool = attrs.field(default=False, validator=v.instance_of(bool))
    text_source: str = ""

    def __attrs_post_init__(self):
        if self.chat and self.add_bos:
            raise ValueError(f"preset {self.name}: chat and add_bos exclude each other (a chat template writes its "
                             "own BOS)")

    def mismatches(self, config: Mapping[str, Any]) -> list[str]:
        """``key: config value != preset value`` for every ``match`` field config.json does not equal."""
        return [f"{k}={config.get(k)!r} (preset: {want!r})" for k, want in self.match.items() if config.get(k) != want]

    def matches(self, config: Mapping[str, Any]) -> bool:
        """True when every ``match`` field equals config.json's."""
        return not self.mismatches(config)

    def as_dict(self) -> dict[str, Any]:
        """The preset as plain JSON-ready data (``polestar presets --json``)."""
        return attrs.asdict(self)


_PRESETS: dict[str, Preset] = {}


def register_preset(preset: Preset) -> Preset:
    """Add ``preset`` to the registry (names are unique)."""
    if preset.name in _PRESETS:
        raise ValueError(f"preset {preset.name!r} is already registered")
    _PRESETS[preset.name] = preset
    return preset


def preset_names() -> list[str]:
    """Names of the registered presets, sorted."""
    return sorted(_PRESETS)


def get_preset(name: str) -> Preset:
    """The preset called ``name``; ValueError listing the known names otherwise."""
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(preset_names())} "
                         "(see `polestar presets`)")
    return _PRESETS[name]


def preset_for_config(config: Mapping[str, Any], directory: str | Path | None = None) -> Preset | None:
    """The preset whose architecture matches ``config`` (config.json); among several, the one whose alias
    appears in ``directory``'s name, else the first registered. None when no preset matches."""
    return explain_preset(config, directory)[0]


def explain_preset(config: Mapping[str, Any], directory: str | Path | None = None) -> tuple[Preset | None, str]:
    """:func:`preset_for_config` and why: the fields that matched and how one of several was picked, or, when
    none matched, the closest preset's mismatching fields."""
    found = [p for p in _PRESETS.values() if p.matches(config)]
    if not found:
        if not _PRESETS:
            return None, "no presets are registered"
        same_family = [p for p in _PRESETS.values() if p.match.get("model_type") == config.get("model_type")]
        closest = min(same_family or _PRESETS.values(), key=lambda p: len(p.mismatches(config)))
        return None, (f"no preset matches config.json; closest, {closest.name}, differs in "
                      f"{', '.join(closest.mismatches(config))}")
    name = Path(directory).name.lower() if directory is not None else ""
    named = [p for p in found if any(a in name for a in p.aliases)]
    chosen = (named or found)[0]
    why = f"config.json matches {', '.join(f'{k}={v!r}' for k, v in chosen.match.items())}"
    if len(found) > 1:
        others = ", ".join(p.name for p in found if p is not chosen)
        if named:
            alias = next(a for a in chosen.aliases if a in name)
            why += f"; the directory name contains {alias!r} (same architecture: {others})"
        else:
            why += (f"; the directory name has none of the aliases that tell same-architecture presets apart, so "
                    f"the first registered is used ({others} shares the architecture)")
    return chosen, why


_LLADA_8B = {"model_type": "llada", "d_model": 4096, "n_heads": 32, "n_layers": 32, "mlp_hidden_size": 12288,
             "vocab_size": 126464}
register_preset(Preset(
    "llada-8b-instruct", "GSAI-ML/LLaDA-8B-Instruct with Polestar at the paper's settings", _LLADA_8B,
    ("llada-8b-instruct", "llada-8b"), chat=True,
    text_source="the Polestar authors' LLaDA harness wraps each prompt in the chat template when the model path names "
                "an instruct model",
))
register_preset(Preset(
    "llada-1.5", "GSAI-ML/LLaDA-1.5 (LLaDA-8B-Instruct after VRPO; same architecture) at the paper's settings",
    _LLADA_8B, ("llada-1.5", "llada1.5", "llada_1.5"),
    text_source="the Polestar authors' LLaDA harness: GSAI-ML/LLaDA-1.5's path names no instruct model, so prompts "
                "go in as plain text, without the chat template",
))
register_preset(Preset(
    "dream-v0-instruct-7b", "Dream-org/Dream-v0-Instruct-7B with Polestar at the paper's settings",
    {"model_type": "Dream", "hidden_size": 3584, "num_attention_heads": 28, "num_hidden_layers": 28,
     "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064},
    ("dream-v0-instruct-7b", "dream-7b", "dream"), add_bos=True,
    text_source="Dream's evaluation scripts and the Polestar authors' runner pass add_bos_token=true: each prompt "
                "starts with <|beginoftext|>, no chat template",
))
