"""Frozen, validated configuration of one generation run (the part that is not a stage option)."""

from __future__ import annotations

import attrs
from attrs import validators as v


def _positive_int(_inst, attribute, value):
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive integer, got {value!r}")


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
    temperature: float = attrs.field(default=0.0, converter=float, validator=[v.ge(0.0), v.le(100.0)])
    seed: int = attrs.field(default=0, validator=v.instance_of(int))
    stop_at_eos: bool = attrs.field(default=True, validator=v.instance_of(bool))

    def __attrs_post_init__(self):
        if self.gen_length % self.block_length:
            raise ValueError(
                f"gen_length ({self.gen_length}) must be a multiple of block_length ({self.block_length})"
            )
        if self.total_steps % self.num_blocks:
            raise ValueError(
                f"steps ({self.total_steps}) must be a multiple of the number of blocks ({self.num_blocks})"
            )
        if self.total_steps > self.gen_length:
            raise ValueError(f"steps ({self.total_steps}) cannot exceed gen_length ({self.gen_length})")

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def total_steps(self) -> int:
        return self.gen_length if self.steps is None else self.steps

    @property
    def steps_per_block(self) -> int:
        return self.total_steps // self.num_blocks
