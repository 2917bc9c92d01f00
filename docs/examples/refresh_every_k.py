"""A refresh selector with per-step state of its own: Fast-dLLM's dual cache, plus every position of each row whose
last full refresh is ``every`` steps old or whose last step committed more than ``burst`` tokens."""

import attrs
import torch

import polestar
from polestar.policies.refresh_basic import block_plan, block_start_plan
from polestar.stages import AfterStep, RefreshSelector
from polestar.testing import check_stage


@attrs.define
class DueRows:
    """Per generation, ``[B]`` each: ``age`` steps since the row's last full refresh; ``due`` rows refreshed next."""

    age: torch.Tensor
    due: torch.Tensor


@polestar.register("refresh", "every-k")
class EveryK(RefreshSelector):
    """Plan ``[B, T]`` at a block start or when a row is due (slot = position; a row not due keeps only its block
    valid), else the block's ``[B, bl + shift]``."""

    @attrs.frozen
    class Config:
        every: int = attrs.field(default=4, validator=attrs.validators.ge(1))
        burst: int = attrs.field(default=2, validator=attrs.validators.ge(1))

    def init_state(self, state):
        age = torch.zeros(state.batch_size, dtype=torch.long, device=state.x.device)
        return DueRows(age, age.bool())

    def begin_block(self, local, state):  # a block's first step refreshes every row
        local.age.zero_()

    def phase(self, position, state, local):  # the loop hands back after_step's flag: one graph per value
        return position.at_block_start or position.flags[0]

    def plan(self, state, cache, local):
        if not state.phase.refresh:
            return block_plan(state)
        full, cols = block_start_plan(state), torch.arange(state.length, device=state.x.device)
        block = (cols >= full.target_offset) & (cols < state.clock.block_start + state.block_length)
        return full._replace(valid=full.valid & (local.due[:, None] | block | (state.clock.step == 0)))

    def after_step(self, state, cache, model, local):  # on the device, after the step's commits
        local.age.add_(1)
        local.due.copy_(state.active & ((local.age >= self.config.every) | (state.last_commits > self.config.burst)))
        local.age.masked_fill_(local.due, 0)
        return AfterStep(flags=local.due.any()[None])


if __name__ == "__main__":
    check_stage("refresh", "every-k", ["contract", "invariants"])
    model = polestar.load("tiny-llada")
    out = polestar.generate(model, ["3+4*2-5"], task="arith", policy="fast-dllm", refresh="every-k")
    print(out.texts[0], out.pipeline.describe()["refresh"], out.stats.token_layer_evals)
