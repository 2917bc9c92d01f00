"""The rules a compiled step must follow to be replayed as a CUDA graph, checked on any device.

On CUDA, ``torch.compile(mode="reduce-overhead")`` records each graph once and replays it (cudagraph trees). It
replays only a graph whose mutated inputs are all static addresses (parameters, buffers, tensors marked with
``torch._dynamo.mark_static_address``), it keeps one recording per distinct value of every int graph input, and a
replay overwrites the outputs of the previous one. :class:`GraphProbe` is a ``torch.compile`` backend that gives
each graph dynamo captured to AOT autograd's analysis pass, the one inductor's compile starts with (functionalization
over fake tensors: which inputs each graph mutates and which have static addresses, the metadata cudagraph trees
decide by), generates no code, runs dynamo's graph eagerly, and records per graph:

* the inputs it mutates and which of them are static (:attr:`GraphReport.mutated_not_static`: must be empty);
* the int and SymInt inputs (:attr:`GraphReport.int_inputs`: must be empty);
* the inputs that share memory at its first call (:attr:`GraphReport.aliased`: must be empty);

and, with ``poison=True``, overwrites every tensor a call returned as soon as the next call has run (NaN, an
out-of-range index, flipped booleans), as the next replay of a CUDA graph would: a decoder that still reads an
earlier step's output then gives other tokens or fails.

Use it as the backend of the layer regions, ``StepRunner(GraphProbe(), device, pipeline)``, or through
``polestar.testing``.

AOT autograd's second pass (tracing the functionalized graph that inductor lowers) adds nothing to these checks and
takes about two thirds of AOT's time; ``GraphProbe(aot_graph=True)`` runs it anyway and executes that graph instead
of dynamo's (the reports are the same). A torch whose AOT internals differ from the ones the analysis-only route
calls gets the full route, with the same reports.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import NamedTuple

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func


class GraphReport(NamedTuple):
    """One compiled graph as a CUDA graph would see it: ``name`` (``graph 0``, ``graph 1``, ... in compile order);
    ``inputs``: the graph's input names (parameters, then dynamo's sources); ``mutated``: inputs it writes;
    ``static``: inputs with static addresses; ``int_inputs``: int or SymInt inputs."""

    name: str
    inputs: tuple[str, ...]
    mutated: tuple[str, ...]
    static: tuple[str, ...]
    int_inputs: tuple[str, ...]
    #: pairs of inputs that share memory at the graph's first call (AOT autograd then merges them into a synthetic
    #: base, and a CUDA graph replays their writes in an order the graph did not say)
    aliased: tuple[tuple[str, str], ...] = ()

    @property
    def mutated_not_static(self) -> tuple[str, ...]:
        """Mutated inputs without a static address (any one makes cudagraph trees skip the graph)."""
        static = set(self.static)
        return tuple(name for name in self.mutated if name not in static)

    def problems(self) -> list[str]:
        """What would keep this graph from being replayed as a CUDA graph, one line each (empty: nothing)."""
        out = []
        if self.mutated_not_static:
            out.append(f"{self.name}: mutates inputs without a static address: {', '.join(self.mutated_not_static)}")
        if self.int_inputs:
            out.append(f"{self.name}: int inputs (one CUDA graph per value): {', '.join(self.int_inputs)}")
        if self.aliased:
            pairs = ", ".join(f"{a} ~ {b}" for a, b in self.aliased)
            out.append(f"{self.name}: inputs that share memory: {pairs}")
        return out


class GraphProbe:
    """A ``torch.compile`` backend (dynamo + AOT autograd's analysis, no code generation) that reports every graph
    it is given as a :class:`GraphReport` in :attr:`graphs` and, with ``poison``, overwrites each call's outputs once
    the next call has run (see the module docstring). ``aot_graph``: also trace AOT's functionalized graph and run
    it (slower; same reports). ``calls``: how many times compiled graphs ran."""

    def __init__(self, poison: bool = False, aot_graph: bool = False):
        self.poison = poison
        self.aot_graph = aot_graph
        self.graphs: list[GraphReport] = []
        self.calls = 0
        self._pending: list[torch.Tensor] = []

    def problems(self) -> list[str]:
        """Every graph's :meth:`GraphReport.problems`."""
        return [p for g in self.graphs for p in g.problems()]

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        name = f"graph {len(self.graphs)}"
        sources = [_source_name(node) for node in gm.graph.find_nodes(op="placeholder")]
        ints = tuple(src for src, x in zip(sources, example_inputs) if isinstance(x, (int, torch.SymInt)))

        def report(meta) -> None:
            n_lifted = len(meta.input_info) - len(sources)
            names = [f"parameter {i}" for i in range(n_lifted)] + sources
            mutated = tuple(names[i] for i, info in enumerate(meta.input_info) if info.mutates_data
                            or info.mutates_metadata)
            static = tuple(names[i] for i in sorted(set(meta.static_input_indices or ())))
            self.graphs.append(GraphReport(name, tuple(names), mutated, static, ints))

        meta = None if self.aot_graph else aot_input_metadata(gm, example_inputs)
        if meta is not None:
            report(meta)
            compiled = gm.forward
        else:
            def inspect(fx_gm: torch.fx.GraphModule, inputs):
                report(torch._guards.TracingContext.get().fw_metadata)
                return make_boxed_func(fx_gm.forward)

            compiled = aot_autograd(fw_compiler=inspect)(gm, example_inputs)

        index = len(self.graphs) - 1
        checked = []

        def run(*args):
            if not checked:  # the graph's inputs as it is called (parameters lifted by AOT are not among them)
                checked.append(True)
                self.graphs[index] = self.graphs[index]._replace(aliased=_aliased(sources, args))
            out = compiled(*args)
            self.calls += 1
            if self.poison:
                self._poison_pending()
                self._pending = _owned_outputs(out, args)
            return out

        return run

    def _poison_pending(self) -> None:
        for t in self._pending:
            poison_(t)
        self._pending = []


def aot_input_metadata(gm: torch.fx.GraphModule, example_inputs):
    """AOT autograd's analysis of ``gm`` (its ``ViewAndMutationMeta``: per input, whether the graph mutates its data
    or metadata, and the static input indices), from the analysis pass alone, with the inputs laid out as inductor's
    compile lays them out (lifted parameters first). ``None`` where this torch's AOT internals differ from the ones
    called here (the caller then takes the full route)."""
    try:
        prepare, create_state, meta_type = _aot_internals()
        with contextlib.ExitStack() as stack:
            # torch 2.11 takes a ``boxed_forward_device_index`` between these; later versions do not
            named = dict(kwargs=None, decompositions=None, keep_inference_input_mutations=False,
                         ignore_shape_env=False, flatten=False)
            if "boxed_forward_device_index" in inspect.signature(prepare).parameters:
                named["boxed_forward_device_index"] = None
            prepared = prepare(gm, example_inputs, **named)
            functional_call, _, _, _, fake_flat_args, descs, aot_config, fake_mode, shape_env = prepared[:9]
            meta = create_state(stack, functional_call, fake_flat_args, descs, aot_config, fake_mode,
                                shape_env).fw_metadata
    except (ImportError, TypeError, ValueError, AttributeError):
        return None
    if not isinstance(meta, meta_type) or len(meta.input_info) != len(fake_flat_args):
        return None
    return meta


def _aot_internals():
    """AOT autograd's input preparation, its analysis pass and the type of the analysis' result (torch 2.11 to
    2.14's layout)."""
    from torch._functorch._aot_autograd.schemas import ViewAndMutationMeta
    from torch._functorch.aot_autograd import create_aot_state, prepare_aot_module_simplified

    return prepare_aot_module_simplified, create_aot_state, ViewAndMutationMeta


def poison_(t: torch.Tensor) -> None:
    """Overwrite ``t`` in place with values no decoder should read: NaN for floats, an out-of-range index for
    integers, the opposite for booleans."""
    with torch.no_grad():
        if t.dtype == torch.bool:
            t.logical_not_()
        elif t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        else:
            t.fill_(torch.iinfo(t.dtype).max // 2)


def _owned_outputs(out, args) -> list[torch.Tensor]:
    """The tensors among a graph's outputs that own their memory: not an input nor a view of one (cudagraph trees
    hand inputs and their views back as they are; only the graph's own outputs are overwritten by a replay)."""
    inputs = {_storage(a) for a in args if isinstance(a, torch.Tensor)}
    flat = out if isinstance(out, (list, tuple)) else [out]
    owned, seen = [], set()
    for t in flat:
        if isinstance(t, torch.Tensor) and _storage(t) not in inputs and _storage(t) not in seen:
            seen.add(_storage(t))
            owned.append(t)
    return owned


def _aliased(names: list[str], args) -> tuple[tuple[str, str], ...]:
    """Pairs of ``args`` (named by ``names``) that are tensors sharing one storage."""
    first: dict[int, str] = {}
    pairs = []
    for name, arg in zip(names, args):
        if isinstance(arg, torch.Tensor) and arg.untyped_storage().nbytes():
            key = arg.untyped_storage().data_ptr()
            if key in first:
                pairs.append((first[key], name))
            else:
                first[key] = name
    return tuple(pairs)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.untyped_storage().nbytes() else id(t)


def _source_name(node: torch.fx.Node) -> str:
    source = getattr(node, "_dynamo_source", None)
    return source.name if source is not None else node.name
