"""Commit anatomy: where a policy's commits come from, and how confident the model was when they were made.

An adaptive commit rule (Polestar's drift-delta early commit, EB-sampler, KLASS) can only raise tokens per forward
above Fast-dLLM's threshold rule by committing tokens whose confidence is *below* the threshold τ. How many such
candidates a model offers is a property of the model and task, not of the rule. This tool decodes a task with a
policy, observes every step through :class:`CommitRecorder` (an ``on_step`` observer: the engine's typed
:class:`~polestar.state.StepRecord` carries the commit origins the rule and the engine report, so nothing is
re-derived here), and counts, over every (row, step) of the current block:

* the masked candidates by confidence bin: ``< 0.5``, ``0.5 – lower``, ``lower – τ`` (the early-commit band;
  ``lower`` is the rule's ``min_confidence``, 0.7 when it has none) and ``≥ τ``;
* the commits by origin: confidence ≥ τ, the row's top-1 below τ (the "always commit one" fallback), other
  commits below τ (what the adaptive rule adds), and suffix-block commits after the block;
* for Polestar-Commit, band candidates that had a drift delta and those whose delta passed the gate
  ``alpha (τ − c)²``;
* for each commit origin, how many of its committed tokens equal the reference answer's token at that position
  (the task's canonical answer followed by the EOS fill): the precision of each kind of commit. A wrong token can
  still give a correct final answer only where the task accepts several answers (not arith or sudoku).

It reads tensors back to the host every step, so it is a diagnostic, not a way to time a policy. Command line:
``polestar anatomy --model tiny-llada --task arith --policies fast-dllm,polestar --n 100``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

import polestar
from polestar.config import GenerationConfig
from polestar.policies.commit_adaptive import PolestarCommit
from polestar.tasks import get_task

from .harness import bench_entry, decode_batch, entry_overrides, load_problems, policy_label, summarize

BIN_LABELS = ("<0.5", "0.5-lower", "band", ">=tau")
COMMIT_LABELS = ("confident", "top1_below_tau", "other_below_tau", "suffix")


class CommitRecorder:
    """A ``decode(..., on_step=...)`` observer that counts candidates and commits (see the module docstring) from
    each :class:`~polestar.state.StepRecord`; ``counts`` holds plain ints.

    ``tau``: the threshold τ of the confidence bins; ``lower``: the lower edge of the early-commit band. Shapes:
    ``record.confidence``/``record.masked`` ``[B, bl]``; commit origins ``[B, bl]``; suffix commits ``[B, N]``.
    """

    def __init__(self, tau: float = 0.9, lower: float = 0.7):
        if not 0.5 <= lower <= tau:
            raise ValueError(f"need 0.5 <= lower ({lower}) <= threshold ({tau})")
        self.tau, self.lower = float(tau), float(lower)
        self.counts: Counter[str] = Counter()
        #: ``[B, G]`` reference tokens of the generation region for the batch being decoded, or None
        self.reference: torch.Tensor | None = None

    @classmethod
    def for_rule(cls, rule: Any) -> CommitRecorder:
        """Bins at the rule's ``threshold`` (0.9 when it has none) and ``min_confidence`` (0.7 when none)."""
        cfg = rule.config
        return cls(getattr(cfg, "threshold", 0.9), getattr(cfg, "min_confidence", 0.7))

    def __call__(self, record) -> None:
        conf, live = record.confidence, record.masked
        origins = record.origins
        c = self.counts
        c["row_steps"] += int(live.any(dim=1).sum())
        c["candidates"] += int(live.sum())
        for label, lo, hi in zip(BIN_LABELS, (0.0, 0.5, self.lower, self.tau), (0.5, self.lower, self.tau, 2.0)):
            c[label] += int((live & (conf >= lo) & (conf < hi)).sum())
        top1 = torch.zeros_like(live).scatter_(1, conf.argmax(dim=1, keepdim=True), True) & live
        taken = origins.block & live
        below = taken & (conf < self.tau)
        c["confident"] += int((taken & (conf >= self.tau)).sum())
        c["top1_below_tau"] += int((below & top1).sum())
        c["other_below_tau"] += int((below & ~top1).sum())
        if origins.gate_candidates is not None:  # Polestar-Commit's drift-delta gate was evaluated
            c["band_with_delta"] += int(origins.gate_candidates.sum())
            c["delta_passed_gate"] += int(origins.early.sum())
        if origins.suffix is not None:
            c["suffix"] += int(origins.suffix.commit.sum())
        if self.reference is not None:
            self._count_right(record, taken, below, top1)

    def _count_right(self, record, taken: torch.Tensor, below: torch.Tensor, top1: torch.Tensor) -> None:
        """Commits of this step that equal :attr:`reference`, per origin (``right_<origin>``)."""
        ref = self.reference
        P = record.tokens_after.shape[1] - ref.shape[1]
        right = record.tokens_after[:, P:] == ref  # [B, G]
        if record.region is None:
            in_block = right[:, record.block_start - P : record.block_end - P]
        else:  # the step's commit region (a sliding window's columns are not a slice)
            in_block = right.gather(1, record.region - P)
        c = self.counts
        c["right_confident"] += int((taken & (record.confidence >= self.tau) & in_block).sum())
        c["right_top1_below_tau"] += int((below & top1 & in_block).sum())
        c["right_other_below_tau"] += int((below & ~top1 & in_block).sum())
        suffix = record.origins.suffix
        if suffix is not None:
            # positions of entries that do not commit may lie in the prompt: clamp them, they are masked out anyway
            at = right.gather(1, (suffix.positions - P).clamp_min(0))
            c["right_suffix"] += int((suffix.commit & at).sum())


def commit_anatomy(model_name: str, task_name: str, policies: list[str], n: int, options: dict[str, Any],
                   decoding: dict[str, Any], batch_size: int = 50, data: str | None = None,
                   dtype: str = "float32", device: str = "cpu") -> dict[str, dict[str, float]]:
    """Decode ``n`` problems of ``task_name`` with each policy and return its commit counts (see module docstring)
    plus ``accuracy`` and ``tpf``; ``options`` are stage options as in ``polestar bench --set``, ``decoding`` the
    keyword arguments of :func:`polestar.generate` as in :func:`~polestar.bench.harness.run_policy`."""
    if batch_size < 1 or n < 1:
        raise ValueError("n and batch_size must be at least 1")
    task = get_task(task_name)
    GenerationConfig(**{k: v for k, v in decoding.items() if k not in ("compile", "on_step")})  # validate first
    pipelines = {name: polestar.assemble(bench_entry(name).policy, entry_overrides(name, options)) for name in policies}
    model = polestar.load(model_name, dtype=dtype, device=device)
    if model.tokenizer is None:
        raise ValueError(f"{model_name} has no tokenizer.json; task prompts and answers need one")
    problems = load_problems(task_name, n, data)
    out: dict[str, dict[str, float]] = {}
    gen_length = decoding.get("gen_length", 64)
    for name, pipeline in pipelines.items():
        recorder = CommitRecorder.for_rule(pipeline.commit)
        records = []
        for start in range(0, len(problems), batch_size):
            chunk = problems[start : start + batch_size]
            recorder.reference = reference_tokens(model, chunk, gen_length)
            records += decode_batch(model, task, chunk, pipeline, {}, {**decoding, "on_step": recorder})[0]
        summary = summarize(records, pipeline.describe())
        labels = ("row_steps", "candidates", *BIN_LABELS, *COMMIT_LABELS, *(f"right_{o}" for o in COMMIT_LABELS))
        row = {label: recorder.counts[label] for label in labels}
        if isinstance(pipeline.commit, PolestarCommit):
            row["band_with_delta"] = recorder.counts["band_with_delta"]
            row["delta_passed_gate"] = recorder.counts["delta_passed_gate"]
        row.update(accuracy=summary["accuracy"], tpf=summary["tpf"], tau=recorder.tau, lower=recorder.lower,
                   label=policy_label(name, options))
        out[name] = row
    return out


def reference_tokens(model, problems, gen_length: int) -> torch.Tensor:
    """``[B, gen_length]`` token ids of each problem's reference answer followed by the EOS fill (the target
    layout of the generation region)."""
    tok, eos = model.tokenizer, model.spec.eos_id
    ref = torch.full((len(problems), gen_length), eos, dtype=torch.long)
    for i, prob in enumerate(problems):
        ids = tok.encode(prob.output, add_special_tokens=False)[:gen_length]
        ref[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return ref.to(model.device)


def format_anatomy(result: dict[str, dict[str, float]], title: str) -> str:
    """A table: candidate shares per confidence bin and commits per origin, one row per policy."""
    width = max([16, *(len(r.get("label", name)) for name, r in result.items())])
    head = (f"{'policy':{width}s} {'acc':>6s} {'TPF':>5s} {'cand.':>7s} {'<0.5':>6s} {'0.5-lo':>6s} {'band':>6s} "
            f"{'>=tau':>6s} {'c>=tau':>7s} {'top1<tau':>8s} {'other<tau':>9s} {'suffix':>6s} {'gate':>9s}")
    lines = [title, head, "-" * len(head)]
    precision = []
    for name, r in result.items():
        name = r.get("label", name)  # the policy with the --set overrides that apply to it
        if "right_confident" in r:
            cells = [f"{o} {r[f'right_{o}']}/{r[o]}" + (f" ({100 * r[f'right_{o}'] / r[o]:.1f}%)" if r[o] else "")
                     for o in COMMIT_LABELS]
            precision.append(f"  {name:{width}s} " + "; ".join(cells))
        cand = max(r["candidates"], 1)
        shares = " ".join(f"{100 * r[b] / cand:5.1f}%" for b in BIN_LABELS)
        gate = f"{r['delta_passed_gate']}/{r['band_with_delta']}" if "band_with_delta" in r else "-"
        lines.append(
            f"{name:{width}s} {100 * r['accuracy']:5.1f}% {r['tpf']:5.2f} {r['candidates']:7d} {shares} "
            f"{r['confident']:7d} {r['top1_below_tau']:8d} {r['other_below_tau']:9d} {r['suffix']:6d} {gate:>9s}"
        )
    if precision:
        lines += ["commits equal to the reference answer's token, per origin:", *precision]
    return "\n".join(lines)
