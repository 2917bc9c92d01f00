"""The per-step forward as one function of tensors, so it can be compiled whole with ``torch.compile``.

``block_forward`` executes a plan (with an optional sparse-update hook and attention probe) and returns the logits
of the current block's positions, the logits of the hook's last-layer rows (the update packet) from the same pass
over the LM head, and the pass's :class:`~polestar.models.cost.StepCost`; the Python block/step loop in
:mod:`polestar.engine` stays around it. With
``compile=True`` it is wrapped in ``torch.compile(fullgraph=True)`` (``mode="reduce-overhead"`` — CUDA graphs — on
CUDA, with the cache buffers marked as static addresses). Shapes: ``index, valid [B, C]`` (or per layer
``[L, B, C]``), ``target_slots [B, bl]`` → logits ``[B, bl, V]``, probe ``[B, H, R, T + 1]`` or None, packet
logits ``[B, M, V]`` or None, and the cost (plain ints, returned by a compiled step as well).
"""

from __future__ import annotations

import torch

from polestar.models.backbone import AttentionProbe, DiffusionLM
from polestar.models.cost import CostMeter
from polestar.models.plan import DecodeCache, Plan


def block_forward(
    model: DiffusionLM,
    x: torch.Tensor,
    cache: DecodeCache,
    index: torch.Tensor,
    valid: torch.Tensor,
    target_slots: torch.Tensor,
    probe: AttentionProbe | None,
    hook,
):
    meter = CostMeter()
    out = model.run_plan(x, cache, Plan(index, valid, 0), probe, hook, meter)
    h = out.hidden.gather(1, target_slots[..., None].expand(-1, -1, out.hidden.shape[-1]))
    extra = hook.head_rows if hook is not None else None
    if extra is None:
        return model.logits(h, meter), out.probe, None, meter.result()
    meter.weight(model.final_norm_weight())
    logits = model.logits(torch.cat([h, model.final_norm(extra)], dim=1), meter)
    bl = h.shape[1]
    return logits[:, :bl], out.probe, logits[:, bl:], meter.result()


class StepRunner:
    """Runs :func:`block_forward` eagerly or compiled.

    Steps whose hook declares ``compilable = False`` (cluster construction at a block start, which draws random
    initial centroids, and Elastic-Cache's data-dependent trigger) run eagerly; every other step goes through the
    compiled graph. Recompiles are bounded by the distinct plan shapes of a policy (full, block, prefix (dynamic
    length), and with/without a sparse-update hook).
    """

    def __init__(self, compile: bool, device: torch.device):
        self.compile = compile
        self.device = device
        self._compiled = None
        self._static: set[int] = set()
        if compile:
            mode = "reduce-overhead" if device.type == "cuda" else None
            self._compiled = torch.compile(block_forward, fullgraph=True, dynamic=None, mode=mode)

    def mark_static(self, cache: DecodeCache) -> None:
        """Pin the cache buffers' addresses for CUDA graphs (they are written in place, never reallocated)."""
        if not self.compile or self.device.type != "cuda" or id(cache) in self._static:
            return
        for t in [*cache.k, *cache.v, *(cache.hidden or [])]:
            torch._dynamo.mark_static_address(t)
        self._static.add(id(cache))

    def __call__(self, model, x, cache, plan: Plan, target_slots, probe, hook):
        fn = block_forward
        if self._compiled is not None and getattr(hook, "compilable", True):
            fn = self._compiled
        return fn(model, x, cache, plan.index, plan.valid, target_slots, probe, hook)
