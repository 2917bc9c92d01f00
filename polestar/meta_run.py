"""Every step phase of a policy at a published model's full shape, on the meta device: no weights, no memory, no
host read possible (a meta tensor has no value to read), and a live-bytes estimate of the peak device memory.

:func:`meta_step_phases` builds the model from the published ``config.json`` (all layers, full width, bf16) on the
meta device, allocates a generation's buffers there, and runs :func:`polestar.step.decode_step` once for every
:class:`~polestar.state.StepPhase` the policy meets in a generation of that shape (a block start with its full
forward, the window refresh of block index 3, a sparse-update step, a plain step, the last block's), driving the
phases from the loop's positions instead of from the device flags it cannot read. :class:`LiveBytes` counts the
bytes of every tensor alive (weights, the generation's buffers, each step's temporaries) and keeps the peak.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from polestar.models.loading import FAMILIES, build_on_meta
from polestar.models.published import published

from .config import GenerationConfig
from .engine import _position, begin_block, start_generation, step_phase
from .policy import assemble
from .state import StepPhase
from .step import decode_step, persistent_tensors


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the tensor storages alive while the mode is on (``live``) and their peak (``peak``), on
    top of ``held``: tensors already allocated (the weights, the generation's buffers), counted once and never
    released. A storage is counted when an operation creates it and released when the tensor that created it is
    freed (views and in-place results share a storage and are not counted again), so the figure is an estimate of
    what a caching allocator would hold, without its rounding and fragmentation."""

    def __init__(self, held: list[torch.Tensor] = ()):
        super().__init__()
        self.counted: dict[int, int] = {_storage_key(t): 0 for t in held}
        self.live = self.peak = sum(_storage_nbytes(t) for t in _unique_storages(held))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                key = _storage_key(t)
                if key not in self.counted:
                    nbytes = self.counted[key] = _storage_nbytes(t)
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(t, self._release, key)
        return out

    def _release(self, key: int) -> None:
        self.live -= self.counted.pop(key, 0)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _storage_nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _unique_storages(tensors) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in tensors:
        if _storage_key(t) not in seen:
            seen.add(_storage_key(t))
            out.append(t)
    return out


class MetaRun(NamedTuple):
    """One policy's meta run: ``phases`` run (one step each); ``weight_bytes``, ``buffer_bytes`` (the generation's
    persistent buffers) and ``peak_bytes`` (weights + buffers + the largest step's temporaries, :class:`LiveBytes`)."""

    phases: tuple[StepPhase, ...]
    weight_bytes: int
    buffer_bytes: int
    peak_bytes: int


def meta_model(family: str, dtype: torch.dtype = torch.bfloat16):
    """The published ``family`` model (``llada``, ``dream``, or a published name) at full size on the meta device."""
    info = published(family)
    spec_fn, cls, _ = FAMILIES[info.family]
    return build_on_meta(cls, spec_fn(dict(info.config))).to(dtype).eval()


@torch.inference_mode()
def meta_step_phases(model, policy: str, batch: int, prompt_len: int, config: GenerationConfig,
                     overrides: dict | None = None) -> MetaRun:
    """Run every step phase ``policy`` meets once on the meta ``model`` (see the module docstring) for ``batch``
    prompts of ``prompt_len`` tokens; → a :class:`MetaRun`. Any host read raises (meta tensors have no values)."""
    pipeline = assemble(policy, overrides or {})
    device = torch.device("meta")
    params = list(model.parameters())
    weights = sum(_storage_nbytes(t) for t in _unique_storages(params))
    ids = torch.zeros(batch, prompt_len, dtype=torch.long, device=device)
    mask = torch.ones(batch, prompt_len, dtype=torch.bool, device=device)
    gen = start_generation(model, ids, mask, pipeline, config)
    seen: list[StepPhase] = []
    buffers = peak = 0
    n_blocks = config.num_blocks
    for block in sorted({0, min(3, n_blocks - 1), n_blocks - 1}):
        begin_block(gen, block)
        held = _unique_storages([*params, *persistent_tensors(gen)])
        buffers = sum(_storage_nbytes(t) for t in held) - weights
        for step, flags in ((0, ()), (1, (True,)), (2, (False,))):
            phase = step_phase(gen, _position(gen, block, step, step, flags))
            if phase in seen:
                continue
            seen.append(phase)
            gen.state.phase = phase
            counter = LiveBytes(held)
            with counter:
                decode_step(gen)
            peak = max(peak, counter.peak)
    return MetaRun(tuple(seen), weights, buffers, peak)
