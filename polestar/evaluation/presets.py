"""Evaluation presets: the paper's Table 1 settings for lm-eval's own tasks, as data.

Table 1 of the paper (and Fast-dLLM / Elastic-Cache, whose protocol it follows) decodes LLaDA-8B-Instruct with
block length 32, steps equal to the generation length, temperature 0 and confidence threshold 0.9, on GSM8K
(5-shot), MATH (``minerva_math``, 4-shot), HumanEval (0-shot) and MBPP (3-shot), generating 256 tokens (512 for
HumanEval and for the GSM8K-512 row). The decoding settings and stage options are those of the published-model
presets (:data:`polestar.presets.PAPER_DECODING`, :data:`polestar.presets.PAPER_OPTIONS`); this module adds the
per-task few-shot counts and generation lengths. A preset is looked up by name; a task matches a preset entry when its
lm-eval name equals the entry or starts with it and ``_`` (``minerva_math_algebra`` matches ``minerva_math``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from attrs import validators as v

from polestar.presets import PAPER_DECODING, PAPER_OPTIONS


@attrs.frozen
class TaskSetting:
    """Few-shot count and generation length (tokens) of one lm-eval task under a preset."""

    num_fewshot: int = attrs.field(validator=v.ge(0))
    gen_length: int = attrs.field(validator=v.gt(0))


@attrs.frozen
class EvalPreset:
    """Decoding settings shared by every task (``block_length``; steps = generation length; ``options``: stage
    options as optional ``polestar.assemble`` overrides, e.g. ``threshold?``) and per-task few-shot counts and
    generation lengths; ``default_gen_length`` for tasks it does not list."""

    name: str
    description: str
    tasks: dict[str, TaskSetting]
    block_length: int = attrs.field(default=PAPER_DECODING["block_length"], validator=v.gt(0))
    options: Mapping[str, Any] = attrs.field(factory=lambda: dict(PAPER_OPTIONS))
    default_gen_length: int = attrs.field(default=PAPER_DECODING["gen_length"], validator=v.gt(0))

    def setting(self, task: str | None) -> TaskSetting | None:
        """The entry for lm-eval task ``task`` (exact name or ``entry_`` prefix; longest entry wins), or None."""
        if task is None:
            return None
        hits = [k for k in self.tasks if task == k or task.startswith(k + "_")]
        return self.tasks[max(hits, key=len)] if hits else None

    def gen_length(self, task: str | None) -> int:
        """Generation length for ``task`` (its entry, else ``default_gen_length``)."""
        entry = self.setting(task)
        return entry.gen_length if entry is not None else self.default_gen_length


_TABLE1_SHOTS = {"gsm8k": 5, "minerva_math": 4, "humaneval": 0, "mbpp": 3}

#: d2Cache's evaluation settings (its certainty prior and d2Cache itself): GSM8K 5-shot, MATH 4-shot, 256 tokens
_D2CACHE_TASKS = {"gsm8k": TaskSetting(5, 256), "minerva_math": TaskSetting(4, 256)}

PRESETS: dict[str, EvalPreset] = {
    "table1": EvalPreset(
        "table1",
        "paper Table 1: block 32, steps = gen length, threshold 0.9; GSM8K 5-shot / 256, MATH 4-shot / 256, "
        "HumanEval 0-shot / 512, MBPP 3-shot / 256",
        {name: TaskSetting(shots, 512 if name == "humaneval" else 256) for name, shots in _TABLE1_SHOTS.items()},
    ),
    "table1-512": EvalPreset(
        "table1-512",
        "paper Table 1 with 512-token generations (the GSM8K-512 row): block 32, steps = 512, threshold 0.9",
        {name: TaskSetting(shots, 512) for name, shots in _TABLE1_SHOTS.items()},
        default_gen_length=512,
    ),
    # PC-Sampler ("PC-Sampler: Position-Aware Calibration of Decoding Bias in Masked Diffusion Models"): its released
    # LLaDA-8B-Instruct runs decode 256 tokens in one block, one token per step, lambda 0.25, alpha 10 (GSM8K 4-shot,
    # HumanEval 0-shot); with ``policy=pc-sampler`` and the model's token-frequency table
    "pc-sampler": EvalPreset(
        "pc-sampler",
        "PC-Sampler's runs: one block of 256, one token per step, position decay 0.25, clip 10; GSM8K 4-shot, "
        "HumanEval 0-shot (policy pc-sampler)",
        {"gsm8k": TaskSetting(4, 256), "humaneval": TaskSetting(0, 256)},
        block_length=256,
        options={"commit.debias?": True, "commit.position_decay?": 0.25, "commit.clip_alpha?": 10.0},
    ),
    # d2Cache's certainty prior ("d2Cache: Accelerating Diffusion-Based LLMs via Dual Adaptive Caching"): sigma 10 and
    # no semi-autoregressive blocks (block = generation length, 256 for GSM8K and MATH in its settings), one token per
    # step; few-shot counts as Table 1 (lm-eval's defaults)
    "certainty-prior": EvalPreset(
        "certainty-prior",
        "d2Cache's certainty prior: one block of 256, one token per step, sigma 10; GSM8K 5-shot, MATH 4-shot "
        "(policy certainty-prior)",
        _D2CACHE_TASKS,
        block_length=256,
        options={"commit.sigma?": 10.0},
    ),
    # d2Cache itself (same paper, same evaluation settings): rollout nucleus 0.1, 32 current-block rows, sigma 10,
    # no inflation, as its released configuration
    "d2cache": EvalPreset(
        "d2cache",
        "d2Cache's runs: one block of 256, one token per step, rollout_p 0.1, current_k 32, sigma 10; GSM8K 5-shot, "
        "MATH 4-shot (policy d2cache)",
        _D2CACHE_TASKS,
        block_length=256,
        options={"refresh.rollout_p?": 0.1, "refresh.current_k?": 32, "refresh.sigma?": 10.0, "refresh.inflate_w?": 0},
    ),
}


def get_preset(name: str) -> EvalPreset:
    """The preset registered as ``name``; a ValueError listing the presets otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown evaluation preset {name!r}; presets: {', '.join(PRESETS)}") from None
