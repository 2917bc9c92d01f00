"""A refresh selector (kind ``refresh``): Fast-dLLM's dual cache that also recomputes the first positions after
the block.

Contract: ``plan(state, cache, local)`` -> a ``Plan(index, valid, target_offset)``: ``index`` long ``[B, C]`` (the
same positions at every layer) or ``[n_layers, B, C]``, values in ``[0, T]`` (``T``: the cache's trash slot for an
unused slot); ``valid`` bool of the same shape, False for unused slots and for every slot of a finished sequence
(``state.active``); ``target_offset``: the slot whose hidden state predicts the block's first position. ``plan``
runs inside the step, which may be compiled whole: it reads positions from ``state.clock`` (device scalars) and
the step's variant from ``state.phase.refresh``, which ``phase(position, state, local)`` computed on the host
from the loop's position (plain ints), and builds tensors, but never reads a tensor's values on the host. Each
distinct phase is one compiled graph, so the phase carries what sets the plan's shape. Optional methods:
``allocate`` (host-side, per block), ``hook`` (a layer hook for sparse updates; its ``held()`` keeps rows' commits
for the next step) and ``after_step`` (decisions for the next step's variant, read with the loop's one host read).
"""

import attrs

import polestar
from polestar.models.plan import span_plan
from polestar.policies.refresh_basic import block_start_plan
from polestar.stages import RefreshSelector
from polestar.testing import check_stage


@polestar.register("refresh", "lookahead")
class LookaheadRefresh(RefreshSelector):
    """Full refresh at each block start; inside a block, the block and the ``lookahead`` positions after it
    (their K/V stay fresher for the block's queries). Plan ``[B, block_length + shift + lookahead]`` (fewer at the
    end of the sequence)."""

    @attrs.frozen
    class Config:
        lookahead: int = attrs.field(default=4, validator=attrs.validators.ge(0))

    def phase(self, position, state, local=None):
        """0 at a block's first step (a full refresh), else the span's length (the plan's shape)."""
        if position.at_block_start:
            return 0
        after = min(self.config.lookahead, state.length - position.block_end)
        return state.logit_shift + state.block_length + after

    def plan(self, state, cache, local=None):
        size = state.phase.refresh
        if size == 0:
            return block_start_plan(state)
        start = state.clock.block_start - state.logit_shift  # a device scalar: the step never reads it on the host
        return span_plan(state.batch_size, start, size, state.x.device, state.active)


if __name__ == "__main__":
    check_stage("refresh", "lookahead", ["contract", "invariants"])
    model = polestar.load("tiny-llada")
    out = polestar.generate(model, ["3+4*2-5"], task="arith", policy="fast-dllm", refresh="lookahead",
                            **{"refresh.lookahead": 8})
    print(out.texts[0], out.pipeline.describe()["refresh"], out.stats.token_layer_evals)
