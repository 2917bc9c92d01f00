"""One decoding step as one function of the generation's persistent buffers (gpt-fast's ``decode_one_token``).

:func:`run_step` runs everything a step does: the refresh selector's plan and sparse-update hook (Polestar's
block-start clustering and stores included), the plan's forward with the update packet and the attention probe
riding along, prediction, the commit rule, the engine's progress guarantee, suffix-block commits, EOS bookkeeping,
the counters and the per-block "work left" flags the loop reads. It reads nothing back to the host.

How a step runs is one rule on every device (:class:`StepRunner`): the model work of each layer goes through the
layer regions (:mod:`polestar.models.layer_regions`, pure functions of one layer's tensors), compiled once
with ``compile=True`` and called at every layer; on CUDA the whole step, stages and compiled regions included, is
captured as one CUDA graph per step phase and replayed (:mod:`polestar.step_graphs`).

What a CUDA graph needs, by construction:

* **Its inputs are the generation's persistent buffers**, given as one explicit structure (:class:`StepInputs`:
  tokens, cache, stores, each stage's state tensors, counters, the step counters as 0-d device tensors), allocated
  once per shape and reused by the next generation of that shape (:func:`polestar.engine.acquire_generation`). The
  step writes them in place (``copy_``, ``index_copy_``, ``scatter_``); no Python attribute is rebound to a tensor
  the step computed, so nothing one step returns is read after the next one ran.
* **No Python value that changes from step to step enters the step** except the :class:`~polestar.state.StepPhase`,
  which the stages derive on the host from the loop's position and which selects the step's shapes (a block start,
  a window refresh, a sparse-update step, a plain step, the last block's narrower window): one graph per phase.
  Block and step positions are device scalars (:class:`~polestar.state.StepClock`), and slices at them are index
  operations.
* **The step returns only what the loop reads**: the "work left" flags (the loop's one host read) and the step's
  cost in plain ints; while an observer records, also a :class:`StepView` that the loop copies before the next step.

Random numbers (Gumbel noise, random remasking, k-means seeds) are drawn before the step from the generation's
``torch.Generator`` into preallocated buffers (:meth:`Generation.draw`), so every route consumes the same random
stream.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import NamedTuple

import attrs
import torch

from polestar.models import layer_regions
from polestar.models.backbone import AttentionProbe, DiffusionLM
from polestar.models.cost import CostMeter, StepCost
from polestar.models.plan import DecodeCache, Plan

from . import compile_off
from .config import GenerationConfig
from .policy import Pipeline
from .profiling import scope
from .state import (
    CommitOrigins,
    DecodeState,
    Prediction,
    StepDetail,
    StepPhase,
    UpdatePacket,
    propose_from,
    revocations,
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
    decoded the row), ``evals`` long (the row's own token-layer evaluations), ``revoked`` long (committed tokens
    the commit rule took back, :func:`~polestar.state.revocations`)."""

    finished: torch.Tensor
    failed_at: torch.Tensor
    nfe: torch.Tensor
    evals: torch.Tensor
    revoked: torch.Tensor

    @classmethod
    def zeros(cls, batch: int, device) -> Totals:
        z = torch.zeros(batch, dtype=torch.long, device=device)
        return cls(z.bool(), z - 1, z.clone(), z.clone(), z.clone())

    def reset(self) -> None:
        """Back to :meth:`zeros`, in place."""
        self.finished.fill_(False)
        self.failed_at.fill_(-1)
        self.nfe.zero_()
        self.evals.zero_()
        self.revoked.zero_()


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
    static addresses. An observer's :class:`~polestar.state.StepDetail` is not among them: it holds what a step
    gathered for the observer (outputs), not buffers a step reads."""
    seen: set[int] = set()
    out: list[torch.Tensor] = []

    def walk(obj) -> None:
        if isinstance(obj, torch.Tensor):
            if id(obj) not in seen:
                seen.add(id(obj))
                out.append(obj)
            return
        if obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.nn.Module, torch.Generator,
                                           torch.dtype, torch.device, StepDetail)) or id(obj) in seen:
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
        verified = commit.verify(state, cache, model, commit_local)  # the rule's own pass (WINO's shadow block)
        if verified is not None:  # its rows count for every row it decoded, as the forward's do
            cost = StepCost(*(a + b for a, b in zip(cost, verified)))
            totals.evals.add_(state.active.long() * (verified.layer_rows // state.batch_size))
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
    revoked = revocations(chosen.revoke, masked, transfer, state)
    state.last_commits.copy_(transfer.sum(dim=1))
    cols = state.block_columns()
    seen_cols = cols.clone() if state.detail is not None else None  # the region moves in place below
    block_x = state.x.gather(1, cols)
    if revoked is not None:  # taken back: the mask token again, counted beside the commits
        block_x = block_x.masked_fill(revoked, spec.mask_id)
        totals.revoked.add_(revoked.sum(dim=1))
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
                        CommitOrigins(rule_transfer, forced, chosen.early, chosen.gate_candidates, extra, revoked),
                        seen_cols,
                        torch.zeros_like(stepped) if held is None else held)
    return StepOutput(work, cost, view)


def pipeline_compilable(pipeline: Pipeline) -> bool:
    """Whether every stage of ``pipeline`` can run inside a compiled step (a stage that cannot, such as the
    ``cpu`` offloader with its host buffers, declares ``compilable = False``)."""
    return all(getattr(stage, "compilable", True) for stage in pipeline.stages.values())


#: what ``compile=True`` compiles the layer regions with
DEFAULT_BACKEND = "inductor"

#: inductor options of the layer regions on every device: a bf16 / fp16 intermediate is rounded to its dtype after
#: each operation, as eager rounds it (inductor otherwise keeps a fused kernel's intermediates in fp32: other last
#: bits, and a near-tie decision such as dLLM-Cache's value pick flips; fp32 code is unchanged by it)
_INDUCTOR_OPTIONS = {"emulate_precision_casts": True}
#: inductor options of the layer regions on a CPU: also without the checks of every extern kernel's output sizes,
#: strides and alignment (debug checks that cost a call each). On CUDA :data:`_INDUCTOR_OPTIONS` alone (the step
#: around the regions is captured as a CUDA graph by :class:`~polestar.step_graphs.StepGraphs`)
_CPU_INDUCTOR_OPTIONS = {**_INDUCTOR_OPTIONS, "size_asserts": False, "scalar_asserts": False,
                         "alignment_asserts": False}


def region_backend(compile: bool | str | Callable) -> str | Callable | None:
    """The ``torch.compile`` backend that a runner's ``compile`` argument compiles the layer regions with: None for
    ``False`` (eager regions), :data:`DEFAULT_BACKEND` for ``True`` (and ``"layers"``, :data:`LAYERS`), else the
    backend as given (a registered name such as ``"aot_eager"``, or a backend callable such as
    :class:`polestar.graph_rules.GraphProbe`); an unknown name is a ``ValueError`` naming the known ones."""
    if compile is False or compile is None:
        return None
    if compile is True or compile == LAYERS:
        return DEFAULT_BACKEND
    if isinstance(compile, str):
        known = torch._dynamo.list_backends(exclude_tags=()) + ["inductor"]
        if compile not in known:
            raise ValueError(f"compile={compile!r} is not a torch.compile backend; use compile=True (inductor), "
                             f"False, or one of {', '.join(sorted(set(known)))}")
        return compile
    if callable(compile):
        return compile
    raise TypeError(f"compile must be a bool, a torch.compile backend name or a backend callable, not {compile!r}")


#: what an earlier version called compiling the layer regions on their own: now what ``compile=True`` means
#: everywhere, kept as a name for scripts that pass it
LAYERS = "layers"


def _region_options(device: torch.device, backend) -> dict | None:
    """Inductor options of the regions: :data:`_CPU_INDUCTOR_OPTIONS` for inductor on a CPU,
    :data:`_INDUCTOR_OPTIONS` for inductor on CUDA, else None."""
    if backend != "inductor":
        return None
    return _CPU_INDUCTOR_OPTIONS if device.type != "cuda" else _INDUCTOR_OPTIONS


class StepRunner:
    """Runs :func:`decode_step`, and counts how each step ran. One route on every device:

    * the step is :func:`run_step`, plain Python over the generation's persistent buffers; its model work goes through
      the layer regions (:mod:`polestar.models.layer_regions`), pure functions of one layer's tensors;
    * ``compile`` (``True``, a backend name or a backend callable, :func:`region_backend`) compiles each region once
      with ``torch.compile(fullgraph=True)`` (a size that changes between calls becomes symbolic at its second value, so
      new prompt lengths and batch sizes do not recompile) and calls the compiled region at every layer, so
      compile time does not grow with depth; ``False`` runs the regions as plain functions;
    * on CUDA each step phase is captured as one CUDA graph and replayed (:class:`~polestar.step_graphs.StepGraphs`;
      ``graphs`` overrides this, see :func:`_step_graphs`): the step's glue, the stages and the compiled regions are
      one replay, with no Python and no launches per op. A stage that declares ``compilable = False`` (the ``cpu``
      offloader, whose host copies cannot be captured) turns the capture off (one line says why,
      :mod:`polestar.compile_off`); the regions still compile.

    The stages always run as Python in the step (never traced by dynamo), so a stage from outside the package takes the
    same route as a built-in one and its contract checks (:mod:`polestar.contracts`) see its outputs in every step
    that is not a replay. ``eager_steps`` / ``compiled_steps``: steps run with plain and with compiled regions.
    """

    def __init__(self, compile: bool | str | Callable, device: torch.device, pipeline: Pipeline, graphs=None):
        self.device = torch.device(device)
        backend = region_backend(compile)
        self.backend = backend
        #: the compiled layer regions (None: plain functions)
        self.regions = None if backend is None else layer_regions.compiled(
            backend, options=_region_options(self.device, backend))
        self.graphs = _step_graphs(graphs, self.device)
        if self.graphs is not None and not pipeline_compilable(pipeline):
            compile_off.report(compile_off.declared(pipeline))
            self.graphs = None
        self.eager_steps = 0
        self.compiled_steps = 0
        self._active = False

    def begin_block(self, gen: Generation) -> None:
        """Host-side preparation before a block's first step: drop the captured graphs that read a tensor the
        generation or the model no longer holds (a block start may allocate buffers, e.g. a new window size;
        :meth:`polestar.step_graphs.StepGraphs.keep_valid`)."""
        if self.graphs is not None:
            self.graphs.keep_valid(gen)

    @contextlib.contextmanager
    def running(self):
        """Hold the compile settings (:func:`_compile_settings`) and the compiled regions for a run of steps: a
        generation enters them once, not per step."""
        if self.regions is None or self._active:
            yield
            return
        with _compile_settings(), layer_regions.using(self.regions):
            self._active = True
            try:
                yield
            finally:
                self._active = False

    def __call__(self, gen: Generation, phase: StepPhase) -> StepOutput:
        gen.draw()
        gen.state.phase = phase
        if self.regions is None:
            self.eager_steps += 1
        else:
            self.compiled_steps += 1
        with self.running():
            if self.graphs is not None:  # an observer's step too: its view and detail are outputs of its graph
                return self.graphs(gen)
            return decode_step(gen)


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
    """A region is compiled for the first shape it meets and again, with the sizes that changed symbolic, at the
    second (dynamo's automatic dynamic shapes): a bench over prompts of many lengths compiles each region about
    twice, not once per length. Floats (a stage option) stay constants. Dynamo keeps its cache entries on the
    region's code, shared by every backend and policy of the process, so the limits are raised from dynamo's
    defaults (8 per code object, 256 in all): a region past the limit would stop compiling."""
    with torch._dynamo.config.patch(recompile_limit=512, accumulated_recompile_limit=8192,
                                    automatic_dynamic_shapes=True, specialize_float=True):
        yield
