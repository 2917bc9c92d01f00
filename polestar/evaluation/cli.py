"""``polestar lm-eval ...``: lm-eval's own command line with the ``polestar`` model registered.

Every argument is handed to lm-eval as it is (long options may also be written with hyphens, ``--model-args``
for lm-eval's ``--model_args``), except ``--preset NAME`` (see
:mod:`~polestar.evaluation.presets`), which is expanded first: ``preset=NAME`` is added to ``--model_args`` (block
length, threshold and per-task generation lengths reach the model) and, when the selected tasks share one few-shot
count in the preset and ``--num_fewshot`` is not given, ``--num_fewshot N`` is added. ``--model`` defaults to
``polestar``. ``--threads N`` sets torch's intra-op threads (default: :mod:`polestar.threads`'s rule for the
``pretrained=`` checkpoint). ``--plugin MODULE_OR_FILE`` (repeatable) is imported first, in every process (see
:mod:`polestar.plugins`; the model argument ``plugin=...`` does the same). The ``polestar`` model's arguments
(unknown or malformed ones, the policy and its options, ``--device``, the checkpoint) are checked before lm-eval
starts, so a bad one is one ``error:`` line before any of lm-eval's log lines. ``--debug`` (polestar's own) adds
the traceback to a failure. After the run, the decoding counters summed over every rank are written to
``OUTPUT_PATH/polestar_counters_<time>.json`` when ``--output_path`` is given (beside lm-eval's results), else
printed as JSON.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from polestar.plugins import load_plugins

from .presets import get_preset

_MODEL_ARGS = ("--model_args", "-a")
_TASKS = ("--tasks", "-t")
_FEWSHOT = ("--num_fewshot", "-f")
_OUTPUT = ("--output_path", "-o")


def _values(argv: list[str], names: tuple[str, ...]) -> tuple[int, list[str]] | None:
    """Position of option ``names`` in ``argv`` and the values after it (up to the next option); None if absent.
    ``--opt=value`` counts as one value."""
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name:
                vals = []
                for a in argv[i + 1 :]:
                    if a.startswith("-"):
                        break
                    vals.append(a)
                return i, vals
            if arg.startswith(name + "="):
                return i, [arg.split("=", 1)[1]]
    return None


def _pop_option(argv: list[str], option: str, example: str) -> tuple[list[str], list[str]]:
    """The values of every ``option VALUE`` / ``option=VALUE`` in ``argv``, and ``argv`` without them."""
    out, values, i = [], [], 0
    while i < len(argv):
        if argv[i] == option:
            if i + 1 >= len(argv):
                raise ValueError(f"{option} needs a value, e.g. {option} {example}")
            values.append(argv[i + 1])
            i += 2
        elif argv[i].startswith(option + "="):
            values.append(argv[i].split("=", 1)[1])
            i += 1
        else:
            out.append(argv[i])
            i += 1
    return values, out


def _pop_preset(argv: list[str]) -> tuple[str | None, list[str]]:
    presets, out = _pop_option(argv, "--preset", "table1")
    return (presets[-1] if presets else None), out


def _underscored(arg: str) -> str:
    """``--model-args=x`` → ``--model_args=x``: lm-eval's long options are written with underscores; the
    project's own commands use hyphens, so both spellings are accepted (values are left alone)."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return "--" + name[2:].replace("-", "_") + eq + value


def expand_arguments(argv: list[str]) -> list[str]:
    """lm-eval arguments for ``polestar lm-eval argv``: ``--preset`` expanded, ``--model polestar`` by default,
    hyphenated long options (``--model-args``) spelled as lm-eval spells them (``--model_args``)."""
    name, argv = _pop_preset([_underscored(a) for a in argv])
    if (not any(a in ("--model", "-M") or a.startswith("--model=") for a in argv)
            and argv[:1] not in (["ls"], ["validate"])):
        argv += ["--model", "polestar"]
    if name is None:
        return argv
    preset = get_preset(name)
    model = _values(argv, ("--model", "-M"))
    if model is not None and model[1][:1] != ["polestar"]:
        raise ValueError(f"--preset configures the polestar model; drop --model {' '.join(model[1])} or --preset")
    found = _values(argv, _MODEL_ARGS)
    if found is None:
        argv += ["--model_args", f"preset={name}"]
    elif not any("preset=" in v for v in found[1]):
        i, vals = found
        if argv[i].startswith("--model_args=") or argv[i].startswith("-a="):
            argv[i] = f"{argv[i]},preset={name}"
        elif vals:
            argv[i + len(vals)] = f"{vals[-1]},preset={name}"
        else:
            argv.insert(i + 1, f"preset={name}")
    tasks = _values(argv, _TASKS)
    if tasks is not None and _values(argv, _FEWSHOT) is None:
        names = [t for v in tasks[1] for t in v.split(",") if t]
        shots = {s.num_fewshot for s in map(preset.setting, names) if s is not None}
        if len(shots) == 1:
            argv += ["--num_fewshot", str(shots.pop())]
    return argv


def _run_harness(argv: list[str]) -> None:
    """lm-eval's own command line on ``argv`` (its parser reads ``sys.argv``)."""
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        try:
            from lm_eval._cli import HarnessCLI
        except ImportError:  # lm-eval < 0.4.9: one flat parser
            from lm_eval.__main__ import cli_evaluate

            cli_evaluate()
            return
        from lm_eval.utils import setup_logging

        setup_logging()
        parser = HarnessCLI()
        parser.execute(parser.parse_args())
    finally:
        sys.argv = saved


def _output_directory(output_path: str) -> Path:
    """The folder lm-eval writes ``--output_path`` into (its parent for a ``.json`` file name)."""
    base = Path(output_path)
    return base.parent if base.suffix == ".json" else base


def check_output_path(argv: list[str]) -> None:
    """ValueError (exit 2) before lm-eval starts when ``--output_path`` cannot be written: its nearest existing
    folder must accept a new file (a file is created and removed there), and it must lie outside the package's
    source folders."""
    from polestar.output_files import check_outside_source, check_writable

    out = _values(argv, _OUTPUT)
    if out is None or not out[1]:
        return
    directory = _output_directory(out[1][0])
    check_outside_source([directory], "--output_path")
    existing = next((p for p in (directory, *directory.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        raise ValueError(f"--output_path {out[1][0]}: {existing} is a file, not a folder")
    try:
        check_writable([existing / "polestar-output-check"])
    except ValueError as err:
        raise ValueError(f"--output_path {out[1][0]}: {err}") from None


def write_counters(argv: list[str]) -> Path | None:
    """Write (rank 0) the counters of the run's ``polestar`` model beside ``--output_path``, or print them.
    Returns the file written, if any."""
    from . import lm_eval_model

    lm = lm_eval_model.LAST_MODEL
    if lm is None:
        return None
    record = {"model": lm.pretrained, "policy": lm.policy, "world_size": lm.world_size,
              "counters": lm.total_counters().as_dict()}
    if lm.rank != 0:
        return None
    out = _values(argv, _OUTPUT)
    if out is None or not out[1]:
        print(json.dumps(record, indent=1))
        return None
    from polestar.output_files import write_atomic

    directory = _output_directory(out[1][0])
    directory.mkdir(parents=True, exist_ok=True)
    stamp, k = time.strftime('%Y-%m-%dT%H-%M-%S'), 1
    path = directory / f"polestar_counters_{stamp}.json"
    while path.exists():  # never over an earlier run's counters
        path, k = directory / f"polestar_counters_{stamp}-{k}.json", k + 1
    write_atomic(path, json.dumps(record, indent=1))
    print(f"polestar decoding counters: {path}")
    return path


def model_kwargs(argv: list[str]) -> dict[str, Any]:
    """The keyword arguments lm-eval builds the model with: ``--model_args`` (``k=v,k=v``, several such values,
    or a JSON object) plus ``--device`` and ``--batch_size``, with lm-eval's own conversion of each value."""
    from lm_eval.utils import simple_parse_args_string

    kwargs: dict[str, Any] = {}
    found = _values(argv, _MODEL_ARGS)
    for value in found[1] if found is not None else []:
        parsed = None
        if value.strip().startswith("{"):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"--model_args {value}: not valid JSON ({err.msg}); write key=value,key=value "
                                 "or a JSON object") from None
        if not isinstance(parsed, dict):
            bad = [item for item in value.split(",") if item.strip() and "=" not in item]
            if bad:
                raise ValueError(f"--model_args: expected key=value, got {bad[0]!r}; e.g. --model_args "
                                 "pretrained=tiny-llada,policy=polestar")
            parsed = simple_parse_args_string(value)
        kwargs.update(parsed)
    for option, key in (("--device", "device"), ("--batch_size", "batch_size")):
        given = _values(argv, (option,))
        if given is not None and given[1]:
            kwargs[key] = given[1][0]
    return kwargs


def check_polestar_model(argv: list[str]) -> None:
    """The ``polestar`` model's arguments checked before lm-eval starts (so before its first log line): a bad
    argument, policy, option, device or a missing checkpoint is one ValueError (exit code 2). A ``--device`` this
    machine lacks is refused for any model."""
    from polestar.cli_checks import check_device

    device = _values(argv, ("--device",))
    if device is not None and device[1]:
        check_device(device[1][0])
    model = _values(argv, ("--model", "-M"))
    if model is None or model[1][:1] != ["polestar"]:
        return
    from .lm_eval_model import check_arguments

    check_arguments(model_kwargs(argv))


def _threads_value(values: list[str]) -> int | None:
    """``--threads N`` (polestar's own, not lm-eval's): the last value as an integer of at least 1, None when
    absent."""
    if not values:
        return None
    try:
        value = int(values[-1])
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"--threads must be an integer of at least 1, got {values[-1]!r}")
    return value


def run_lm_eval(argv: list[str]) -> int:
    """``polestar lm-eval``: expand the arguments, register the model, check its arguments, run lm-eval, write the
    counters."""
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
    plugins, argv = _pop_option(argv, "--plugin", "mydrift.py")
    threads, argv = _pop_option(argv, "--threads", "1")
    load_plugins(plugins)  # this process (each rank under torchrun) registers the plugin's stages first
    argv = expand_arguments(argv)
    check_output_path(argv)
    requested = _threads_value(threads)
    try:
        from . import lm_eval_model  # noqa: F401  (registers --model polestar)
    except ImportError as err:
        raise ValueError(f"polestar lm-eval needs lm-evaluation-harness ({err}); install it with "
                         "pip install -e '.[eval]'") from None
    if argv[:1] not in (["ls"], ["validate"]) and not any(a in ("-h", "--help") for a in argv):
        check_polestar_model(argv)
        from polestar.threads import apply_threads

        apply_threads(requested, model_kwargs(argv).get("pretrained"))

    from . import distributed

    try:
        _run_harness(argv)
        write_counters(argv)
        # every rank finishes before any leaves the group: a rank tearing gloo down while a peer is still in
        # its last steps can abort that peer ("terminate called without an active exception")
        distributed.barrier()
    finally:
        distributed.shutdown()
    return 0
