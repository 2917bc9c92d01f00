"""Refresh selectors of the cache-free baseline and Fast-dLLM's prefix and dual caches.

Sources: LLaDA (Nie et al. 2025) recomputes every position every step; Fast-dLLM (Wu et al. 2025, "Fast-dLLM:
Training-free Acceleration of Diffusion LLM by Enabling KV Cache and Parallel Decoding") caches the prefix
(``prefix``) or the prefix and suffix (``dual``) K/V within a block and refreshes everything at each block start.
"""

from __future__ import annotations

import attrs

from polestar.models.plan import DecodeCache, Plan, full_plan, span_plan
from polestar.region import BlockRegion, WindowRegion
from polestar.registry import register
from polestar.stages import RefreshSelector
from polestar.state import DecodeState, StepPosition


def block_start_plan(state: DecodeState) -> Plan:
    """All positions at every layer; the block's predicting hidden states start at ``block_start - shift``
    (a device scalar)."""
    plan = full_plan(state.batch_size, state.length, state.x.device)
    return Plan(plan.index, plan.valid & state.active[:, None], state.clock.block_start - state.logit_shift)


def full_refresh_due(position: StepPosition, interval: int) -> bool:
    """Whether the step at ``position`` refreshes everything: a block's first step, and every ``interval``-th step
    inside a block (``interval`` 0: never)."""
    return position.at_block_start or (interval > 0 and position.step % interval == 0)


def block_plan(state: DecodeState) -> Plan:
    """Only the block (from one position early for Dream's shifted logits), rows of finished sequences unused."""
    shift = state.logit_shift
    return span_plan(state.batch_size, state.clock.block_start - shift, state.block_length + shift, state.x.device,
                     state.active)


@register("refresh", "full")
class FullRefresh(RefreshSelector):
    """No cache (LLaDA baseline): every layer recomputes all ``T`` positions at every step. Plan ``[B, T]``.
    ``window_length``: commit from a sliding window of each row's first ``window_length`` masked positions
    (:class:`~polestar.region.WindowRegion`) instead of blocks."""

    @attrs.frozen
    class Config:
        window_length: int | None = attrs.field(default=None, validator=attrs.validators.optional(
            [attrs.validators.instance_of(int), attrs.validators.ge(1)]))

    def region(self):
        if self.config.window_length is None:
            return BlockRegion()
        return WindowRegion(self.config.window_length)

    def plan(self, state: DecodeState, cache: DecodeCache, local=None) -> Plan:
        plan = block_start_plan(state)
        if self.config.window_length is None:
            return plan
        return Plan(plan.index, plan.valid, state.region - state.logit_shift)  # slot == position


@register("refresh", "prefix")
class PrefixRefresh(RefreshSelector):
    """Fast-dLLM prefix cache: full refresh at block start, then positions ``[block_start - shift, T)``.

    Plan shape ``[B, T - block_start + shift]``; prefix K/V are reused within the block. Phase: 0 at a full
    refresh, else the span's length (its shape: one graph per block).
    """

    @attrs.frozen
    class Config:
        """``refresh_interval``: also refresh everything every that many steps inside a block (0 = never;
        1 = every step, which reproduces no-cache decoding)."""

        refresh_interval: int = attrs.field(default=0, validator=attrs.validators.ge(0))

    def phase(self, position: StepPosition, state: DecodeState, local=None) -> int:
        if full_refresh_due(position, self.config.refresh_interval):
            return 0
        return state.length - position.block_start + state.logit_shift

    def plan(self, state: DecodeState, cache: DecodeCache, local=None) -> Plan:
        size = state.phase.refresh
        if size == 0:
            return block_start_plan(state)
        return span_plan(state.batch_size, state.length - size, size, state.x.device, state.active)


@register("refresh", "dual")
class DualRefresh(RefreshSelector):
    """Fast-dLLM dual cache: full refresh at block start, then only the block ``[block_start - shift, block_end)``.

    Plan shape ``[B, block_length + shift]``; prefix and suffix K/V are reused within the block. Phase: whether
    the step refreshes everything.
    """

    @attrs.frozen
    class Config:
        """``refresh_interval``: also refresh everything every that many steps inside a block (0 = never;
        1 = every step, which reproduces no-cache decoding)."""

        refresh_interval: int = attrs.field(default=0, validator=attrs.validators.ge(0))

    def phase(self, position: StepPosition, state: DecodeState, local=None) -> bool:
        return full_refresh_due(position, self.config.refresh_interval)

    def plan(self, state: DecodeState, cache: DecodeCache, local=None) -> Plan:
        if state.phase.refresh:
            return block_start_plan(state)
        return block_plan(state)
