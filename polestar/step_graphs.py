"""Uncompiled steps replayed as graphs: one captured graph per step phase, no compiler involved.

An uncompiled step issues a few hundred small operations per layer pass (LLaDA-8B: ~650 per step for the dual
cache), and on a GPU each costs a kernel launch, so eagerly a step is bound by launches, not by the bytes it reads.
Because a step is a function of the generation's persistent buffers whose Python control flow depends only on its
:class:`~polestar.state.StepPhase` (see :mod:`polestar.step`), its operations can be recorded once per phase and
replayed on the same buffers: what SGLang's graph runner does for its eager forward. :class:`StepGraphs` does that:

* the first step of a phase runs eagerly (on CUDA this is also the warm-up a capture needs: lazy initialisation,
  allocator pools);
* the second step of that phase is captured (:class:`CudaGraph`: ``torch.cuda.CUDAGraph`` on the generation's
  device; capturing runs nothing) and replayed; every later step of the phase is one replay. The contract checks
  of checked stages (:mod:`polestar.contracts`, host reads) run in the eager first step and are suspended while
  capturing;
* what the step returns is the captured graph's output: the "work left" flags are a tensor the replay rewrites,
  and the cost counters are plain ints, the same for every step of the phase;
* a step an observer watches (``state.detail``, :class:`~polestar.state.StepDetail`) is captured and replayed the
  same way, as a graph of its own per phase (it records more than an unwatched step): its view of the step
  (:class:`~polestar.step.StepView`) is part of its output, and the detail the stages filled at the capture is handed
  back at each replay (``state.detail``), its tensors rewritten by the replay. So observing a decode never takes
  its steps off their graphs; the observer copies what it keeps before the next step.

A graph belongs to one generation object (its buffers' addresses) and one phase; generations reused from the pool
(:func:`polestar.engine.acquire_generation`) reuse their graphs, as long as the generation and its model still hold
every tensor the graph was captured with (checked on the host before each block: a weight assigned by hand between
two generations drops the graphs that read the old one, and they are captured again). Random numbers are drawn into
the generation's buffers before each step, outside the graph (:meth:`~polestar.step.Generation.draw`).

What replaying needs from a step, beyond the compiled step's rules: the same operations on the same buffers at
every step of a phase. :class:`ReplayTape` records a step's operations and replays them on a CPU with exactly a
CUDA graph's semantics (recorded operations on recorded tensors, no Python), so the tests check every registered
policy this way on any machine (:func:`polestar.step.taped_step_graphs`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from polestar.models import layer_regions

from .contracts import suspended

#: what a step returns (:class:`~polestar.step.StepOutput`)
Out = TypeVar("Out")


class StepGraph(Protocol):
    """A captured step: ``capture(fn)`` records ``fn()`` (without its effects on the buffers, as a CUDA graph
    capture) and returns what it returned; ``replay()`` runs the recorded operations again."""

    def capture(self, fn: Callable[[], Out]) -> Out: ...

    def replay(self) -> None: ...


class CudaGraph:
    """:class:`StepGraph` on CUDA: ``torch.cuda.CUDAGraph`` captured on a side stream, all graphs of a
    :class:`StepGraphs` sharing one memory pool (a step's temporaries; its outputs are read before the next
    replay)."""

    _pool: Any = None

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        if CudaGraph._pool is None:
            CudaGraph._pool = torch.cuda.graph_pool_handle()
        self.pool = CudaGraph._pool

    def capture(self, fn: Callable[[], Out]) -> Out:
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


class _Recorder(TorchDispatchMode):
    """Records every ATen operation with its arguments and outputs (the tensors themselves, not copies)."""

    def __init__(self) -> None:
        super().__init__()
        self.tape: list[tuple[Any, tuple, dict, list[torch.Tensor]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("a step read a tensor's value on the host while being captured (.item(), bool(t), "
                               "...): a replayed graph would keep the captured value")
        out = func(*args, **kwargs)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if func._schema.is_mutable or not _aliases_inputs(outputs, (args, kwargs)):
            self.tape.append((func, args, kwargs, outputs))
        return out


def _aliases_inputs(outputs: list[torch.Tensor], inputs) -> bool:
    """Whether every tensor of ``outputs`` shares storage with a tensor of ``inputs``: a view, which computes nothing.
    Decided by storage, not by the operation's schema: an operation that *may* alias (``to``, ``reshape``) returns
    a fresh tensor when it has to convert or copy, and that result must be recomputed at replay."""
    storages = {t.untyped_storage().data_ptr() for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)}
    return all(t.untyped_storage().data_ptr() in storages for t in outputs)


class ReplayTape:
    """:class:`StepGraph` on any device, with a CUDA graph's semantics: ``capture`` records every operation of one
    step (views excluded: they compute nothing and alias what they view; a result that shares no storage with the
    operation's inputs is never a view) and undoes its effects on the persistent
    buffers ``buffers``; ``replay`` calls each recorded operation again on the recorded tensors and writes each
    result into the tensor that operation produced at capture, as a replayed kernel writes to its captured
    address. Python code does not run at replay: a step whose Python decisions changed between two steps of one
    phase replays the old ones, as on a GPU."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.buffers = buffers
        self.tape: list[tuple[Any, tuple, dict, list[torch.Tensor]]] = []

    def capture(self, fn: Callable[[], Out]) -> Out:
        storages = list({t.untyped_storage().data_ptr(): t.untyped_storage() for t in self.buffers}.values())
        saved = [s.clone() for s in storages]  # whole storages: a buffer may be a view, even an expanded one
        recorder = _Recorder()
        # dynamo runs no compiled code under a dispatch mode: the tape records the layer regions' plain functions
        # (bit for bit what the compiled ones compute); a CUDA graph holds the compiled kernels themselves
        with layer_regions.using(layer_regions.PLAIN), recorder:
            out = fn()
        self.tape = recorder.tape
        for storage, copy in zip(storages, saved):
            storage.copy_(copy)
        return out

    def replay(self) -> None:
        for func, args, kwargs, outputs in self.tape:
            result = func(*args, **kwargs)
            fresh = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
            for captured, new in zip(outputs, fresh):
                if new is not captured:
                    captured.copy_(new)


class StepGraphs:
    """Runs steps as replayed graphs (see the module docstring): ``graphs(gen)`` → what ``step(gen)`` returns.

    ``step``: the step function (:func:`polestar.step.decode_step`); ``graph``: a factory ``graph(gen) -> StepGraph``,
    default a :class:`CudaGraph` (one memory pool for all); ``reads`` (optional): ``reads(gen)`` → every tensor a
    step of ``gen`` may read (its buffers and its model's weights), listed at each capture and compared before each
    block (:meth:`keep_valid`). ``eager``, ``captured``, ``replayed``: how many steps ran
    eagerly (a phase's first), were captured, were replays (a capture is replayed at once, so it counts in
    ``replayed`` too): ``eager + replayed`` is the number of steps."""

    def __init__(self, step: Callable[[Any], Any], graph: Callable[[Any], StepGraph] | None = None,
                 reads: Callable[[Any], list[torch.Tensor]] | None = None) -> None:
        self._step = step
        self._make = graph if graph is not None else (lambda gen: CudaGraph())
        self._reads = reads
        #: (generation id, phase, observed) → (generation, graph, its output, the tensors it reads, the detail its
        #: stages filled at the capture or None)
        self._graphs: dict[tuple[int, Any, bool], tuple[Any, StepGraph, Any, tuple, Any]] = {}
        self._seen: set[tuple[int, Any, bool]] = set()
        self.eager = self.captured = self.replayed = 0

    def keep_valid(self, gen) -> int:
        """Drop ``gen``'s graphs captured while it or its model held a tensor they no longer hold (``reads(gen)``: a
        buffer replaced at a block start, a weight assigned by hand; buffers added since do not matter), so that the
        next steps of those phases are captured anew instead of replaying on the old addresses; → how many were
        dropped. Host-side, before a block."""
        if self._reads is None:
            return 0
        now = set(map(id, self._reads(gen)))
        stale = [key for key, entry in self._graphs.items()
                 if entry[0] is gen and not all(id(t) in now for t in entry[3])]
        for key in stale:
            del self._graphs[key]
        return len(stale)

    def __call__(self, gen):
        detail = gen.state.detail  # an observer's step: captured too, as a graph of its own (it records more)
        key = (id(gen), gen.state.phase, detail is not None)
        entry = self._graphs.get(key)
        if entry is not None and entry[0] is gen:
            entry[1].replay()
            self.replayed += 1
            if entry[4] is not None:  # what the stages gathered at the capture, rewritten by the replay
                gen.state.detail = entry[4]
            return entry[2]
        if key not in self._seen:  # a phase's first step: eagerly (the warm-up of its capture)
            self._seen.add(key)
            self.eager += 1
            return self._step(gen)
        graph = self._make(gen)
        with suspended():  # a checked stage was checked in the phase's first step; a capture reads nothing back
            out = graph.capture(lambda: self._step(gen))
        reads = tuple(self._reads(gen)) if self._reads is not None else ()  # held: their ids stay theirs
        self._graphs[key] = (gen, graph, out, reads, detail)
        self.captured += 1
        graph.replay()
        self.replayed += 1
        return out
