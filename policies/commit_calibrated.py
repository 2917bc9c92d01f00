"""Commit rules that rescore the proposals before the usual selection: the certainty prior of d2Cache and
PC-Sampler's position-aware, frequency-calibrated scores; plus the token-frequency tables PC-Sampler reads.

Both rules score the masked positions of the commit region (``[B, R]``, the current block or a sliding window),
then select as LLaDA does (the step's count from ``steps``, most scored first) or, with ``threshold`` set, every
position whose score is at least ``threshold`` and always the best-scored one (Fast-dLLM's rule on the scores).

Token-frequency tables (PC-Sampler's debiasing) are JSON files in the layout PC-Sampler and d2Cache read:
``{"num_token": N, "p_baseline_dict": {"<token id>": count, ...}}`` (``token_frequency_dict`` is read as well):
a token's frequency is its count over ``N``, and a token the file does not list gets ``1 / N``. A checkpoint
carries its table as ``token_frequency.json`` next to its ``tokenizer.json`` (the shipped tiny checkpoints do:
built from the train split of the task suite with their tokenizer); :func:`build_table` builds one from any
texts with a tokenizer, and ``python -m polestar.policies.commit_calibrated CHECKPOINT`` from the task suite.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

import attrs
import torch
from attrs import validators as v

from polestar.registry import register
from polestar.stages import CommitFloor, CommitRule
from polestar.state import CommitSelection, DecodeState, Prediction
from polestar.tasks.base import EOS_MARKERS

from .certainty import DensityKernel, certainty_density, density_kernel
from .commit_basic import (
    _threshold_validator,
    rank_descending,
    scheduled_count,
    softmax_confidence,
    threshold_transfer,
)

#: the file name a checkpoint directory carries its token-frequency table under
TABLE_FILE = "token_frequency.json"

#: added to a frequency before its logarithm (d2Cache's value; the PC-Sampler paper's code adds 1e-9)
FREQUENCY_EPS = 1e-10


def select_scored(scores: torch.Tensor, masked: torch.Tensor, state: DecodeState,
                  threshold: float | None) -> torch.Tensor:
    """The rules' selection on ``scores [B, R]`` (``-inf`` outside ``masked [B, R]``) → bool ``[B, R]``: with
    ``threshold`` None the step's count of LLaDA's schedule (``state.num_transfer`` at the device step), best
    scored first (ties: leftmost); else every masked position scored ≥ ``threshold`` and each row's best."""
    if threshold is not None:
        return threshold_transfer(scores, masked, threshold)
    return masked & (rank_descending(scores) < scheduled_count(state))


def ranked_confidence(pred: Prediction, mask_in_softmax: bool) -> torch.Tensor:
    """``[B, R]``: the confidence the rules rescore: :attr:`Prediction.confidence` (float64, the mask token
    excluded), or with ``mask_in_softmax`` the proposed token's probability under the softmax of the raw logits
    over the whole vocabulary, mask token included, in the logits' precision and at least fp32 (how Research dLLM's
    ``sample_tokens`` scores them, as :class:`~polestar.policies.commit_basic.TopKCommit` does for dLLM-Cache)."""
    if not mask_in_softmax:
        return pred.confidence
    return softmax_confidence(pred).to(torch.float64)


def _finite_positive(_inst, attribute, value):
    if not (value > 0.0 and math.isfinite(value)):
        raise ValueError(f"{attribute.name} must be a finite number > 0 (the kernel's width in positions), "
                         f"got {value!r}")


# ------------------------------------------------------------------------------------------ certainty prior





@register("commit", "certainty-prior")
class CertaintyPriorCommit(CommitRule):
    """Certainty-prior decoding ("d2Cache: Accelerating Diffusion-Based LLMs via Dual Adaptive Caching"): each
    masked position's confidence is multiplied by the certainty density of the generation -- a Gaussian kernel of
    width ``sigma`` (positions) over the positions already decoded, the prompt side counting as decoded
    (:func:`~polestar.policies.certainty.density_kernel`) -- so decoding grows from what is already certain; the
    scores then go through the usual selection (:func:`select_scored`: LLaDA's count per step, or ``threshold``).

    The density reads only the tokens, so the rule composes with every refresh selector and with sliding-window
    regions (the density is gathered at the region's columns). Floor: with ``threshold``, the density is at most
    1, so a score ≥ ``threshold`` means a confidence ≥ ``threshold`` (the best-scored position of a row exempt);
    without ``threshold`` it has no confidence floor (the count is fixed by the schedule). ``mask_in_softmax``: as
    in :func:`ranked_confidence`. Shapes: confidence and scores ``[B, R]``, decoded flags and density ``[B, G]``
    (``G`` the generation length)."""

    @attrs.frozen
    class Config:
        sigma: float = attrs.field(default=10.0, converter=float, validator=[v.gt(0.0), _finite_positive])
        threshold: float | None = attrs.field(default=None, validator=v.optional(_threshold_validator))
        mask_in_softmax: bool = attrs.field(default=False, validator=v.instance_of(bool))

    def init_state(self, state: DecodeState) -> DensityKernel:
        G = state.length - state.prompt_len
        return density_kernel(G, self.config.sigma, state.x.device)

    def density(self, state: DecodeState, local: DensityKernel) -> torch.Tensor:
        """``[B, G]`` float64: the certainty density at every generation position from the tokens decoded so far."""
        return certainty_density(state.x[:, state.prompt_len:] != state.mask_id, local)

    def select(self, pred: Prediction, masked: torch.Tensor, state: DecodeState,
               local: DensityKernel) -> CommitSelection:
        prior = self.density(state, local).gather(1, state.region - state.prompt_len)
        confidence = ranked_confidence(pred, self.config.mask_in_softmax)
        scores = (confidence * prior).masked_fill(~masked, float("-inf"))
        return CommitSelection(select_scored(scores, masked, state, self.config.threshold))

    def floor(self) -> CommitFloor:
        if self.config.threshold is None:
            return CommitFloor(0.0, 0)
        return CommitFloor(self.config.threshold, 1)


# ------------------------------------------------------------------------------------------ token frequencies


@attrs.frozen
class FrequencyTable:
    """Token counts of a reference corpus: ``counts`` token id → count, ``total`` the corpus's token count (PC-Sampler's
    ``num_token``); ``source`` says where they come from."""

    counts: dict[int, int]
    total: int = attrs.field(validator=v.gt(0))
    source: str = ""

    def frequencies(self, vocab_size: int) -> torch.Tensor:
        """``[vocab_size]`` float64: each token's count over ``total``, ``1 / total`` for tokens never seen; an id
        outside the vocabulary is a ValueError (a table built with another tokenizer)."""
        out = torch.full((vocab_size,), 1.0 / self.total, dtype=torch.float64)
        if self.counts:
            ids = torch.tensor(list(self.counts), dtype=torch.long)
            if int(ids.max()) >= vocab_size or int(ids.min()) < 0:
                raise ValueError(f"the token-frequency table ({self.source or 'given'}) has token id "
                                 f"{int(ids.max())}, outside this model's vocabulary of {vocab_size}: it was built "
                                 "with another tokenizer; build one with this model's (python -m "
                                 "polestar.policies.commit_calibrated --help)")
            out[ids] = torch.tensor(list(self.counts.values()), dtype=torch.float64) / self.total
        return out

    def to_json(self) -> dict:
        """The table in PC-Sampler's layout (``num_token``, ``p_baseline_dict``) plus ``source``."""
        return {"num_token": self.total, "p_baseline_dict": {str(k): c for k, c in sorted(self.counts.items())},
                "source": self.source}


def read_table(path: str | Path) -> FrequencyTable:
    """A :class:`FrequencyTable` from a JSON file in PC-Sampler's layout (see the module docstring)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        counts = data.get("p_baseline_dict", data.get("token_frequency_dict"))
        return FrequencyTable({int(k): int(c) for k, c in counts.items()}, int(data["num_token"]),
                              data.get("source", str(path)))
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        raise ValueError(f"{path}: not a token-frequency table ({type(err).__name__}: {err}); expected JSON "
                         '{"num_token": N, "p_baseline_dict": {"<token id>": count, ...}}') from None


@functools.lru_cache(maxsize=8)
def _log_frequencies(path: str, mtime: float, vocab_size: int) -> torch.Tensor:
    return torch.log(read_table(path).frequencies(vocab_size) + FREQUENCY_EPS)


def build_table(encode: Callable[[str], list[int]], texts: Iterable[str], source: str = "") -> FrequencyTable:
    """Count the tokens of ``texts`` as ``encode`` (a tokenizer's text → ids, no special tokens added) splits
    them: the table PC-Sampler's debiasing reads."""
    counts: Counter[int] = Counter()
    for text in texts:
        counts.update(encode(text))
    return FrequencyTable(dict(counts), sum(counts.values()), source)


def task_corpus(tasks: Iterable[str], per_task: int, seed: int = 0, eos: str = EOS_MARKERS[0]) -> list[str]:
    """Texts of the task suite's train split: ``per_task`` problems of each task, each as the prompt the model reads
    (:meth:`~polestar.tasks.base.Task.format_prompt`, without its right padding) followed by the reference answer
    and one ``eos``."""
    from polestar.tasks import get_task, split

    texts = []
    for name in tasks:
        task = get_task(name)
        texts += [task.format_prompt(p.input).rstrip() + p.output + eos for p in split(task, per_task, "train", seed)]
    return texts


def attach_table(model, table: FrequencyTable | str | Path) -> None:
    """Give ``model`` (a model built in memory, with no checkpoint directory) its token-frequency table: a
    :class:`FrequencyTable` or a table file; :class:`PCSamplerCommit` reads it before the checkpoint's."""
    model.token_frequency = table if isinstance(table, FrequencyTable) else str(table)


def missing_table_message(where: str | None) -> str:
    """The one-line error for ``debias`` without a table (``where``: the checkpoint directory looked in)."""
    looked = f"{where} has no {TABLE_FILE}" if where else "the model was built in memory (no checkpoint directory)"
    return (f"commit rule 'pc-sampler' with debias needs a token-frequency table and {looked}: pass "
            "commit.frequency_table=PATH (JSON {\"num_token\": N, \"p_baseline_dict\": {id: count}}, e.g. "
            f"PC-Sampler's table for LLaDA), put it in the checkpoint as {TABLE_FILE} (build one with python -m "
            "polestar.policies.commit_calibrated CHECKPOINT; a model built in memory takes one with "
            "polestar.policies.commit_calibrated.attach_table), or set commit.debias=false")


# ------------------------------------------------------------------------------------------ PC-Sampler


@attrs.define
class PCSamplerState:
    """Per-generation state of :class:`PCSamplerCommit`, written in place when a generation starts: ``log_freq [V]``
    float64, ``log(frequency + eps)`` of every token of the vocabulary, and ``debias``, a 0-d bool tensor: whether
    this generation debiases (so one compiled step serves both cases)."""

    log_freq: torch.Tensor
    debias: torch.Tensor


def _optional_path(_inst, attribute, value):
    if value is not None and not Path(value).is_file():
        raise ValueError(f"{attribute.name} {value!r} is not a file; pass a token-frequency table (JSON "
                         '{"num_token": N, "p_baseline_dict": {id: count}})')


@register("commit", "pc-sampler")
class PCSamplerCommit(CommitRule):
    """PC-Sampler ("PC-Sampler: Position-Aware Calibration of Decoding Bias in Masked Diffusion Models"): each
    masked position's confidence ``p`` becomes ``min(-p · log(f(x) + eps), clip_alpha) · exp(-position_decay ·
    j)``, with ``f(x)`` the proposed token's frequency in a reference corpus (``debias``: the frequent,
    uninformative tokens -- EOS, separators -- lose their lead) and ``j`` the position's offset from the commit
    region's first column (the block start; a sliding window's first masked column); the scores then go through
    the usual selection (:func:`select_scored`).

    Defaults follow d2Cache's release (debiasing, ``clip_alpha`` 10, no position term); ``position_decay`` is the
    paper's λ (0.25 in its runs, the ``pc-sampler`` evaluation preset). The table: ``frequency_table`` (a file, see
    the module docstring), else the one :func:`attach_table` gave the model, else the checkpoint's
    ``token_frequency.json`` (:meth:`log_frequencies`). ``debias``: True debiases and a missing table is one
    ValueError at the first generation naming the fixes; False never; None (default) debiases every model that has
    a vocabulary -- one loaded from a checkpoint (its missing table is the same error) or given a table -- and
    leaves a model built in memory without a table (random test weights, no corpus to count) undebiased.
    ``mask_in_softmax``: as in :func:`ranked_confidence`.
    It has no confidence floor: scores are not probabilities (a rare token's score can pass a confident common
    one's), so a step may commit any confidence. Shapes: ``[B, R]``."""

    @attrs.frozen
    class Config:
        debias: bool | None = attrs.field(default=None, validator=v.optional(v.instance_of(bool)))
        clip_alpha: float = attrs.field(default=10.0, converter=float, validator=v.gt(0.0))
        position_decay: float = attrs.field(default=0.0, converter=float, validator=[v.ge(0.0), v.lt(math.inf)])
        threshold: float | None = attrs.field(default=None, validator=v.optional(v.ge(0.0)))
        frequency_table: str | None = attrs.field(default=None, validator=_optional_path)
        mask_in_softmax: bool = attrs.field(default=False, validator=v.instance_of(bool))

    def init_state(self, state: DecodeState) -> PCSamplerState:
        device = state.x.device
        return PCSamplerState(torch.zeros(max(state.vocab_size, 1), dtype=torch.float64, device=device),
                              torch.zeros((), dtype=torch.bool, device=device))

    def begin_generation(self, local: PCSamplerState, state: DecodeState, cache, model) -> None:
        """Decide whether this generation debiases (``debias``, see the class docstring) and write the table's
        ``log(f + eps)`` into ``local.log_freq`` (host side, before the first step)."""
        debias = self.config.debias
        if debias is None:
            built_in_memory = getattr(model, "name_or_path", None) is None
            debias = not (built_in_memory and self.config.frequency_table is None
                          and getattr(model, "token_frequency", None) is None)
        local.debias.fill_(debias)
        if debias:
            local.log_freq.copy_(self.log_frequencies(model, local.log_freq.shape[0]))

    def log_frequencies(self, model, vocab_size: int) -> torch.Tensor:
        """``[vocab_size]`` float64 ``log(f + eps)`` of the first table found: ``frequency_table``, the table
        :func:`attach_table` gave the model, the checkpoint's ``token_frequency.json``; none is one ValueError naming
        the fixes."""
        path = self.config.frequency_table
        if path is None:
            carried = getattr(model, "token_frequency", None)
            if isinstance(carried, FrequencyTable):
                return torch.log(carried.frequencies(vocab_size) + FREQUENCY_EPS)
            where = getattr(model, "name_or_path", None)
            candidate = Path(carried) if carried is not None else Path(where) / TABLE_FILE if where else None
            if candidate is None or not candidate.is_file():
                raise ValueError(missing_table_message(where))
            path = str(candidate)
        return _log_frequencies(str(Path(path).resolve()), Path(path).stat().st_mtime, vocab_size)

    def scores(self, pred: Prediction, masked: torch.Tensor, state: DecodeState,
               local: PCSamplerState) -> torch.Tensor:
        """``[B, R]`` float64: the calibrated scores of the masked positions, ``-inf`` elsewhere."""
        c = self.config
        scores = ranked_confidence(pred, c.mask_in_softmax)
        if c.debias is not False:
            debiased = (-scores * local.log_freq[pred.tokens]).clamp_max(c.clip_alpha)
            scores = torch.where(local.debias, debiased, scores)
        if c.position_decay > 0:
            offset = (state.region - state.region[:, :1]).to(torch.float64)
            scores = scores * torch.exp(-c.position_decay * offset)
        return scores.masked_fill(~masked, float("-inf"))

    def select(self, pred: Prediction, masked: torch.Tensor, state: DecodeState,
               local: PCSamplerState) -> CommitSelection:
        return CommitSelection(select_scored(self.scores(pred, masked, state, local), masked, state,
                                             self.config.threshold))

    def floor(self) -> CommitFloor:
        return CommitFloor(0.0, 0)


# ------------------------------------------------------------------------------------------ building a table


def main(argv: list[str] | None = None) -> None:
    """Build a checkpoint's token-frequency table from the task suite's train split with its tokenizer."""
    parser = argparse.ArgumentParser(
        prog="python -m polestar.policies.commit_calibrated",
        description="Build PC-Sampler's token-frequency table for a checkpoint: the tokens of the task suite's "
                    "train split (unpadded prompt, reference answer, one EOS), counted with its tokenizer.")
    parser.add_argument("checkpoint", help="checkpoint directory or shipped checkpoint name")
    parser.add_argument("--tasks", default="arith,countdown,countdown4,sudoku,copy,reverse,sort,pick",
                        help="comma-separated task names (default: every task the tiny checkpoints train on)")
    parser.add_argument("--per-task", type=int, default=2000, help="train problems per task (default 2000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help=f"output file (default: CHECKPOINT/{TABLE_FILE})")
    args = parser.parse_args(argv)
    from transformers import PreTrainedTokenizerFast

    from polestar.models.loading import resolve_checkpoint

    directory = resolve_checkpoint(args.checkpoint)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
    tasks = [t for t in args.tasks.split(",") if t]
    source = (f"task suite train split, {args.per_task} problems each of {', '.join(tasks)} (seed {args.seed}): "
              "unpadded prompt + reference answer + one EOS, counted with the checkpoint's tokenizer")
    table = build_table(lambda s: tok.encode(s, add_special_tokens=False),
                        task_corpus(tasks, args.per_task, args.seed), source)
    out = Path(args.out) if args.out else directory / TABLE_FILE
    out.write_text(json.dumps(table.to_json(), indent=1) + "\n")
    print(f"wrote {out}: {table.total} tokens, {len(table.counts)} distinct")


if __name__ == "__main__":
    main()
