"""Compiled steps called by phase key: after a phase's first compiled step, its graph is called directly on the
generation's buffers, without dynamo.

A compiled step (:func:`polestar.step.compiled_step`) is one ``torch.compile`` graph per
:class:`~polestar.state.StepPhase`. Called through ``torch.compile``, every step enters dynamo's frame: it walks
the generation object to evaluate the guards of the cached graphs (one per phase) and fetches the ~80-200 graph
inputs by their attribute paths. Both are the same at every step of a phase of one generation: the inputs are the
generation's persistent buffers and the model's weights, the same tensor objects written in place, and the phase
fixes which graph runs. So the first compiled step of each phase records what dynamo passed to its graph
(:class:`RecordingBackend`: the compiled graph and the tensors it was called with), and every later step of that
phase is ``graph(*inputs)``, selected by the phase key (:class:`PhaseTable`): no guard is evaluated and no object
graph walked. What the step returns is rebuilt from the graph's one output (the "work left" flags) and the phase's
cost, which is the same at every step of a phase.

A recording is used only where calling the graph is exactly what dynamo's frame would do:

* the step's frame made one graph call whose only output is the flags the step returned (no tensor that dynamo
  would store on a Python object after the graph, which a direct call would skip);
* every tensor the graph reads is still a buffer of the generation or a tensor of the model
  (:meth:`PhaseTable.keep_valid`, checked on the host before every block; a stage that allocates a buffer at a
  block start, or weights assigned by hand, drop the recordings that read the old ones, and the next step of
  those phases goes through dynamo again and is recorded anew).

Python side effects inside a step (a counter kept in a Python attribute) would be skipped by a direct call, as by a
CUDA-graph replay; a step has none by the step rules of :mod:`polestar.step`, and ``tests/test_step_capture.py``
decodes every registered policy with its steps called by key and compares tokens and counters with eager
decoding (``tests/test_phase_table.py``: what is recorded, stale recordings).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

import attrs
import torch


class _Sink(threading.local):
    """Per thread: the graph calls of the step being recorded (:func:`recording`), else None."""

    calls: list[tuple[Callable, tuple, Any]] | None = None


_SINK = _Sink()


class RecordingBackend:
    """A ``torch.compile`` backend that compiles with ``backend`` and hands each call of a compiled graph to
    :func:`recording` while one is open: ``(graph, inputs, outputs)``, the graph as dynamo calls it (the
    backend's compiled callable) and the tensors dynamo passed it. Outside :func:`recording` the graph is called
    as it is. ``compiler_name``: the wrapped backend's (dynamo reports and checks it)."""

    def __init__(self, backend: Callable, name: str | None = None) -> None:
        self.backend = backend
        self.compiler_name = name or getattr(backend, "compiler_name", None) or getattr(backend, "__name__", "custom")

    def __call__(self, gm: torch.fx.GraphModule, example_inputs) -> Callable:
        graph = self.backend(gm, example_inputs)

        def run(*args):
            out = graph(*args)
            if _SINK.calls is not None:
                _SINK.calls.append((graph, args, out))
            return out

        return run

    def reset(self) -> None:
        """dynamo's reset hook, passed on to the wrapped backend."""
        if hasattr(self.backend, "reset"):
            self.backend.reset()


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[Callable, tuple, Any]]]:
    """Collect the graph calls of :class:`RecordingBackend` graphs made inside the block, as
    ``(graph, inputs, outputs)`` (the caller reads them right after the step; calls made by other threads are not
    collected)."""
    outer, _SINK.calls = _SINK.calls, []
    try:
        yield _SINK.calls
    finally:
        _SINK.calls = outer


@attrs.frozen
class CompiledPhase:
    """One phase's compiled graph bound to one generation's tensors: ``graph(*inputs)`` runs the step, and its one
    output is the step's "work left" flags ``[num_blocks + F]``; ``cost``: the step's cost (the same at every step
    of the phase)."""

    graph: Callable
    inputs: tuple
    cost: Any

    def __call__(self) -> torch.Tensor:
        """Run the step; → its "work left" flags."""
        return self.graph(*self.inputs)[0]


def bind_phase(calls: list[tuple[Callable, tuple, Any]], work: torch.Tensor, cost) -> CompiledPhase | None:
    """The :class:`CompiledPhase` of a step whose frame made the graph ``calls`` and returned the flags ``work``,
    or None when calling its graph directly would not be the same step: not exactly one graph call, or an output
    besides ``work`` (a tensor dynamo would store on a Python object)."""
    if len(calls) != 1:
        return None
    graph, inputs, outputs = calls[0]
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    if len(outputs) != 1 or outputs[0] is not work:
        return None
    if not all(isinstance(t, torch.Tensor) for t in inputs):  # an int or float input would vary by step
        return None
    return CompiledPhase(graph, tuple(inputs), cost)


@attrs.define
class PhaseTable:
    """A generation's compiled phases (:class:`CompiledPhase`), by key (the compiled step and the
    :class:`~polestar.state.StepPhase`): looked up at every compiled step after the phase's first. ``refused``:
    keys whose step cannot be called directly (:func:`bind_phase`), which go through dynamo at every step."""

    entries: dict[Hashable, CompiledPhase] = attrs.field(factory=dict)
    refused: set = attrs.field(factory=set)

    def get(self, key: Hashable) -> CompiledPhase | None:
        return self.entries.get(key)

    def record(self, key: Hashable, phase: CompiledPhase | None) -> None:
        """Store what :func:`bind_phase` made of a phase's step (None: refused)."""
        if phase is None:
            self.refused.add(key)
        else:
            self.entries[key] = phase

    def wants(self, key: Hashable) -> bool:
        """Whether a step of ``key`` should be recorded: not bound yet and not refused."""
        return key not in self.entries and key not in self.refused

    def keep_valid(self, tensors: Iterable[torch.Tensor]) -> int:
        """Drop the entries that read a tensor not in ``tensors`` (the generation's buffers and the model's tensors
        now: a buffer a block start replaced, a weight assigned by hand) → how many were dropped. The entries hold
        their inputs, so an id here is never a freed tensor's."""
        live = {id(t) for t in tensors}
        stale = [key for key, phase in self.entries.items() if not all(id(t) in live for t in phase.inputs)]
        for key in stale:
            del self.entries[key]
        return len(stale)

    def clear(self) -> None:
        self.entries.clear()
        self.refused.clear()
