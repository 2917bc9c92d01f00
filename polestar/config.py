"""Frozen, validated configuration of one generation run (the part that is not a stage option)."""

from __future__ import annotations

import attrs
from attrs import validators as v


def _positive_int(_inst, attribute, value):
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive integer, got {value!r}")


def _temperature(value) -> float:
    """Converter: a real number (not a bool or a string) as float, else one error naming ``temperature``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"temperature must be a number in [0, 100] (0 = greedy), got {value!r}")
    return float(value)


def _temperature_range(_inst, attribute, value):
    if not 0.0 <= value <= 100.0:  # also rejects NaN
        raise ValueError(f"temperature must be in [0, 100] (0 = greedy), got {value!r}")


def _integer(_inst, attribute, value):
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{attribute.name} must be an integer, got {value!r}")


def _boolean(_inst, attribute, value):
    if not isinstance(value, bool):
        raise ValueError(f"{attribute.name} must be True or False, got {value!r}")


@attrs.frozen
class GenerationConfig:
    """Block-decoding layout and sampling options.

    ``gen_length`` tokens are generated in ``gen_length // block_length`` blocks, left to right (LLaDA's
    semi-autoregressive remasking). ``steps`` (default ``gen_length``) is the step budget that fixed-count rules
    spread evenly over blocks. ``temperature`` 0 is greedy; above 0 samples with float64 Gumbel noise from a
    generator seeded with ``seed``. ``stop_at_eos`` lets a sequence finish as soon as an EOS is committed with
    every position before it committed (the rest is filled with EOS).
    """

    gen_length: int = attrs.field(default=256, validator=_positive_int)
    block_length: int = attrs.field(default=32, validator=_positive_int)
    steps: int | None = attrs.field(default=None, validator=v.optional(_positive_int))
    temperature: float = attrs.field(default=0.0, converter=_temperature, validator=_temperature_range)
    seed: int = attrs.field(default=0, validator=_integer)
    stop_at_eos: bool = attrs.field(default=True, validator=_boolean)

    def __attrs_post_init__(self):
        if self.gen_length % self.block_length:
            raise ValueError(
                f"gen_length ({self.gen_length}) must be a multiple of block_length ({self.block_length}); "
                f"e.g. block_length {_divisor_near(self.gen_length, self.block_length)}"
            )
        if self.total_steps % self.num_blocks:
            raise ValueError(
                f"steps ({self.total_steps}) must be a multiple of the number of blocks ({self.num_blocks} = "
                f"gen_length {self.gen_length} / block_length {self.block_length}); e.g. steps "
                f"{max(self.num_blocks, self.total_steps - self.total_steps % self.num_blocks)}"
            )
        if self.total_steps > self.gen_length:
            raise ValueError(f"steps ({self.total_steps}) cannot exceed gen_length ({self.gen_length}): a step "
                             "commits at least one token; lower steps")

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def total_steps(self) -> int:
        return self.gen_length if self.steps is None else self.steps

    @property
    def steps_per_block(self) -> int:
        return self.total_steps // self.num_blocks


def _divisor_near(n: int, want: int) -> int:
    """The divisor of ``n`` closest to ``want`` (a suggestion for ``block_length``)."""
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - want), d))
