"""Refresh selectors of the cache-free baseline and Fast-dLLM's prefix and dual caches.

Sources: LLaDA (Nie et al. 2025) recomputes every position every step; Fast-dLLM (Wu et al. 2025, "Fast-dLLM:
Training-free Acceleration of Diffusion LLM by Enabling KV Cache and Parallel Decoding") caches the prefix
(``prefix``) or the prefix and suffix (``dual``) K/V within a block and refreshes everything at each block start.
"""

from __future__ import annotations

import attrs

from polestar.models.plan import DecodeCache, Plan, full_plan, span_plan
from polestar.registry import register
from polestar.stages import RefreshSelector
from polestar.state import DecodeState


def block_start_plan(state: DecodeState) -> Plan:
    """All positions at every layer; the block's predicting hidden states start at ``block_start - shift``."""
    plan = full_plan(state.batch_size, state.length, state.x.device)
    return Plan(plan.index, plan.valid & state.active[:, None], state.block_start - state.logit_shift)


def _full_refresh_due(state: DecodeState, interval: int) -> bool:
    return state.at_block_start or (interval > 0 and state.step % interval == 0)


def block_plan(state: DecodeState) -> Plan:
    """Only the block (from one position early for Dream's shifted logits), rows of finished sequences unused."""
    return span_plan(state.batch_size, state.block_start - state.logit_shift, state.block_end, state.x.device,
                     state.active)


@register("refresh", "full")
class FullRefresh(RefreshSelector):
    """No cache (LLaDA baseline): every layer recomputes all ``T`` positions at every step. Plan ``[B, T]``."""

    @attrs.frozen
    class Config:
        pass

    def plan(self, state: DecodeState, cache: DecodeCache, local=None) -> Plan:
        return block_start_plan(state)


@register("refresh", "prefix")
class PrefixRefresh(RefreshSelector):
    """Fast-dLLM prefix cache: full refresh at block start, then positions ``[block_start - shift, T)``.

    Plan shape ``[B, T - block_start + shift]``; prefix K/V are reused within the block.
    """

    @attrs.frozen
    class Config:
        """``refresh_interval``: also refresh everything every that many steps inside a block (0 = never;
        1 = every step, which reproduces no-cache decoding)."""

        refresh_interval: int = attrs.field(default=0, validator=attrs.validators.ge(0))

    def plan(self, state: DecodeState, cache: DecodeCache, local=None) -> Plan:
        if _full_refresh_due(state, self.config.refresh_interval):
            return block_start_plan(state)
        return span_plan(state.batch_size, state.block_start - state.logit_shift, state.length, state.x.device, state.active)


@register("refresh", "dual")
class DualRefresh(RefreshSelector):
    """Fast-dLLM dual cache: full refresh at block start, then only the block ``[block_start - shift, block_end)``.

    Plan shape ``[B, block_length + shift]``; prefix and suffix K/V are reused within the block.
    """

    @attrs.frozen
    class Config:
        """``refresh_interval``: also refresh everything every that many steps inside a block (0 = never;
        1 = every step, which reproduces no-cache decoding)."""

        refresh_interval: int = attrs.field(default=0, validator=attrs.validators.ge(0))

    def plan(self, state: DecodeState, cache: DecodeCache, local=None) -> Plan:
        if _full_refresh_due(state, self.config.refresh_interval):
            return block_start_plan(state)
        return block_plan(state)
