"""One decoding step as one function of the generation's persistent buffers (gpt-fast's ``decode_one_token``),
compiled whole.

:func:`decode_step` runs everything a step does: the refresh selector's plan and sparse-update hook (Polestar's
block-start clustering and stores included), the plan's forward with the update packet and the attention probe
riding along, prediction, the commit rule, the engine's progress guarantee, suffix-block commits, EOS bookkeeping,
the counters and the per-block "work left" flags the loop reads. It reads nothing back to the host, so with
``compile=True`` it is one ``torch.compile(fullgraph=True)`` graph per step variant, and on CUDA one CUDA-graph
replay per step.

What a CUDA graph needs, by construction:

* **Its inputs are the generation's persistent buffers**, given as one explicit structure (:class:`StepInputs`:
  tokens, cache, stores, each stage's state tensors, counters, the step counters as 0-d device tensors; the step is
  :func:`run_step` of the model, the pipeline and those inputs), allocated once per shape and reused by the
  next generation of that shape (:func:`polestar.engine.acquire_generation`). The step writes them in place
  (``copy_``, ``index_copy_``, ``scatter_``); no Python attribute is rebound to a tensor the step computed, so
  nothing one step returns is read after the next one ran. On CUDA every one of them is a static address
  (:meth:`StepRunner.mark_static`).
* **No Python value that changes from step to step enters the step** except the :class:`~polestar.state.StepPhase`,
  which the stages derive on the host from the loop's position and which selects the step's shapes (a block start,
  a window refresh, a sparse-update step, a plain step, the last block's narrower window): one graph per phase.
  Block and step positions are device scalars (:class:`~polestar.state.StepClock`), and slices at them are index
  operations.
* **After its first step, a phase is called by key**: the whole-step compile records the graph dynamo called and
  the tensors it passed, and later steps of that phase call it directly (:mod:`polestar.phase_table`), so a step
  is selected by its phase, not by evaluating guards over the generation object.
* **The step returns only what the loop reads**: the "work left" flags (the loop's one host read) and the step's
  cost in plain ints; while an observer records, also a :class:`StepView` that the loop copies before the next step.

Random numbers (Gumbel noise, random remasking, k-means seeds) are drawn before the step from the generation's
``torch.Generator`` into preallocated buffers (:meth:`Generation.draw`), so compiled and eager decoding consume the
same random stream.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import types
import weakref
from collections.abc import Callable
from typing import NamedTuple

import attrs
import torch

from polestar.models import layer_regions
from polestar.models.backbone import AttentionProbe, DiffusionLM
from polestar.models.cost import CostMeter, StepCost
from polestar.models.plan import DecodeCache, Plan

from . import compile_off, contracts
from .config import GenerationConfig
from .device_support import fp8_compile_blocker
from .phase_table import PhaseTable, RecordingBackend, bind_phase, recording
from .policy import Pipeline
from .profiling import scope
from .state import (
    CommitOrigins,
    DecodeState,
    Prediction,
    StepPhase,
    UpdatePacket,
    propose_from,
    token_log_probs,
)
from .step_graphs import ReplayTape, StepGraphs


def predict(logits: torch.Tensor, masked: torch.Tensor, temperature: float, noise: torch.Tensor | None,
            mask_id: int) -> Prediction:
    """Proposals for the block (see :func:`polestar.state.propose`): ``logits [B, bl, V]``, ``masked [B, bl]``,
    ``noise [B, bl, V]`` uniform draws or None → :class:`Prediction` with ``-inf`` confidence outside ``masked``."""
    logp = token_log_probs(logits, mask_id)
    tokens, conf = propose_from(logp, temperature, noise=noise)
    return Prediction(tokens, conf.masked_fill(~masked, float("-inf")), logits, logp)


def eos_finished(gen: torch.Tensor, mask_id: int, stop_ids: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose generation ``gen [B, G]`` holds a stop token (EOS, or any id of the LongTensor ``stop_ids [S]``
    on ``gen``'s device, e.g. EOS and end-of-turn) with every earlier position committed. No host sync.

    Returns ``(finished [B] bool, fill [B, G] bool)`` where ``fill`` marks the masked positions after that stop.
    """
    is_eos = gen == stop_ids if isinstance(stop_ids, int) else torch.isin(gen, stop_ids)
    has_eos = is_eos.any(dim=1)
    first = torch.where(has_eos, is_eos.long().argmax(dim=1), gen.shape[1])
    col = torch.arange(gen.shape[1], device=gen.device)[None, :]
    masked = gen == mask_id
    finished = has_eos & ~(masked & (col < first[:, None])).any(dim=1)
    fill = finished[:, None] & masked & (col > first[:, None])
    return finished, fill


def forced_commits(transfer: torch.Tensor, masked: torch.Tensor, confidence: torch.Tensor) -> torch.Tensor:
    """The engine's progress guarantee: in rows with masked positions where the rule chose nothing, the most
    confident masked position. ``transfer, masked [B, bl]`` bool, ``confidence [B, bl]`` → ``[B, bl]`` bool."""
    stalled = masked.any(dim=1) & ~transfer.any(dim=1)
    best = torch.zeros_like(masked).scatter_(1, confidence.argmax(dim=1, keepdim=True), True)
    return stalled[:, None] & best & masked


def own_rows(plan: Plan, cache: DecodeCache, n_layers: int) -> torch.Tensor:
    """``[B]``: the plan slots, summed over the layers, that hold one of the row's own positions (valid, not left
    padding). A sequence's own counters count these, so they do not depend on the batch it was decoded in."""
    key_valid = cache.key_valid
    if not plan.per_layer:
        return (plan.valid & key_valid.gather(1, plan.index)).sum(dim=-1) * n_layers
    per_layer = [plan.at(layer) for layer in range(n_layers)]
    return sum((valid & key_valid.gather(1, index)).sum(dim=-1) for index, valid in per_layer)


def nonfinite_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits [B, bl, V]`` → ``[B]`` bool: rows with a NaN or infinite logit (a broken model or input)."""
    return ~torch.isfinite(logits).all(dim=2).all(dim=1)


def block_forward(model: DiffusionLM, x: torch.Tensor, cache: DecodeCache, plan: Plan, target_slots: torch.Tensor,
                  probe: AttentionProbe | None, hook):
    """Execute ``plan`` (with the optional sparse-update ``hook`` and attention ``probe``): ``target_slots [B, bl]``
    → block logits ``[B, bl, V]``, probe ``[B, H, R, T + 1]`` or None, the update packet's logits ``[B, M, V]`` or
    None (same LM-head pass as the block's) and the pass's :class:`StepCost`."""
    meter = CostMeter()
    out = model.run_plan(x, cache, plan, probe, hook, meter)
    h = out.hidden.gather(1, target_slots[..., None].expand(-1, -1, out.hidden.shape[-1]))
    extra = hook.head_rows if hook is not None else None
    if extra is None:
        return model.logits(h, meter), out.probe, None, meter.result()
    meter.weight(model.final_norm_weight())
    logits = model.logits(torch.cat([h, model.final_norm(extra)], dim=1), meter)
    bl = h.shape[1]
    return logits[:, :bl], out.probe, logits[:, bl:], meter.result()


@attrs.define
class Totals:
    """Per-sequence accumulators of one generation, updated in place by every step (``[B]`` each): ``finished``
    bool, ``failed_at`` long (the step whose logits were non-finite, -1 if none), ``nfe`` long (forwards that
    decoded the row), ``evals`` long (the row's own token-layer evaluations)."""

    finished: torch.Tensor
    failed_at: torch.Tensor
    nfe: torch.Tensor
    evals: torch.Tensor

    @classmethod
    def zeros(cls, batch: int, device) -> Totals:
        z = torch.zeros(batch, dtype=torch.long, device=device)
        return cls(z.bool(), z - 1, z.clone(), z.clone())

    def reset(self) -> None:
        """Back to :meth:`zeros`, in place."""
        self.finished.fill_(False)
        self.failed_at.fill_(-1)
        self.nfe.zero_()
        self.evals.zero_()


@attrs.frozen
class StepInputs:
    """What a step reads and writes besides the model and the stages, as one explicit structure: the decode
    ``state``, the preallocated ``cache``, the refresh selector's and the commit rule's per-generation state objects
    (``refresh_local``, ``commit_local``), the :class:`Totals`, the stop ids ``stops [S]`` and the decoding
    ``config``. Every tensor in it is a persistent buffer (:func:`persistent_tensors`): the step writes them in
    place and the next step reads them at the same addresses."""

    state: DecodeState
    cache: DecodeCache
    refresh_local: object
    commit_local: object
    totals: Totals
    stops: torch.Tensor
    config: GenerationConfig


@attrs.define
class Generation:
    """One generation: the model, the assembled pipeline and the step's :class:`StepInputs` (its buffers and
    settings, also read as ``gen.state``, ``gen.cache``, ``gen.refresh_local``, ``gen.commit_local``,
    ``gen.totals``, ``gen.stops``, ``gen.config``). Every tensor reachable from it but the model's is a persistent
    buffer (:func:`persistent_tensors`)."""

    model: DiffusionLM
    pipeline: Pipeline
    inputs: StepInputs
    pool_key: tuple | None = None
    #: the compiled steps of its phases, called by key after each phase's first (:mod:`polestar.phase_table`)
    phases: PhaseTable = attrs.field(factory=PhaseTable)

    @property
    def state(self) -> DecodeState:
        return self.inputs.state

    @property
    def cache(self) -> DecodeCache:
        return self.inputs.cache

    @property
    def refresh_local(self):
        return self.inputs.refresh_local

    @property
    def commit_local(self):
        return self.inputs.commit_local

    @property
    def totals(self) -> Totals:
        return self.inputs.totals

    @property
    def stops(self) -> torch.Tensor:
        return self.inputs.stops

    @property
    def config(self) -> GenerationConfig:
        return self.inputs.config

    @config.setter
    def config(self, value: GenerationConfig) -> None:
        """New decoding settings for a pooled generation reused with new prompts (its buffers stay)."""
        self.inputs = attrs.evolve(self.inputs, config=value)

    def draw(self) -> None:
        """Draw this step's random numbers from the generation's generator into the state's random buffers
        (outside any compiled region)."""
        state, g = self.state, self.state.generator
        gumbel, remask = state.random
        if gumbel is not None:
            gumbel.copy_(torch.rand(gumbel.shape, generator=g, dtype=torch.float64, device=g.device))
        if remask is not None:
            remask.copy_(torch.rand(remask.shape, generator=g, device=g.device))


def persistent_tensors(gen: Generation) -> list[torch.Tensor]:
    """Every tensor a step of ``gen`` may read or write besides the model's weights: the decode state, the cache,
    the counters, the stop ids and every tensor held by the stages' state objects (attrs fields, lists, dicts,
    tuples and plain objects, walked recursively). These are the step's graph inputs; on CUDA they are marked as
    static addresses."""
    seen: set[int] = set()
    out: list[torch.Tensor] = []

    def walk(obj) -> None:
        if isinstance(obj, torch.Tensor):
            if id(obj) not in seen:
                seen.add(id(obj))
                out.append(obj)
            return
        if obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.nn.Module, torch.Generator,
                                           torch.dtype, torch.device)) or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)
        elif attrs.has(type(obj)):
            for f in attrs.fields(type(obj)):
                walk(getattr(obj, f.name))
        elif hasattr(obj, "__dict__") and not callable(obj):
            for v in vars(obj).values():
                walk(v)

    walk(gen.inputs)
    return out


class StepView(NamedTuple):
    """What an observer sees of one step (returned only while one records; the loop copies it before the next
    step): ``plan``; ``stepped [B]`` rows that decoded; ``masked [B, bl]`` the block's masked positions before the
    commit; ``confidence [B, bl]`` float64; ``origins``: :class:`CommitOrigins`; ``region [B, bl]`` the columns of
    those entries (the block's, or a sliding window's); ``held [B]`` rows whose forward continues at the next step
    (:meth:`~polestar.stages.LayerHook.held`: computed, not committed)."""

    plan: Plan
    stepped: torch.Tensor
    masked: torch.Tensor
    confidence: torch.Tensor
    origins: CommitOrigins
    region: torch.Tensor | None = None
    held: torch.Tensor | None = None


class StepOutput(NamedTuple):
    """What one step hands back to the loop: ``work [num_blocks + F]`` bool, per block whether an unfinished row
    still has masked positions there, then the refresh selector's ``F`` flags for the next step
    (:meth:`~polestar.stages.RefreshSelector.after_step`; the loop's one host read); ``cost``: the forward's
    :class:`StepCost` (plain ints, fixed by the step's shapes); ``view``: a :class:`StepView` while an observer
    records, else None."""

    work: torch.Tensor
    cost: StepCost
    view: StepView | None = None


def region_targets(plan: Plan, state: DecodeState) -> torch.Tensor:
    """``[B, R]`` long: the plan slots whose hidden states predict the region's columns: ``plan.target_offset``
    itself when it is ``[B, R]`` (per-row slots, e.g. a sliding window), else ``target_offset + arange(R)``."""
    offset = plan.target_offset
    if isinstance(offset, torch.Tensor) and offset.dim() == 2:
        return offset
    return (offset + state.block_arange)[None, :].expand(state.batch_size, -1)


def decode_step(gen: Generation) -> StepOutput:
    """One step of the current block of ``gen``: :func:`run_step` on its model, its pipeline and its
    :attr:`~Generation.inputs`."""
    return run_step(gen.model, gen.pipeline, gen.inputs)


def run_step(model: DiffusionLM, pipeline: Pipeline, inputs: StepInputs) -> StepOutput:
    """One step of the current block (see the module docstring), a function of its explicit arguments: reads
    ``inputs.state.phase`` (the step variant) and the persistent buffers of ``inputs`` (:class:`StepInputs`), and
    writes the tokens, the cache, the stages' state, the counters and the step clock in place."""
    state, cache, totals, stops = inputs.state, inputs.cache, inputs.totals, inputs.stops
    refresh_local, commit_local = inputs.refresh_local, inputs.commit_local
    refresh, commit = pipeline.refresh, pipeline.commit
    spec, config, clock = model.spec, inputs.config, state.clock
    plan = refresh.plan(state, cache, refresh_local)
    hook = refresh.hook(state, plan, cache, model, refresh_local)
    if hook is not None and state.detail is not None:  # an observer records: the hook gathers its members too
        hook.detail = state.detail
    probe = commit.probe(state, plan)
    target = region_targets(plan, state)
    with scope("forward"):  # includes the sparse update riding along it (Polestar's clustering, proxies, stores)
        logits, probs, packet_logits, cost = block_forward(model, state.x, cache, plan, target, probe, hook)
    held = hook.held() if hook is not None else None
    if held is not None:  # rows whose forward continues in the next step (decided in this one) commit nothing here
        state.active.logical_and_(~held)
    packet = None
    if packet_logits is not None:
        packet = UpdatePacket(hook.head_positions, hook.head_valid, packet_logits)
    if probs is not None:
        commit.observe_probe(state, probs, commit_local)
    stepped = state.active.clone()
    broken = stepped & nonfinite_rows(logits)
    totals.failed_at.copy_(torch.where(broken, clock.global_step, totals.failed_at))
    totals.finished.logical_or_(broken)
    state.active.logical_and_(~broken)  # a row with non-finite logits commits nothing from here on
    masked = state.block_masked()
    with scope("commit"):
        pred = predict(logits, masked, config.temperature, state.random.gumbel, spec.mask_id)
        chosen = commit.select(pred, masked, state, commit_local)
        transfer = chosen.commit & masked
    forced = forced_commits(transfer, masked, pred.confidence)
    rule_transfer, transfer = transfer, transfer | forced
    state.last_commits.copy_(transfer.sum(dim=1))
    cols = state.block_columns()
    seen_cols = cols.clone() if state.detail is not None else None  # the region moves in place below
    block_x = state.x.gather(1, cols)
    state.x.scatter_(1, cols, torch.where(transfer, pred.tokens, block_x))
    state.schedule.advance(state, transfer, pred.tokens, stops if config.stop_at_eos else None)
    extra = commit.suffix(state, commit_local, packet)
    if extra is not None:
        keep = state.x.gather(1, extra.positions)
        state.x.scatter_(1, extra.positions, torch.where(extra.commit, extra.tokens, keep))
    totals.evals.add_(own_rows(plan, cache, spec.n_layers))
    if hook is not None:
        totals.evals.add_(hook.evals)
    totals.nfe.add_(stepped.long())
    P = state.prompt_len
    if config.stop_at_eos:
        done, fill = eos_finished(state.x[:, P:], spec.mask_id, stops)
        gen_x = state.x[:, P:]
        gen_x.copy_(gen_x.masked_fill(fill, spec.eos_id))
        totals.finished.logical_or_(done)
    state.active.copy_(~totals.finished & state.block_masked_any())
    work = state.schedule.work(state, totals.finished)
    after = refresh.after_step(state, cache, model, refresh_local)
    if after.cost is not None:  # the selector's work for the next step's decisions, after the commits
        cost = StepCost(*(a + b for a, b in zip(cost, after.cost)))
    if after.flags is not None:  # the refresh selector's decisions for the next step ride along the loop's one read
        work = torch.cat([work, after.flags])
    clock.step.add_(1)
    clock.global_step.add_(1)
    view = None
    if state.detail is not None:
        view = StepView(plan, stepped, masked, pred.confidence,
                        CommitOrigins(rule_transfer, forced, chosen.early, chosen.gate_candidates, extra), seen_cols,
                        torch.zeros_like(stepped) if held is None else held)
    return StepOutput(work, cost, view)


def pipeline_compilable(pipeline: Pipeline) -> bool:
    """Whether every stage of ``pipeline`` can run inside a compiled step (a stage that cannot, such as the
    ``cpu`` offloader with its host buffers, declares ``compilable = False``)."""
    return all(getattr(stage, "compilable", True) for stage in pipeline.stages.values())


def pipeline_checked(pipeline: Pipeline) -> bool:
    """Whether a stage of ``pipeline`` has its outputs checked against its kind's contract
    (:func:`polestar.contracts.checked`)."""
    return any(contracts.is_checked(stage) for stage in pipeline.stages.values())


#: what dynamo raises when it cannot trace code (a graph break under ``fullgraph=True``, a branch on a tensor's value,
#: a break inside a nested compile region)
_TRACE_REFUSALS = (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError,
                   torch._dynamo.exc.UncapturedHigherOrderOpError)

#: compiled steps that torch.compile refused to trace (a plugin's; see :meth:`StepRunner._run_compiled`)
_REFUSED: weakref.WeakSet = weakref.WeakSet()

#: compiled steps per model: ``{model: {(composition, backend, cuda_graphs): fn}}``
_COMPILED_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_STEP_COUNT = itertools.count()


def compiled_step(model: DiffusionLM, pipeline: Pipeline, backend: str | Callable, cuda_graphs: bool) -> Callable:
    """The compiled :func:`run_step` for ``model`` and ``pipeline``'s stage composition (names and options), made
    once per process and shared by every generation with them; called as ``fn(model, pipeline, gen.inputs)``.

    Bound once: the model is the same object at every call, so the compiled step keeps no guard on it (nor on
    module globals, the library's functions and torch's, which no caller rebinds while decoding: :func:`step_guards`).
    Its guards are on what varies, the :class:`StepInputs` (buffers' shapes and the decoding settings) and the
    stages' options, which are equal for every pipeline of one composition. Each binding compiles its own copy of the
    function's code: dynamo keeps its graphs and recompile count per code object, so the graphs of one model or policy
    never sit in the guard chain of another, and a session that runs every policy never reaches the recompile limit.
    ``cuda_graphs``: inductor records each graph as a CUDA graph and replays it (``triton.cudagraphs``, what
    ``mode="reduce-overhead"`` sets)."""
    per_model = _COMPILED_STEPS.setdefault(model, {})
    key = (repr(sorted(pipeline.describe().items())), backend, cuda_graphs)
    fn = per_model.get(key)
    if fn is None:
        code = run_step.__code__.replace(co_name=f"run_step_{next(_STEP_COUNT)}")
        step = types.FunctionType(code, run_step.__globals__, code.co_name, run_step.__defaults__,
                                  run_step.__closure__)
        fn = per_model[key] = torch.compile(step, fullgraph=True, backend=_recording_backend(backend, cuda_graphs),
                                            options={"guard_filter_fn": step_guards})
    return fn


def _recording_backend(backend: str | Callable, cuda_graphs: bool) -> RecordingBackend:
    """``backend`` (a name, or a backend callable used as given) wrapped so that the first step of each phase records
    its graph for the phase table (:mod:`polestar.phase_table`). ``"inductor"`` with the step's options: CUDA graphs
    (``triton.cudagraphs``) or :data:`_INDUCTOR_OPTIONS`."""
    if backend == "inductor":
        options = {"triton.cudagraphs": True} if cuda_graphs else _INDUCTOR_OPTIONS
        return RecordingBackend(torch._TorchCompileInductorWrapper(None, options, None))
    if isinstance(backend, str):
        return RecordingBackend(torch._dynamo.lookup_backend(backend), name=backend)
    return RecordingBackend(backend)


#: inductor options of the compiled CPU step: without the checks of every extern kernel's output sizes, strides and
#: alignment (the step's shapes are static). Its wrapper (the code that allocates the buffers and calls the kernels)
#: stays in Python: inductor's C++ wrapper cannot call a nested compile region, and the layer regions
#: (:mod:`polestar.models.layer_regions`) are what keeps the compile from growing with depth (measured in the
#: docs' performance page)
_INDUCTOR_OPTIONS = {"size_asserts": False, "scalar_asserts": False, "alignment_asserts": False}

def step_guards(entries) -> list[bool]:
    """dynamo's ``guard_filter_fn`` of a bound step (:func:`compiled_step`), by the kind of each guard's source:
    drop the guards on the model (an nn.Module source: the binding fixes the model) and on module globals; keep the
    rest (the step's inputs, the stages' options)."""
    return [not (e.is_global or e.orig_guard.source.is_unspecialized_nn_module()) for e in entries]


class StepRunner:
    """Runs :func:`decode_step` eagerly or compiled, and counts how each step ran.

    With ``compile=True`` every step goes through one ``torch.compile(fullgraph=True)`` function (inductor,
    :data:`_INDUCTOR_OPTIONS`; CUDA graphs on CUDA), in which each layer's model work is a nested compile region
    compiled once for every layer (:mod:`polestar.models.layer_regions`); a string names another
    ``torch.compile`` backend (``"eager"`` checks that the step is captured whole without generating code, as the
    tests do; a callable backend such as :class:`polestar.graph_rules.GraphProbe` is used as given). Graphs are one
    per :class:`~polestar.state.StepPhase` a policy meets (a block start, a window refresh, a sparse-update step, a
    plain step, the last block's), not one per block or step.

    ``compile="layers"`` (what ``compile=True`` means on CUDA and on torch < 2.12, :func:`compile_mode`): each
    layer region is
    compiled on its own (:func:`polestar.models.layer_regions.compiled`) and the rest of the step runs eagerly,
    replayed as one CUDA graph per phase on CUDA (:class:`~polestar.step_graphs.StepGraphs`); every step counts as
    compiled, and every stage runs (and is checked) in the eager part.

    Where a whole-step compile is asked for, three things run steps eagerly. A pipeline with a checked stage
    (:func:`pipeline_checked`, a plugin's by default) runs the first step of each phase eagerly, where the stage's
    contract checks read its outputs, and compiles the rest (a compiled step runs the stage unchecked). A stage that
    declares ``compilable = False`` (:func:`pipeline_compilable`) turns compile off for every step; a pipeline with
    a stage from outside the package that ``torch.compile`` cannot trace runs its remaining steps eagerly. Either
    fallback logs one line saying why (:mod:`polestar.compile_off`).

    After the first compiled step of each phase, a whole-step compile calls that phase's graph directly on the
    tensors dynamo passed it (:mod:`polestar.phase_table`): the step is picked by its phase key, with no dynamo
    frame and no guard evaluation (``keyed_steps`` counts them; a step an observer records goes through dynamo).

    ``static_addresses``: mark every persistent buffer of a generation as a static address before its first step
    (:meth:`mark_static`); default: on CUDA, where CUDA graphs need it (tests turn it on elsewhere to apply the
    CUDA rules on a CPU). ``eager_steps`` / ``compiled_steps``: how many steps ran each way.
    """

    def __init__(self, compile: bool | str | Callable, device: torch.device, pipeline: Pipeline,
                 static_addresses: bool | None = None, graphs=None):
        self.device = torch.device(device)
        compile = compile_mode(compile, self.device)
        #: ``compile="layers"``: each layer region compiled on its own, the step's glue eager (graphs on CUDA); a
        #: stage that cannot be compiled runs in the eager glue
        self.regions = layer_regions.compiled(options=_region_options(self.device)) if compile == LAYERS else None
        blocker = compile_off.declared(pipeline) if compile and self.regions is None else None
        if blocker is not None:
            compile_off.report(blocker)
        self.compile = bool(compile) and blocker is None and self.regions is None
        self.eager_steps = 0
        self.compiled_steps = 0
        #: compiled steps that called their phase's recorded graph directly (:mod:`polestar.phase_table`)
        self.keyed_steps = 0
        #: step phases whose checked first step ran (None: no checked stage, or no compile)
        self.checked_phases: set | None = set() if self.compile and pipeline_checked(pipeline) else None
        self.graphs = None if self.compile or not pipeline_compilable(pipeline) else _step_graphs(graphs, self.device)
        self._compiled = None
        self._binding = None
        self._active = False
        self.cuda_graphs = False
        self.static_addresses = self.device.type == "cuda" if static_addresses is None else static_addresses
        if self.compile:
            self.backend = "inductor" if compile is True else compile
            self.cuda_graphs = self.device.type == "cuda" and self.backend == "inductor"
            if self.cuda_graphs and pipeline.describe().get("quant", {}).get("name") == "fp8":
                blocker = fp8_compile_blocker(self.device)  # Triton has no e4m3 before sm_89
                if blocker is not None:
                    raise ValueError(blocker)
            self._compiled = self._bound

    def begin_block(self, gen: Generation) -> None:
        """Host-side preparation before a block's first step (a block start may allocate buffers, e.g. a new window
        size): mark the buffers static (:meth:`mark_static`) and drop the phase-table entries and the captured graphs
        that read a tensor the generation or the model no longer holds (:meth:`polestar.phase_table.PhaseTable.
        keep_valid`, :meth:`polestar.step_graphs.StepGraphs.keep_valid`)."""
        self.mark_static(gen)
        if self.compile and gen.phases.entries:
            gen.phases.keep_valid(step_reads(gen))
        if self.graphs is not None:
            self.graphs.keep_valid(gen)

    def mark_static(self, gen: Generation) -> None:
        """Pin the addresses of every persistent buffer of ``gen`` (:func:`persistent_tensors`) for CUDA graphs:
        they are written in place, never reallocated, and reused by the next generation of the same shape. Unguarded
        (a buffer of another generation re-records the graph; it does not recompile it). Called at every block start
        (a block may allocate buffers); buffers already marked are left as they are."""
        if not self.compile or not self.static_addresses:
            return
        for t in persistent_tensors(gen):
            if getattr(t, "_dynamo_static_input_type", None) is None:
                torch._dynamo.mark_static_address(t, guard=False)

    def _bound(self, gen: Generation) -> Callable:
        """The compiled step bound to ``gen``'s model and pipeline (:func:`compiled_step`; looked up once per model
        and pipeline object)."""
        if self._binding is None or self._binding[0] is not gen.model or self._binding[1] is not gen.pipeline:
            fn = compiled_step(gen.model, gen.pipeline, self.backend, self.cuda_graphs)
            self._binding = (gen.model, gen.pipeline, fn)
        return self._binding[2]

    def _checks_first(self, phase: StepPhase) -> bool:
        """Whether this step runs eagerly so that the checked stages see its outputs: the first of its phase."""
        if self.checked_phases is None or phase in self.checked_phases:
            return False
        self.checked_phases.add(phase)
        return True

    def _eager(self, gen: Generation) -> StepOutput:
        self.eager_steps += 1
        return decode_step(gen)

    def _run_compiled(self, gen: Generation) -> StepOutput | None:
        """The compiled step, or None when ``torch.compile`` cannot trace it for a stage from outside the package
        (:func:`compile_off.refused`): then compile is off for this runner from here on, one line says why, and
        later runners of that binding do not try again (:data:`_REFUSED`). Dynamo stops while tracing, before the
        step ran, so the step can run eagerly instead."""
        fn = self._compiled(gen)
        if fn in _REFUSED:
            return self._compile_off()
        try:
            if self._active:  # inside a generation's `running()`: the settings are in place
                return fn(gen.model, gen.pipeline, gen.inputs)
            with self.running():
                return fn(gen.model, gen.pipeline, gen.inputs)
        except _TRACE_REFUSALS as err:
            reason = compile_off.refused(gen.pipeline, err)
            if reason is None:
                raise
            compile_off.report(reason)
            _REFUSED.add(fn)
            return self._compile_off()

    def _compile_off(self) -> None:
        self._compiled = None
        self.compile = False

    @contextlib.contextmanager
    def running(self):
        """Hold the compile settings (:func:`_compile_settings`) for a run of steps: entering them costs about as
        much as a small compiled step, so a generation enters them once, not per step."""
        if (self._compiled is None and self.regions is None) or self._active:
            yield
            return
        with _compile_settings():
            self._active = True
            try:
                yield
            finally:
                self._active = False

    def __call__(self, gen: Generation, phase: StepPhase) -> StepOutput:
        gen.draw()
        gen.state.phase = phase
        if self.regions is not None:
            self.compiled_steps += 1
            with self.running(), layer_regions.using(self.regions):
                if self.graphs is not None and gen.state.detail is None:
                    return self.graphs(gen)
                return decode_step(gen)
        if self._compiled is None:
            if self.graphs is not None and gen.state.detail is None:  # an observer's step runs eagerly
                return self.graphs(gen)
            return self._eager(gen)
        if self._checks_first(phase):  # a checked stage's outputs are read in this step: it runs eagerly
            return self._eager(gen)
        if self.cuda_graphs:  # nothing a previous replay returned is read any more: its outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        key = (self._compiled(gen), phase)
        bound = gen.phases.get(key) if gen.state.detail is None else None
        if bound is not None:  # the phase's graph, called on the recorded buffers: no dynamo frame, no guards
            self.compiled_steps += 1
            self.keyed_steps += 1
            return StepOutput(bound(), bound.cost)
        record = gen.state.detail is None and gen.phases.wants(key)
        with recording() if record else contextlib.nullcontext() as calls:
            out = self._run_compiled(gen)
        if out is None:  # torch.compile refused a plugin's step
            return self._eager(gen)
        if record:
            gen.phases.record(key, bind_phase(calls, out.work, out.cost))
        self.compiled_steps += 1
        return out


#: ``compile="layers"``: every layer region compiled on its own (:func:`polestar.models.layer_regions.compiled`), the
#: rest of the step run eagerly and, on CUDA, captured whole as one CUDA graph per phase (:class:`StepGraphs`)
LAYERS = "layers"


def compile_mode(compile: bool | str | Callable, device: torch.device | str = "cpu") -> bool | str | Callable:
    """What ``compile`` means on ``device`` with this torch. ``True``: :data:`LAYERS` on CUDA (the step's glue is
    replayed inside one CUDA graph per phase, so a whole-step graph would add compile time, growing with depth,
    for what the replay already gives) and on a torch whose whole-step compile traces every layer's region call
    again (< 2.12, :data:`~polestar.models.layer_regions.NESTED_REGIONS_REUSED`); else a whole-step compile (on a
    CPU nothing replays the glue: a whole-step graph runs it without Python). Anything else is returned as given
    (``"layers"``, a backend name, a backend callable)."""
    if compile is True and (torch.device(device).type == "cuda" or not layer_regions.NESTED_REGIONS_REUSED):
        return LAYERS
    return compile


def _region_options(device: torch.device) -> dict | None:
    """Inductor options of the regions compiled on their own: the CPU step's (:data:`_INDUCTOR_OPTIONS`); on CUDA
    inductor's defaults (the step around them is captured as a CUDA graph by :class:`StepGraphs`)."""
    return None if device.type == "cuda" else _INDUCTOR_OPTIONS


def _step_graphs(graphs, device: torch.device) -> StepGraphs | None:
    """The :class:`~polestar.step_graphs.StepGraphs` an uncompiled runner replays its steps with: ``graphs`` itself
    when given one; None (the default) on CUDA a new one unless ``POLESTAR_EAGER=1`` (truly eager steps, for
    debugging), elsewhere none; False none."""
    if isinstance(graphs, StepGraphs):
        return graphs
    if graphs is None:
        graphs = device.type == "cuda" and os.environ.get("POLESTAR_EAGER", "") != "1"
    return StepGraphs(decode_step, reads=step_reads) if graphs else None


def taped_step_graphs() -> StepGraphs:
    """:class:`~polestar.step_graphs.StepGraphs` whose graphs are :class:`~polestar.step_graphs.ReplayTape` s over
    each generation's persistent buffers: the CUDA capture path, checked on any device
    (``StepRunner(False, device, pipeline, graphs=taped_step_graphs())``)."""
    return StepGraphs(decode_step, graph=lambda gen: ReplayTape(persistent_tensors(gen)), reads=step_reads)


def step_reads(gen: Generation) -> list[torch.Tensor]:
    """Every tensor a step of ``gen`` may read: its persistent buffers (:func:`persistent_tensors`) and its model's
    tensors (:meth:`~polestar.models.backbone.DiffusionLM.step_tensors`)."""
    return [*persistent_tensors(gen), *gen.model.step_tensors()]


@contextlib.contextmanager
def _compile_settings():
    """Everything static: shapes change only with the step's phase, and a stage option (a float threshold, an int
    top-k) that differs between two policies stays a constant of each policy's graph, never a graph input that the
    step would have to read back to the host."""
    with torch._dynamo.config.patch(recompile_limit=64, automatic_dynamic_shapes=False, specialize_float=True):
        yield
