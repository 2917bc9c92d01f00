"""How many intra-op threads torch runs a command's model with.

``--threads N`` wins; else ``OMP_NUM_THREADS``, when set, is left to torch; else a model narrower than
:data:`SMALL_D_MODEL` runs with one thread, and a wider one with torch's default pool (one thread per core). A
small model's ops (matrices of a few hundred columns) are too short for a thread pool to pay: its threads spin
and hand work back and forth, and on a machine whose other jobs hold the cores they lose them and a step waits
for them (measured in docs/cli.md, "Threads"). The rule needs only ``config.json``, read before the weights, so a
run's manifest and the items file of ``polestar bench`` record the threads it actually uses.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import attrs
import torch

#: models with a hidden size below this run with one intra-op thread unless --threads / OMP_NUM_THREADS say
#: otherwise (the shipped checkpoints have 128; LLaDA-8B and Dream-7B have 4096 and 3584)
SMALL_D_MODEL = 1024


@attrs.frozen
class ThreadChoice:
    """The intra-op threads of a run (``threads``; None: torch's default, left alone) and why (``reason``)."""

    threads: int | None
    reason: str


def model_width(model: str | Path) -> int | None:
    """The hidden size (``d_model``) in checkpoint ``model``'s config.json (a folder or a shipped name); None when
    it cannot be read (the load that follows names the problem)."""
    from polestar.models.loading import FAMILIES, family_of, read_config, resolve_checkpoint

    try:
        directory = resolve_checkpoint(model)
        cfg = read_config(directory)
        return int(FAMILIES[family_of(cfg, directory)][0](cfg).d_model)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def choose_threads(requested: int | None, d_model: int | None,
                   environ: Mapping[str, str] = os.environ) -> ThreadChoice:
    """The :class:`ThreadChoice` for ``--threads requested`` (None: not given) and a model of width ``d_model``
    (None: unknown)."""
    if requested is not None:
        return ThreadChoice(requested, f"--threads {requested}")
    if environ.get("OMP_NUM_THREADS", "").strip():
        return ThreadChoice(None, f"OMP_NUM_THREADS={environ['OMP_NUM_THREADS'].strip()}")
    if d_model is not None and d_model < SMALL_D_MODEL:
        return ThreadChoice(1, f"a small model (d_model {d_model} < {SMALL_D_MODEL}): one thread")
    return ThreadChoice(None, "torch's default")


def apply_threads(requested: int | None, model: str | Path | None) -> int:
    """Set torch's intra-op threads for a run of checkpoint ``model`` (:func:`choose_threads`); returns the
    number of threads torch now uses."""
    choice = choose_threads(requested, model_width(model) if model is not None else None)
    if choice.threads is not None:
        torch.set_num_threads(choice.threads)
    return torch.get_num_threads()


def apply_thread_flag(args) -> int:
    """``--threads`` of a command that runs ``args.model``: checked (at least 1, else a usage error), then applied
    with :func:`apply_threads`; returns the threads torch now uses."""
    from polestar.cli_checks import check_positive

    requested = getattr(args, "threads", None)
    if requested is not None:
        check_positive("--threads", requested)
    return apply_threads(requested, args.model)
