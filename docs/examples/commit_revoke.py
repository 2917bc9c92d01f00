"""A commit rule that takes tokens back: Fast-dLLM's threshold commit, plus ``CommitSelection(revoke=...)`` on a
committed block token when the model, seeing it, now proposes another token there with probability ≥ ``flip``.
The engine masks revoked positions again, counts them (``stats.revoked``; TPF counts final tokens only) and ignores
revocations once a block has run ``2 × block_length`` steps, so every block ends."""

import attrs
import torch

import polestar
from polestar.stages import CommitRule
from polestar.state import CommitSelection
from polestar.testing import check_stage


@polestar.register("commit", "second-thoughts")
class SecondThoughts(CommitRule):
    """Threshold commit; revoke a committed token whose proposal changed. Shapes ``[B, bl]``."""

    @attrs.frozen
    class Config:
        threshold: float = 0.9
        flip: float = 0.3

    def select(self, pred, masked, state, local=None):
        conf = pred.confidence.masked_fill(~masked, float("-inf"))
        top = torch.zeros_like(masked).scatter_(1, conf.argmax(dim=1, keepdim=True), True)
        held = state.x.gather(1, state.region)  # the block's tokens before this step
        p_new = pred.logits.float().softmax(-1).gather(-1, pred.tokens[..., None]).squeeze(-1)
        changed = (held != state.mask_id) & (pred.tokens != held) & (p_new >= self.config.flip)
        return CommitSelection(masked & ((conf >= self.config.threshold) | top), revoke=changed)


if __name__ == "__main__":
    check_stage("commit", "second-thoughts", ["contract", "invariants"])
    model = polestar.load("tiny-llada")
    out = polestar.generate(model, ["3+4*2-5"], task="arith", policy="parallel", commit="second-thoughts")
    print(out.texts[0], out.stats.nfe, "steps,", out.stats.revoked, "tokens revoked")
