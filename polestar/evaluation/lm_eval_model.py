"""The lm-evaluation-harness model ``polestar``: any Polestar policy on any LLaDA / Dream checkpoint.

Importing this module registers the class with lm-eval (``--model polestar``); ``polestar lm-eval`` does that
before handing its arguments to lm-eval's own command line. Model arguments (``--model_args k=v,k=v``):

* ``pretrained`` (required): checkpoint directory or shipped name (``tiny-llada``);
* ``policy`` (``polestar``), ``gen_length``, ``block_length``, ``steps``, ``threshold``, ``temperature``,
  ``seed``, ``stop_at_eos``, ``compile``: as in :func:`polestar.generate`;
* ``dtype`` (default: the checkpoint's own, as :func:`polestar.load` picks it; never upcast), ``device`` (``cuda``
  when available, else ``cpu``; a device this machine does not have is an error, never a silent fallback);
* ``preset``: an :mod:`~polestar.evaluation.presets` name (``table1``) that sets block length, the paper's stage
  options (threshold 0.9, ...) and the per-task generation length (explicit arguments win);
* ``batch_size``: prompts decoded together; ``mc_num`` / ``mc_batch_size`` / ``cfg`` / ``is_check_greedy``:
  the Monte-Carlo log-likelihood (:mod:`~polestar.evaluation.loglikelihood`);
* ``add_special_tokens``: whether contexts get the tokenizer's special tokens (LLaDA's BOS); by default yes, as
  :func:`polestar.generate` and LLaDA's evaluation do, except after ``--apply_chat_template`` (the template
  writes them);
* ``chat``: wrap each generation context as one user turn in the checkpoint's chat template, inside the model
  (the Polestar authors' LLaDA harness does this for instruct models); ``add_bos_token``: prefix each generation
  context with the tokenizer's BOS token (Dream's evaluation scripts pass ``add_bos_token=true``). Both default
  to the checkpoint's model preset (:mod:`polestar.presets`, recognised from config.json, or named with
  ``model_preset``) when ``preset`` is given, else off; they exclude each other and lm-eval's own
  ``--apply_chat_template``;
* ``plugin``: modules or ``.py`` files to import first (stages and policies defined outside the package; several
  separated by ``:``; see :mod:`polestar.plugins`);
* stage options and swaps: ``set.KEY=VALUE`` (``set.commit=factor``, ``set.refresh.refresh_interval=2``), the
  same keys as ``polestar bench --set``.

The generation length of a request is ``gen_length`` when given, else the preset's length for the request's
task, else the request's ``max_gen_toks`` rounded up to a block multiple, else 256; the answer is cut at the
first stop token (EOS or the chat format's end-of-turn), at ``max_gen_toks`` tokens and at the first ``until``
string. Under ``torchrun`` / ``accelerate launch`` the model joins the process group and exposes ``rank`` /
``world_size``, so lm-eval shards requests and gathers metrics through :meth:`PolestarLM.gather_object`.
"""

from __future__ import annotations

import logging
import math
import zlib
from typing import Any

import attrs
import torch
from attrs import validators as v
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

import polestar
from polestar import presets as model_presets
from polestar.config import GenerationConfig
from polestar.inspection import announce_model
from polestar.models.loading import read_config, resolve_checkpoint
from polestar.models.text import encode_text
from polestar.overrides import Overrides
from polestar.plugins import load_plugins, split_plugin_list

from . import distributed
from .counters import DecodingCounters
from .loglikelihood import greedy_matches, masked_bound
from .presets import get_preset

log = logging.getLogger(__name__)

#: Model-argument prefix of stage options and swaps (``set.threshold=0.8`` → ``threshold=0.8``).
STAGE_PREFIX = "set."

#: The most recently built model of this process (``polestar lm-eval`` reads its counters after the run).
LAST_MODEL: PolestarLM | None = None


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"expected true or false, got {value!r}")


def _to_int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected an integer, got {value!r}") from None


def _to_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number, got {value!r}") from None


def _optional(convert):
    return lambda value: None if value is None else convert(value)


def _nonempty(_inst, attribute, value):
    if not value:
        raise ValueError(f"model argument {attribute.name} is required: --model_args pretrained=DIR_OR_SHIPPED_NAME")


_positive = v.gt(0)


def _progress(total: int, desc: str, disable: bool):
    """A tqdm bar over ``total`` requests (None when disabled or tqdm is missing)."""
    if disable:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - lm-eval installs tqdm
        return None
    return tqdm(total=total, desc=desc, unit="request")


@attrs.frozen
class ModelArgs:
    """The ``--model_args`` of the ``polestar`` lm-eval model (less the ``set.`` stage options), converted from
    lm-eval's strings and validated (see the module docstring for their meaning)."""

    pretrained: str = attrs.field(default=None, validator=_nonempty)
    policy: str = attrs.field(default="polestar", converter=str)
    gen_length: int | None = attrs.field(default=None, converter=_optional(_to_int), validator=v.optional(_positive))
    block_length: int | None = attrs.field(default=None, converter=_optional(_to_int), validator=v.optional(_positive))
    steps: int | None = attrs.field(default=None, converter=_optional(_to_int), validator=v.optional(_positive))
    threshold: float | None = attrs.field(default=None, converter=_optional(_to_float))
    temperature: float = attrs.field(default=0.0, converter=_to_float, validator=v.ge(0.0))
    seed: int = attrs.field(default=0, converter=_to_int)
    stop_at_eos: bool = attrs.field(default=True, converter=_to_bool)
    dtype: str | None = attrs.field(default=None, validator=v.optional(v.in_(("float32", "bfloat16", "float16"))))
    device: str | None = attrs.field(default=None, converter=_optional(str))
    compile: bool = attrs.field(default=False, converter=_to_bool)
    preset: str | None = attrs.field(default=None)
    batch_size: int = attrs.field(default=1, converter=_to_int, validator=_positive)
    max_batch_size: int | None = None  # lm-eval passes it; batches are batch_size
    mc_num: int = attrs.field(default=128, converter=_to_int, validator=_positive)
    mc_batch_size: int = attrs.field(default=32, converter=_to_int, validator=_positive)
    cfg: float = attrs.field(default=0.0, converter=_to_float, validator=v.ge(0.0))
    is_check_greedy: bool = attrs.field(default=False, converter=_to_bool)
    add_special_tokens: bool | None = attrs.field(default=None, converter=_optional(_to_bool))
    chat: bool | None = attrs.field(default=None, converter=_optional(_to_bool))
    add_bos_token: bool | None = attrs.field(default=None, converter=_optional(_to_bool))
    model_preset: str | None = attrs.field(default=None)
    plugin: str | None = attrs.field(default=None, converter=_optional(str))

    def __attrs_post_init__(self):
        if self.mc_num % min(self.mc_batch_size, self.mc_num):
            raise ValueError(f"mc_num ({self.mc_num}) must be a multiple of mc_batch_size ({self.mc_batch_size})")
        if self.preset is not None:
            get_preset(self.preset)
        if self.chat and self.add_bos_token:
            raise ValueError("chat=true and add_bos_token=true exclude each other: a chat template writes its own BOS")
        if self.model_preset is not None:
            model_presets.get_preset(self.model_preset)

    @classmethod
    def parse(cls, kwargs: dict[str, Any]) -> tuple[ModelArgs, dict[str, Any]]:
        """Split lm-eval's keyword arguments into :class:`ModelArgs` and the ``set.`` stage overrides; one
        ValueError naming an unknown or malformed argument."""
        known = {f.name for f in attrs.fields(cls)}
        stage = {k[len(STAGE_PREFIX):]: val for k, val in kwargs.items() if k.startswith(STAGE_PREFIX)}
        unknown = sorted(k for k in kwargs if k not in known and not k.startswith(STAGE_PREFIX))
        if unknown:
            raise ValueError(f"unknown model arguments {unknown}; valid: {', '.join(sorted(known))}; stage options "
                             f"go as {STAGE_PREFIX}KEY=VALUE (e.g. {STAGE_PREFIX}commit.threshold=0.8)")
        given = {k: val for k, val in kwargs.items() if k in known}
        if str(given.get("batch_size", "1")).startswith("auto"):
            raise ValueError("--batch_size auto is not supported by the polestar model; give a number")
        fields = attrs.fields_dict(cls)
        for name, value in given.items():  # name the argument a conversion fails on
            try:
                if fields[name].converter is not None:
                    fields[name].converter(value)
            except ValueError as err:
                raise ValueError(f"model argument {name}: {err}") from None
        try:
            return cls(**given), stage
        except (TypeError, ValueError) as err:  # a range or a rule across arguments (attrs puts a tuple in a TypeError)
            text = err.args[0] if err.args and isinstance(err.args[0], str) else str(err)
            raise ValueError(f"model arguments: {' '.join(text.split())}") from None


def stage_overrides(args: ModelArgs, overrides: Overrides) -> Overrides:
    """The preset's stage options under ``threshold`` and the ``set.`` options (an explicit setting replaces the
    preset's, and a ``set.`` option replaces ``threshold``)."""
    preset = Overrides.parse(get_preset(args.preset).options if args.preset is not None else {})
    if args.threshold is not None:
        preset = preset.merge(Overrides(generic={"threshold": args.threshold}, optional={"threshold"}))
    return preset.merge(overrides)


def check_arguments(kwargs: dict[str, Any]) -> tuple[ModelArgs, Overrides]:
    """Every check of the model arguments that needs no weights, as one ValueError naming the argument: unknown or
    malformed arguments, the plugins (imported here), the policy and its stage options, the decoding layout, an
    explicit ``device`` this machine does not have (never a silent fallback) and a checkpoint that is not there.
    ``polestar lm-eval`` runs it before lm-eval starts; the model runs it again when lm-eval builds it."""
    from polestar.cli_checks import check_device

    args, stage = ModelArgs.parse(kwargs)
    overrides = Overrides.parse(stage)
    if args.plugin:  # stages and policies of a plugin, registered before the policy is assembled
        load_plugins(split_plugin_list(args.plugin))
    try:
        polestar.assemble(args.policy, stage_overrides(args, overrides))
    except ValueError as err:
        raise ValueError(f"model argument policy={args.policy}: {err}") from None
    block = args.block_length or (get_preset(args.preset).block_length if args.preset else 32)
    GenerationConfig(args.gen_length or block, block, args.steps, args.temperature, args.seed, args.stop_at_eos)
    if args.device is not None:
        check_device(args.device)
    try:
        resolve_checkpoint(args.pretrained)
    except FileNotFoundError as err:
        from polestar.hub_hint import hub_hint

        raise ValueError(f"model argument pretrained={args.pretrained}: {hub_hint(args.pretrained) or err}") from None
    return args, overrides


# -- tokenizer access: the one place that knows the tokenizer's interface ------------------------------------
def _encode(tok, text: str, add_special_tokens: bool) -> list[int]:
    """Token ids of ``text`` (a transformers tokenizer); a ValueError names characters outside the vocabulary."""
    return encode_text(tok, text, add_special_tokens=add_special_tokens)


def _decode(tok, ids: list[int]) -> str:
    """Text of ``ids`` with special tokens dropped."""
    return tok.decode(ids, skip_special_tokens=True)


def _stop_ids(model) -> tuple[int, ...]:
    """Token ids that end a generation: the checkpoint's stop tokens (EOS, end-of-turn) when known, else EOS."""
    defaults = getattr(model, "text_defaults", None)
    return tuple(defaults.stop_ids) if defaults is not None else (model.spec.eos_id,)


def _chat_template_of(tok) -> str | None:
    """The tokenizer's chat template (transformers tokenizers carry one), or None."""
    return getattr(tok, "chat_template", None)


@register_model("polestar")
class PolestarLM(LM):
    """lm-eval model that decodes with a Polestar policy (see the module docstring for its arguments)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        # fail on a bad argument, policy, stage option, block layout, device or checkpoint before loading anything
        args, self.overrides = check_arguments(kwargs)
        self.args = args
        self.preset = get_preset(args.preset) if args.preset else None
        self.policy = args.policy
        self.gen_length, self.steps = args.gen_length, args.steps
        self.block_length = args.block_length or (self.preset.block_length if self.preset else 32)
        self.threshold = args.threshold
        self.batch_size = args.batch_size
        self.mc_num, self.mc_batch_size = args.mc_num, min(args.mc_batch_size, args.mc_num)
        self._chat_applied = False
        # device None: CUDA when there is a GPU, else the CPU; an explicit device was checked above
        device = args.device if args.device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        self._rank, self._world_size = distributed.init_from_env(device)
        self._device = distributed.local_device(device)
        self.pretrained = args.pretrained
        if self._rank == 0:  # the checkpoint's one-line facts before the load
            announce_model(self.pretrained, args.dtype)
        # the paper's prompt format for this checkpoint (its model preset) when an evaluation preset is asked for
        model_preset = None
        if self.preset is not None:
            directory = resolve_checkpoint(self.pretrained)
            model_preset = (model_presets.get_preset(args.model_preset) if args.model_preset
                            else model_presets.preset_for_config(read_config(directory), directory))
        self.chat = args.chat if args.chat is not None else bool(model_preset and model_preset.chat)
        self.add_bos = (args.add_bos_token if args.add_bos_token is not None
                        else bool(model_preset and model_preset.add_bos))
        if self.chat and self.add_bos:
            raise ValueError(f"the preset of {self.pretrained} adds a BOS token; chat=true needs add_bos_token=false")
        # dtype None: the checkpoint's own (config.json torch_dtype, else the safetensors headers): never upcast
        self.model = polestar.load(self.pretrained, dtype=args.dtype, device=self._device)
        self.tokenizer = self.model.tokenizer
        if self.tokenizer is None:
            raise ValueError(f"checkpoint {self.pretrained} has no tokenizer; lm-eval needs one to turn text into ids")
        if self.add_bos and not self.tokenizer.bos_token:
            raise ValueError(f"add_bos_token=true but the tokenizer of {self.pretrained} has no BOS token; drop it")
        if self.chat:
            self.chat_template(True)  # raises, naming the fix, when the checkpoint has no chat template
        self.counters = DecodingCounters()
        global LAST_MODEL
        LAST_MODEL = self

    # -- settings -------------------------------------------------------------------------------------------
    def _ids(self, text: str) -> list[int]:
        """Token ids of a context or continuation. Special tokens (LLaDA's BOS) are added as
        :func:`polestar.generate` and LLaDA's evaluation add them, except after a chat template (which writes them
        itself) or when ``add_special_tokens`` says otherwise."""
        special = self.args.add_special_tokens if self.args.add_special_tokens is not None else not self._chat_applied
        return _encode(self.tokenizer, text, special)

    def _prompt_text(self, context: str) -> str:
        """A generation context in the checkpoint's evaluation format: one user turn of the chat template
        (``chat``), or after the tokenizer's BOS token (``add_bos_token``), else as it is."""
        if self.chat:
            if self._chat_applied:
                raise ValueError("chat=true renders the chat template inside the model; drop lm-eval's "
                                 "--apply_chat_template (or pass chat=false)")
            return self.tokenizer.apply_chat_template([{"role": "user", "content": context}],
                                                      add_generation_prompt=True, tokenize=False)
        if self.add_bos:
            return self.tokenizer.bos_token + context
        return context

    def _stage_overrides(self) -> dict[str, Any]:
        """The stage options of this model's policy (:func:`stage_overrides`), as :func:`polestar.generate`'s
        keyword overrides."""
        return stage_overrides(self.args, self.overrides).as_dict()

    def generation_length(self, task: str | None, max_gen_toks: int | None) -> int:
        """Generation length (tokens) of a request of lm-eval task ``task`` (see the module docstring)."""
        if self.gen_length is not None:
            return self.gen_length
        if self.preset is not None:
            return self.preset.gen_length(task)
        if max_gen_toks:
            return self.block_length * math.ceil(int(max_gen_toks) / self.block_length)
        return 256

    # -- lm-eval interface ---------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Decode each request's context; requests with the same generation length are batched in order."""
        plans = []
        for req in requests:
            context, gen_kwargs = req.args
            kwargs = dict(gen_kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_gen_toks = kwargs.pop("max_gen_toks", None)
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else self.args.temperature
            length = self.generation_length(getattr(req, "task_name", None), max_gen_toks)
            plans.append((context, until, max_gen_toks, length, temperature))
        results: list[str | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, (_, _, _, length, temperature) in enumerate(plans):
            groups.setdefault((length, temperature), []).append(i)
        bar = _progress(len(requests), "generate_until", disable_tqdm or self._rank != 0)
        for (length, temperature), members in groups.items():
            for start in range(0, len(members), self.batch_size):
                chunk = members[start : start + self.batch_size]
                gens = self._generate([plans[i][0] for i in chunk], length, temperature)
                for i, gen in zip(chunk, gens):
                    results[i] = self._finish(gen, plans[i][1], plans[i][2])
                    if hasattr(self, "cache_hook"):
                        self.cache_hook.add_partial("generate_until", requests[i].args, results[i])
                if bar is not None:
                    bar.update(len(chunk))
        if bar is not None:
            bar.close()
        return results

    def _generate(self, contexts: list[str], length: int, temperature: float) -> list[list[int]]:
        """Decode a batch of contexts → generated ids per row, cut at the first stop token (EOS, end-of-turn)."""
        limit = self.model.spec.max_seq_len - length
        if limit < 1:
            raise ValueError(f"generation length {length} leaves no room for a prompt in the model's context "
                             f"({self.model.spec.max_seq_len}); lower gen_length")
        prompts = []
        for text in contexts:
            ids = self._ids(self._prompt_text(text))
            if len(ids) > limit:
                log.warning("context of %d tokens cut to its last %d to fit the model's context", len(ids), limit)
                ids = ids[-limit:]
            prompts.append(ids)
        steps = self.steps if self.steps is not None else length
        out = polestar.generate(self.model, prompts, policy=self.policy, gen_length=length,
                                block_length=self.block_length, steps=steps, temperature=temperature,
                                seed=self.args.seed, stop_at_eos=self.args.stop_at_eos, compile=self.args.compile,
                                **self._stage_overrides())
        self.counters.add(out.stats)
        stops = set(_stop_ids(self.model))
        rows = []
        for row in out.generations.tolist():
            cut = next((i for i, t in enumerate(row) if t in stops), len(row))
            rows.append(row[:cut])
        return rows

    def _finish(self, ids: list[int], until: list[str], max_gen_toks: int | None) -> str:
        if max_gen_toks:
            ids = ids[: int(max_gen_toks)]
        text = _decode(self.tokenizer, ids)
        for stop in until:
            if stop:
                text = text.split(stop, 1)[0]
        return text

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), is_greedy)`` per request: LLaDA's Monte-Carlo masked-token bound with
        ``mc_num`` maskings (seeded from ``seed`` and the request text, so a request scores the same on any rank
        and in any order); ``is_greedy`` is checked only with ``is_check_greedy=true`` (else False)."""
        out = []
        limit = self.model.spec.max_seq_len
        bar = _progress(len(requests), "loglikelihood", disable_tqdm or self._rank != 0)
        for req in requests:
            context, continuation = req.args
            prefix = self._ids(context)
            target = _encode(self.tokenizer, continuation, False)
            if len(target) >= limit:
                raise ValueError(f"continuation of {len(target)} tokens does not fit the model's context ({limit})")
            prefix = prefix[-(limit - len(target)) :]
            key = zlib.crc32(f"{context}\x00{continuation}".encode())
            gen = torch.Generator().manual_seed(self.args.seed * 1_000_003 + key)
            ll = masked_bound(self.model, prefix, target, self.mc_num, self.mc_batch_size, self.args.cfg, gen)
            self.counters.loglikelihood_forwards += self.mc_num // self.mc_batch_size * (2 if self.args.cfg > 0 else 1)
            greedy = greedy_matches(self.model, prefix, target, self.args.cfg) if self.args.is_check_greedy else False
            out.append((ll, greedy))
            if hasattr(self, "cache_hook"):
                self.cache_hook.add_partial("loglikelihood", req.args, out[-1])
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Not available: a masked diffusion LM has no left-to-right token probabilities to roll over a text."""
        raise NotImplementedError(
            "loglikelihood_rolling (perplexity tasks such as wikitext) is not supported by the polestar model: a "
            "masked diffusion LM gives no left-to-right token probabilities; use generate_until or "
            "multiple-choice (loglikelihood) tasks")

    # -- chat templates --------------------------------------------------------------------------------------
    @property
    def tokenizer_name(self) -> str:
        """The checkpoint name, used by lm-eval to key its request cache."""
        return self.pretrained.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The tokenizer's chat template (None when chat templating is off)."""
        if not chat_template:
            return None
        template = _chat_template_of(self.tokenizer)
        if template is None:
            raise ValueError(f"the tokenizer of {self.pretrained} has no chat template; drop "
                             "--apply_chat_template or use a checkpoint whose tokenizer_config.json has one")
        return template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render lm-eval's messages with the tokenizer's chat template (``--apply_chat_template``)."""
        self.chat_template(True)
        self._chat_applied = True
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    # -- data parallelism ------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` stacked (0-d) or concatenated along dim 0, in rank order."""
        if not distributed.is_distributed():
            return tensor[None] if tensor.dim() == 0 else tensor
        parts = [torch.zeros_like(tensor) for _ in range(self._world_size)]
        torch.distributed.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` in rank order on rank ``dst``; None elsewhere."""
        objs = distributed.all_gather_objects(obj)
        return objs if self._rank == dst else None

    def barrier(self) -> None:
        distributed.barrier()

    def total_counters(self) -> DecodingCounters:
        """This run's counters summed over ranks (a collective call under a process group)."""
        return DecodingCounters.total(distributed.all_gather_objects(self.counters))
