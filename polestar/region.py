"""Commit-region schedules: which positions of each row a step may commit (the *region*), as per-row index tensors.

The decoding loop steps through *loop blocks* (``span`` columns each, left to right); inside one, every step
proposes tokens for the region's columns ``DecodeState.region [B, R]`` (``region_valid [B, R]`` marks the real
entries) and commits some of them. Two schedules:

* :class:`BlockRegion` — LLaDA's semi-autoregressive blocks (Nie et al. 2025, "Large Language Diffusion Models";
  Fast-dLLM's blocks): the region is the current block, ``block_length`` columns, the same for every row; the loop
  block is that block.
* :class:`WindowRegion` — a sliding window (Elastic-Cache, Nguyen-Tri et al. 2025, "Attention Is All You Need for
  KV Cache in Diffusion LLMs", ``generate_with_elastic_cache``): the region is each row's first ``window_length``
  still-masked positions in position order, crossing any block boundary; the loop block is the whole generation.
  It moves after every step (:meth:`WindowRegion.advance`, in the step, no host read). After the first step that
  commits a stop token, a row's window never passes that step's leftmost stop token (``DecodeState.horizon``), as
  in the method's code: positions right of it are not decoded (with ``stop_at_eos`` the engine then fills them
  with EOS).

Both are fixed-shape: ``R`` is fixed for the generation, and a window with fewer than ``R`` candidates left is
padded with distinct committed columns marked invalid.
"""

from __future__ import annotations

import attrs
import torch
from attrs import validators as v

from .config import GenerationConfig


@attrs.frozen
class BlockRegion:
    """The current block: ``region [B, bl] = block_start + arange(bl)`` (see the module docstring)."""

    def width(self, config: GenerationConfig) -> int:
        return config.block_length

    def span(self, config: GenerationConfig) -> int:
        return config.block_length

    def begin_block(self, state) -> None:
        """Write the block's columns (host side, in place, at a block start)."""
        state.region.copy_((state.clock.block_start + state.block_arange)[None, :].expand_as(state.region))
        state.region_valid.fill_(True)

    def advance(self, state, committed: torch.Tensor, tokens: torch.Tensor, stops) -> None:
        """Nothing moves inside a block."""

    def work(self, state, finished: torch.Tensor) -> torch.Tensor:
        """``[num_blocks]`` bool: blocks where an unfinished row still has a masked position."""
        gen = state.x[:, state.prompt_len :]
        masked = (gen == state.mask_id).view(gen.shape[0], -1, state.config.block_length).any(dim=2)
        return (masked & ~finished[:, None]).any(dim=0)


@attrs.frozen
class WindowRegion:
    """A sliding window of the first ``window_length`` masked positions of each row (see the module docstring).

    ``eos_id``: the token whose first commit bounds the window (None: the generation's stop tokens, the model's EOS
    and end-of-turn ids, when the generation stops at EOS; else no bound). Shapes: ``region, region_valid [B, R]``
    with ``R = min(window_length, gen_length)``, ``horizon [B]`` (``T`` while no stop token was committed)."""

    window_length: int = attrs.field(validator=[v.instance_of(int), v.ge(1)])
    eos_id: int | None = attrs.field(default=None, validator=v.optional(v.instance_of(int)))

    def width(self, config: GenerationConfig) -> int:
        return min(self.window_length, config.gen_length)

    def span(self, config: GenerationConfig) -> int:
        return config.gen_length

    def candidates(self, state) -> torch.Tensor:
        """``[B, G]`` bool: generation positions still to decode (masked, not right of the row's horizon)."""
        P = state.prompt_len
        cols = P + torch.arange(state.length - P, device=state.x.device)
        return (state.x[:, P:] == state.mask_id) & (cols[None, :] <= state.horizon[:, None])

    def _write(self, state) -> None:
        cand = self.candidates(state)
        R = state.region.shape[1]
        order = torch.sort((~cand).to(torch.int8), dim=1, stable=True).indices[:, :R]  # candidates first, in order
        state.region.copy_(state.prompt_len + order)
        state.region_valid.copy_(cand.gather(1, order))

    def begin_block(self, state) -> None:
        self._write(state)

    def advance(self, state, committed: torch.Tensor, tokens: torch.Tensor, stops: torch.Tensor | None) -> None:
        """After the step's commits (``committed, tokens [B, R]`` at the region's columns): bound the window at the
        first step's leftmost committed stop token (``eos_id``, else one of ``stops [S]``; None: no bound), then move
        it to the masked positions left."""
        if self.eos_id is None and stops is None:
            self._write(state)
            return
        is_stop = tokens == self.eos_id if self.eos_id is not None else torch.isin(tokens, stops)
        stop_now = committed & is_stop
        T = state.length
        first = torch.where(stop_now, state.region, T).amin(dim=1)
        state.horizon.copy_(torch.where((state.horizon == T) & stop_now.any(dim=1), first, state.horizon))
        self._write(state)

    def work(self, state, finished: torch.Tensor) -> torch.Tensor:
        """``[1]`` bool: an unfinished row still has a position to decode."""
        return (self.candidates(state).any(dim=1) & ~finished).any(dim=0, keepdim=True)
