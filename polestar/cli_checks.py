"""Checks of command-line input, run before any model is loaded or any token decoded.

Every check raises :class:`UsageError` (exit code 2) with one line naming the problem and the fix; failures that
happen while working (a checkpoint that cannot be read, a sequence stopped by non-finite logits) are
:class:`RuntimeFailure` (exit code 1). :func:`polestar.cli.main` prints either as one ``error: ...`` line.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


class UsageError(ValueError):
    """A bad argument or option: the command did no work. Exit code 2."""


class RuntimeFailure(RuntimeError):
    """The command started working and could not finish. Exit code 1."""


def one_line(err: BaseException) -> str:
    """``err``'s message as a single line (newlines folded), without KeyError's quotes."""
    text = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
    text = " ".join(part.strip() for part in text.splitlines() if part.strip())
    return text or type(err).__name__


@contextlib.contextmanager
def working(what: str) -> Iterator[None]:
    """Run the work of a command: any failure inside becomes a :class:`RuntimeFailure` naming ``what``."""
    try:
        yield
    except (UsageError, RuntimeFailure, KeyboardInterrupt):
        raise
    except Exception as err:  # every other failure while working is a runtime failure, reported in one line
        raise RuntimeFailure(f"{what} failed: {type(err).__name__}: {one_line(err)}") from err


# ----------------------------------------------------------------------------- --set


def _parse_value(text: str) -> Any:
    """``--set`` values: JSON scalars when they parse (0.9, 4, true, null), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_sets(items: list[str] | None) -> dict[str, Any]:
    """``["threshold=0.8", "refresh=prefix"]`` → ``{"threshold": 0.8, "refresh": "prefix"}``."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set expects KEY=VALUE, got {item!r}; e.g. --set threshold=0.8")
        out[key.strip()] = _parse_value(value.strip())
    return out


# ----------------------------------------------------------------------------- arguments


def check_device(device: str) -> None:
    """``--device``: a device string torch knows, and one this machine has (CUDA built in and a GPU visible)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if torch.version.cuda is None and torch.version.hip is None:
            raise UsageError(f"--device {device}: this torch build has no CUDA support; use --device cpu or "
                             "install a CUDA build of torch")
        if not torch.cuda.is_available():
            raise UsageError(f"--device {device}: no CUDA GPU is visible; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s); "
                             f"use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise UsageError(f"--device {device}: MPS is not available on this machine; use --device cpu")
    elif dev.type != "cpu":
        raise UsageError(f"--device {device!r}: polestar runs on cpu or cuda; use --device cpu or --device cuda")


def check_model(model: str, flag: str = "--model") -> None:
    """``flag``'s checkpoint (``--model``, or ``inspect``'s positional ``MODEL_DIR``): a checkpoint directory or
    a shipped checkpoint name (not a file, not a missing path; a hub id is answered with how to download it)."""
    from polestar.hub_hint import hub_hint
    from polestar.models.loading import shipped_checkpoints

    path = Path(model).expanduser()
    if path.is_dir() or model in shipped_checkpoints():
        return
    if path.exists():
        raise UsageError(f"{flag} {model} is a file; pass the checkpoint directory that holds config.json")
    hint = hub_hint(model)
    if hint is not None:
        raise UsageError(f"{flag} {hint}")
    raise UsageError(f"{flag} {model!r} not found: pass a checkpoint directory or a shipped name "
                     f"({', '.join(shipped_checkpoints()) or 'none shipped'})")


def check_positive(flag: str, value: int) -> None:
    """An integer flag that must be ≥ 1 (``--n``, ``--batch-size``)."""
    if value < 1:
        raise UsageError(f"{flag} must be at least 1, got {value}")


def check_output_file(flag: str, path: str | None) -> None:
    """An output file flag: its directory must exist (checked before the work that fills it), outside the
    installed package's source folders."""
    if path is None:
        return
    check_outside_source_or_usage(flag, path)
    target = Path(path).expanduser()
    if target.is_dir():
        raise UsageError(f"{flag} {path} is a directory; name a file, e.g. {flag} {Path(path) / 'out'}")
    parent = target.parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: directory {parent} does not exist; create it first (mkdir -p {parent})")


def check_outside_source_or_usage(flag: str, path: str | Path) -> None:
    """``flag path`` must not lie inside the package's source folders (a :class:`UsageError` naming the folder
    and the fix: a scratch folder)."""
    from polestar.output_files import check_outside_source

    try:
        check_outside_source([path], flag)
    except ValueError as err:
        raise UsageError(one_line(err)) from None


def check_plot_backend(path: str | None) -> None:
    """``--plot`` needs matplotlib; say so before the run rather than after it."""
    if path is None:
        return
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        raise UsageError("--plot needs matplotlib, which is not installed; pip install matplotlib "
                         "(or pip install 'polestar-dllm[bench]'), or drop --plot") from None


def split_policies(text: str, entries: bool = True) -> list[str]:
    """``--policies a,b`` → ``["a", "b"]``; with ``entries`` a name may carry settings of its own,
    ``polestar[drift=peakjs]`` (:mod:`polestar.entries`; returned in their canonical spelling). An empty list,
    a malformed entry, an unknown or a repeated one is an error."""
    from polestar import registry
    from polestar.entries import parse_entry, split_entries
    from polestar.policy import policy_names

    names = policy_names()
    policies = []
    for part in split_entries(text):
        if not entries and "[" in part:
            raise UsageError(f"--policies takes registered policy names here, not {part!r}; "
                             f"give the settings with --set")
        try:
            entry = parse_entry(part, _parse_value)
        except ValueError as err:
            raise UsageError(str(err)) from None
        if entry.policy not in names:
            hint = registry.did_you_mean(entry.policy, names)
            raise UsageError(f"unknown policy {entry.policy!r} in --policies{hint}; "
                             f"registered policies: {', '.join(names)}")
        policies.append(entry.text)
    if not policies:
        raise UsageError(f"--policies is empty; name at least one of: {', '.join(names)}")
    repeated = sorted({p for p in policies if policies.count(p) > 1})
    if repeated:
        raise UsageError(f"--policies names {repeated[0]!r} twice; list each entry once")
    return policies


def check_generation_config(decoding: dict[str, Any]) -> None:
    """Build the :class:`~polestar.config.GenerationConfig` of the decoding flags (raises on a bad layout)."""
    from polestar.config import GenerationConfig

    keys = ("gen_length", "block_length", "steps", "temperature", "seed", "stop_at_eos")
    try:
        GenerationConfig(**{k: decoding[k] for k in keys if k in decoding})
    except (ValueError, TypeError) as err:
        raise UsageError(one_line(err)) from None


def undecodable(text: str) -> tuple[int, int] | None:
    """``(byte, position)`` of the first byte of ``text`` that was not UTF-8 where it came from (Python keeps such a
    byte of a command-line argument as a lone surrogate, U+DC80..U+DCFF), or None when ``text`` is clean."""
    for i, ch in enumerate(text):
        if "\udc80" <= ch <= "\udcff":
            return ord(ch) - 0xDC00, i
        if "\ud800" <= ch <= "\udfff":  # any other lone surrogate cannot be encoded either
            return ord(ch), i
    return None


def check_utf8_prompts(flag: str, prompts: list[str]) -> None:
    """Each of ``prompts`` (the values of ``flag``) is UTF-8 text; the first that is not is one UsageError naming
    the prompt, the byte and its position."""
    for i, prompt in enumerate(prompts):
        bad = undecodable(prompt)
        if bad is not None:
            which = flag if len(prompts) == 1 else f"{flag} #{i + 1}"
            raise UsageError(f"{which} is not UTF-8 text: byte 0x{bad[0]:02x} at character {bad[1] + 1}; pass the "
                             "prompt as UTF-8 (convert it first, e.g. iconv -f latin1 -t utf-8)")


def utf8_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of each line of a text file, decoded as UTF-8; a line that is not UTF-8 is one
    ValueError naming ``path:line``, the byte and its column."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                yield lineno, raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column "
                                 f"{err.start + 1}); save the file as UTF-8") from None


def check_task_prompts(task_name: str | None, prompts: list[str]) -> None:
    """Every ``--prompt`` must be an input of ``--task`` in that task's format (see ``task.validate_input``)."""
    if task_name is None:
        return
    task = get_task_or_usage(task_name)
    for i, prompt in enumerate(prompts):
        try:
            task.validate_input(prompt)
        except ValueError as err:
            which = "--prompt" if len(prompts) == 1 else f"--prompt #{i + 1}"
            raise UsageError(f"{which}: {one_line(err)}") from None


def get_task_or_usage(task_name: str):
    """The registered task ``task_name``; an unknown name is a :class:`UsageError` listing the tasks."""
    from polestar.tasks import get_task

    try:
        return get_task(task_name)
    except ValueError as err:
        raise UsageError(f"--task: {one_line(err)}") from None


def check_finite_weights(model, name: str) -> None:
    """A checkpoint whose weights hold NaN or inf decodes garbage (empty output); refuse it before decoding."""
    for pname, param in model.named_parameters():
        if param.is_floating_point() and not bool(torch.isfinite(param).all()):
            raise RuntimeFailure(f"model {name}: weight {pname} holds NaN or inf values; the checkpoint is "
                                 "corrupt, re-export or re-download it")
