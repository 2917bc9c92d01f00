"""A refresh selector (kind ``refresh``): Fast-dLLM's dual cache that also recomputes the first positions after
the block.

Contract: ``plan(state, cache, local)`` -> a ``Plan(index, valid, target_offset)``: ``index`` long ``[B, C]`` (the
same positions at every layer) or ``[n_layers, B, C]``, values in ``[0, T]`` (``T``: the cache's trash slot for an
unused slot); ``valid`` bool of the same shape, False for unused slots and for every slot of a finished sequence
(``state.active``); ``target_offset``: the slot whose hidden state predicts the block's first position. ``plan``
runs inside the step: it reads Python values of ``state`` (``state.step``, ``state.block_start``) and builds
tensors, but never reads a tensor's values on the host. Optional methods: ``allocate`` (host-side, per block),
``hook`` (a layer hook for sparse updates), ``probe`` / ``observe`` (attention rows and bookkeeping).
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

    def plan(self, state, cache, local=None):
        if state.at_block_start:
            return block_start_plan(state)
        end = min(state.block_end + self.config.lookahead, state.length)
        return span_plan(state.batch_size, state.block_start - state.logit_shift, end, state.x.device, state.active)


if __name__ == "__main__":
    check_stage("refresh", "lookahead", ["contract", "invariants"])
    model = polestar.load("tiny-llada")
    out = polestar.generate(model, ["3+4*2-5"], task="arith", policy="fast-dllm", refresh="lookahead",
                            **{"refresh.lookahead": 8})
    print(out.texts[0], out.pipeline.describe()["refresh"], out.stats.token_layer_evals)
