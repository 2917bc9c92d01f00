"""Public entry points: ``polestar.load`` and ``polestar.generate``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from polestar.models.backbone import DiffusionLM
from polestar.models.loading import load_model
from polestar.models.text import chat_prompt_ids, decode_texts, encode_text

from .config import GenerationConfig
from .engine import decode
from .overrides import Overrides
from .policy import Pipeline, assemble
from .state import StepRecord
from .stats import RunStats, compile_seconds


def load(path: str | Path, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu") -> DiffusionLM:
    """Load an LLaDA or Dream checkpoint: a Hugging Face-format directory or a shipped name (``"tiny-llada"``).

    ``dtype``: float32, bfloat16 or float16; None (default) keeps the checkpoint's ``torch_dtype``. Weights come
    from safetensors only, read straight into the model's memory (peak host memory about the weights' size).
    The checkpoint's tokenizer is attached as ``model.tokenizer`` (a ``transformers.PreTrainedTokenizerBase``, or
    None without tokenizer files) and its stop tokens / decoding defaults (``generation_config.json``) as
    ``model.text_defaults``.

    A name that is not found and looks like a Hugging Face hub id (``GSAI-ML/LLaDA-8B-Instruct``) is a
    FileNotFoundError saying how to download it: nothing is ever downloaded.
    """
    _check_found(path)
    return load_model(path, dtype=dtype, device=device)


def _check_found(path: str | Path) -> None:
    """FileNotFoundError for a missing checkpoint, with the download command when ``path`` looks like a hub id."""
    from polestar.hub_hint import hub_hint
    from polestar.models.loading import resolve_checkpoint

    try:
        resolve_checkpoint(path)
    except FileNotFoundError as err:
        hint = hub_hint(path)
        if hint is None:
            raise
        raise FileNotFoundError(hint) from err


@attrs.frozen
class GenerationOutput:
    """Result of :func:`generate`.

    ``tokens``: LongTensor ``[B, prompt_len + gen_length]`` (prompts right-aligned, left padding with the pad id);
    ``texts``: decoded generations (up to the first stop token, without special tokens) when the checkpoint has
    a tokenizer, else None;
    ``stats``: :class:`~polestar.stats.RunStats`; ``prompt_len``: column where generation starts;
    ``pipeline``: the assembled stages and their options; ``prompt_ids``: each prompt's token ids without
    padding (after the chat template when ``chat=True``).
    """

    tokens: torch.Tensor
    texts: list[str] | None
    stats: RunStats
    prompt_len: int
    pipeline: Pipeline
    prompt_ids: list[list[int]] | None = None

    @property
    def generations(self) -> torch.Tensor:
        """``[B, gen_length]`` generated tokens."""
        return self.tokens[:, self.prompt_len :]

    @property
    def errors(self) -> list[str | None]:
        """Per sequence: why it stopped early (non-finite logits), None when it decoded normally."""
        return [seq.error for seq in self.stats.sequences]


def encode_prompts(model: DiffusionLM, prompts: Any, chat: bool = False,
                   system: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts (strings, token-id lists or a LongTensor ``[B, L]``) → left-padded ids ``[B, P]`` and mask ``[B, P]``.

    ``chat=True`` wraps each string prompt as a user turn (after an optional ``system`` turn) in the checkpoint's
    chat template, ending with the assistant header.
    """
    spec = model.spec
    if isinstance(prompts, str):
        prompts = [prompts]
    if chat and not (isinstance(prompts, Sequence) and all(isinstance(p, str) for p in prompts)):
        raise ValueError("chat=True formats string prompts; pass strings, or token ids with chat=False")
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() == 1:
            prompts = prompts[None]
        if prompts.dim() != 2 or prompts.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"prompt tensor must be an integer tensor [B, L], got {prompts.dtype} "
                             f"{tuple(prompts.shape)}")
        rows = [list(map(int, r)) for r in prompts.tolist()]
    elif isinstance(prompts, Sequence):
        if len(prompts) == 0:
            raise ValueError("empty batch: pass at least one prompt")
        if all(isinstance(p, str) for p in prompts):
            tok = model.tokenizer
            if tok is None:
                raise ValueError("string prompts need a checkpoint with tokenizer files (tokenizer.json or "
                                 "tokenizer_config.json); pass token ids instead")
            for i, text in enumerate([*prompts, *([system] if chat and system is not None else [])]):
                _check_text(text, f"prompt {i}" if i < len(prompts) else "system")
            if chat:
                rows = [chat_prompt_ids(tok, p, system) for p in prompts]
            else:
                rows = [encode_text(tok, p) for p in prompts]
        elif all(isinstance(p, Sequence) and not isinstance(p, str) for p in prompts):
            rows = [list(map(int, p)) for p in prompts]
        else:
            raise ValueError("prompts must be all strings or all token-id lists")
    else:
        raise ValueError(f"prompts must be strings, token-id lists or a LongTensor, got {type(prompts).__name__}")
    if len(rows) == 0:
        raise ValueError("empty batch: pass at least one prompt")
    for i, r in enumerate(rows):
        if len(r) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        bad = [t for t in r if not 0 <= t < spec.embedding_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {spec.embedding_size}): {bad[:5]}")
    P = max(len(r) for r in rows)
    ids = torch.full((len(rows), P), spec.pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), P, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, P - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, P - len(r) :] = True
    return ids.to(model.device), mask.to(model.device)


def _check_text(text: str, what: str) -> None:
    """ValueError when ``text`` holds a character no tokenizer can encode: a lone surrogate, which is how Python
    keeps a byte that was not UTF-8 (a command-line argument, a file read with ``errors="surrogateescape"``)."""
    from .cli_checks import undecodable

    bad = undecodable(text)
    if bad is not None:
        raise ValueError(f"{what} is not UTF-8 text: byte 0x{bad[0]:02x} at character {bad[1] + 1} (a lone "
                         "surrogate); decode your input as UTF-8 first")


#: generation and block length when neither the call nor a preset gives them (``polestar generate``'s defaults)
DEFAULT_LENGTHS = {"gen_length": 64, "block_length": 16}


def length_defaults(model: DiffusionLM) -> dict[str, int]:
    """``gen_length`` and ``block_length`` for ``model``: its preset's when it was loaded from a published
    checkpoint, else :data:`DEFAULT_LENGTHS` with the generation length capped at half the model's context (in
    whole blocks, at least one block)."""
    from polestar import presets
    from polestar.models.loading import read_config

    directory = getattr(model, "name_or_path", None)
    preset = None
    if directory is not None and (Path(directory) / "config.json").is_file():
        preset = presets.preset_for_config(read_config(Path(directory)), directory)
    if preset is not None:
        return {k: preset.decoding[k] for k in DEFAULT_LENGTHS}
    block = DEFAULT_LENGTHS["block_length"]
    fit = max(block, model.spec.max_seq_len // 2 // block * block)
    return {"gen_length": min(DEFAULT_LENGTHS["gen_length"], fit), "block_length": block}


def _task_prompts(task: str, prompts: Any) -> list[str]:
    """Each string prompt in ``task``'s prompt layout (ValueError naming the task and the bad prompt)."""
    from polestar.tasks import get_task

    fmt = get_task(task).format_prompt
    if isinstance(prompts, str):
        prompts = [prompts]
    if not (isinstance(prompts, Sequence) and all(isinstance(p, str) for p in prompts)):
        raise ValueError(f"task={task!r} formats string prompts; pass strings (e.g. \"3+4*2-5\"), or token ids "
                         "without task=")
    return [fmt(p) for p in prompts]


def generate(
    model: DiffusionLM | str | Path,
    prompts: Any,
    policy: str | Pipeline = "fast-dllm",
    gen_length: int | None = None,
    block_length: int | None = None,
    steps: int | None = None,
    temperature: float | None = None,
    seed: int = 0,
    threshold: float | None = None,
    stop_at_eos: bool = True,
    compile: bool | str = False,
    chat: bool = False,
    system: str | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
    check_stages: bool | None = None,
    task: str | None = None,
    **overrides: Any,
) -> GenerationOutput:
    """Decode ``prompts`` with ``policy``: a registered policy name (see ``polestar policies``) or a
    :class:`~polestar.policy.Pipeline` already built by :func:`polestar.assemble` (then without overrides).
    ``model`` is a loaded model, or a checkpoint directory or shipped name (``"tiny-llada"``), loaded with
    :func:`load`'s defaults (to decode many times, load it once yourself).

    ``overrides`` set stage options (``threshold=0.8``, ``commit.threshold=0.8``) or swap stages
    (``refresh="prefix"``); every value is validated before any work starts. ``threshold`` is the confidence
    threshold of the threshold-based commit rules; policies without one (``baseline``) ignore it, so one call
    can sweep every policy. ``compile=True`` compiles each layer's model work once (the layer regions,
    :mod:`polestar.models.layer_regions`; a string names another ``torch.compile`` backend for them) and calls it at
    every layer, so the compile does not grow with depth; the stages and the step's glue run as Python around them,
    and on CUDA each step phase is captured whole as one CUDA graph and replayed (with or without ``compile``). One
    route on every device and torch. Tokens are the same as eager, and the time spent compiling
    is reported as ``stats.compile_s`` and left out of ``stats.wall_s`` / ``stats.tps``. ``chat=True`` applies the
    checkpoint's chat template to string prompts (``system``: optional system turn). A sequence stops at EOS or at
    the chat format's end-of-turn token (``model.text_defaults.stop_ids``). ``temperature`` None takes
    ``generation_config.json``'s value, else 0. ``on_step`` receives a :class:`~polestar.state.StepRecord` after
    every step (for tests and diagnostics such as ``polestar anatomy``).
    The outputs of stages from outside the package (plugins) are checked against their kind's contract
    (:mod:`polestar.contracts`) in every step that runs as Python (on CUDA, the first step of each phase, before it
    is captured); ``check_stages=True`` checks every stage, ``check_stages=False`` none (default: the environment
    variable ``POLESTAR_CHECK_STAGES`` when set). A stage that declares ``compilable = False`` turns the CUDA-graph
    capture off, and one log line says why (:mod:`polestar.compile_off`).

    ``gen_length`` / ``block_length`` None take the settings of the published checkpoint's preset when the model
    was loaded from one (recognised from its config.json, as ``polestar generate`` does), else
    :data:`DEFAULT_LENGTHS`, with the generation length capped at half the model's context. ``task`` (a task of
    ``polestar.tasks``, e.g. ``"arith"``) formats each string prompt with the task's prompt layout, as
    ``polestar generate --task`` does: ``generate(model, ["3+4*2-5"], task="arith")``.
    """
    # threshold: an optional generic option, ignored by policies without it; an explicit option wins over it
    options = Overrides.parse(overrides)
    if threshold is not None:
        options = Overrides(generic={"threshold": threshold}, optional={"threshold"}).merge(options)
    if isinstance(model, (str, Path)):  # bad options and a missing checkpoint are named before any weight loads
        if not isinstance(policy, Pipeline):
            assemble(policy, options, check_stages=False)
        _check_found(model)
        model = load(model)
    if gen_length is None or block_length is None:
        lengths = length_defaults(model)
        gen_length = lengths["gen_length"] if gen_length is None else gen_length
        block_length = lengths["block_length"] if block_length is None else block_length
    if task is not None:
        prompts = _task_prompts(task, prompts)
    defaults = getattr(model, "text_defaults", None)
    if temperature is None:
        temperature = defaults.decoding.get("temperature", 0.0) if defaults is not None else 0.0
    if system is not None and not chat:
        raise ValueError("system= is the system turn of a chat prompt; pass chat=True with it")
    config = GenerationConfig(gen_length, block_length, steps, temperature, seed, stop_at_eos)
    if isinstance(policy, Pipeline):
        if overrides or threshold is not None:
            raise ValueError("stage options and threshold apply to a policy name; for an assembled Pipeline pass "
                             "them to polestar.assemble instead")
        pipeline = policy
    else:
        pipeline = assemble(policy, options, check_stages=check_stages)
    ids, mask = encode_prompts(model, prompts, chat=chat, system=system)
    total = ids.shape[1] + gen_length
    if total > model.spec.max_seq_len:
        raise ValueError(
            f"prompt length {ids.shape[1]} + gen_length {gen_length} = {total} exceeds the model's context "
            f"({model.spec.max_seq_len}); shorten the prompt or lower gen_length"
        )
    stop_ids = defaults.stop_ids if defaults is not None else (model.spec.eos_id,)
    compiled_before = compile_seconds()
    tokens, stats = decode(model, ids, mask, pipeline, config, compile=compile, stop_ids=stop_ids, on_step=on_step)
    if compile:  # report compile time apart: wall_s (and so tps) count decoding only
        spent = compile_seconds() - compiled_before
        stats = attrs.evolve(stats, compile_s=spent, wall_s=max(stats.wall_s - spent, 0.0))
    tok = model.tokenizer
    texts = None if tok is None else decode_texts(tok, tokens[:, ids.shape[1] :].tolist(), stop_ids)
    prompt_ids = [row[m].tolist() for row, m in zip(ids.cpu(), mask.cpu())]
    return GenerationOutput(tokens, texts, stats, ids.shape[1], pipeline, prompt_ids)
