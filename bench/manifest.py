"""The manifest of a benchmark run: what produced it, written beside its results.

``polestar bench --json OUT.json`` writes ``OUT.manifest.json`` (named from the whole output name:
:func:`~polestar.bench.run_files.manifest_path`) before it decodes anything and copies it into ``OUT.json`` under
``"manifest"``: the package version, the git commit of the checkout the package runs from (when it runs from one),
the torch and Python versions, the device, the number of torch intra-op threads the run uses (``--threads``, else
the default of :mod:`polestar.threads`), every setting of the run (model, task,
problems, decoding, ``--set`` options, batch size, dtype, policies with their labels) and the sha256 digest of every
plugin's source file (``"plugins"``: stages from outside the package; not compared by ``agree``, which compares runs
with and without a plugin stage). ``polestar bench`` adds ``"timings"``: ``{"mixed": true, "differences":
["threads: 2 -> 1"]}`` when ``--resume --resume-any-timing`` reused items timed with other settings (else
``mixed`` false). ``polestar agree`` compares two runs' manifests (:func:`manifest_diff`) and
refuses runs that differ in more than the one setting being compared.
"""

from __future__ import annotations

import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .item_log import canonical, settings_diff
from .run_files import manifest_path  # noqa: F401  (re-exported: the harness and `agree` name it from here)

#: Manifest entries that describe the run's environment and take part in :func:`manifest_diff`
#: (``date``, ``command`` and ``git_dirty`` do not: they differ between any two runs or checkouts in use).
COMPARED_ENVIRONMENT = ("polestar_version", "git_commit", "torch_version", "threads")


def _git(args: list[str], where: Path) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def package_version() -> str:
    """The installed distribution's version (``polestar-dllm``), else ``polestar.__version__``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("polestar-dllm")
    except PackageNotFoundError:
        from polestar import __version__

        return __version__


def build_manifest(settings: dict[str, Any], device: str) -> dict[str, Any]:
    """The manifest of a run with ``settings`` (JSON-serialisable) on ``device``; the plugins' digests of the
    settings (``settings["plugins"]``, see :func:`polestar.plugins.plugin_sources`) go under ``"plugins"``."""
    import torch

    import polestar

    where = Path(polestar.__file__).resolve().parent
    commit = _git(["rev-parse", "HEAD"], where)
    dirty = _git(["status", "--porcelain", "--untracked-files=no"], where) if commit else None
    dev = str(device)
    name = dev
    if dev.startswith("cuda") and torch.cuda.is_available():
        name = f"{dev} ({torch.cuda.get_device_name(torch.device(dev))})"
    return {
        "polestar_version": package_version(),
        "git_commit": commit,
        "git_dirty": None if dirty is None else bool(dirty),
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": name,
        "threads": torch.get_num_threads(),
        # the threads are recorded once, above, as torch uses them
        "settings": canonical({k: v for k, v in settings.items() if k not in ("plugins", "threads")}),
        "plugins": canonical(settings.get("plugins", {})),
        "command": list(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _flat(manifest: dict[str, Any]) -> dict[str, Any]:
    """The compared entries; the labels are left out, as they follow from the policies and options."""
    flat = {key: manifest.get(key) for key in COMPARED_ENVIRONMENT}
    flat.update({f"settings.{k}": v for k, v in manifest.get("settings", {}).items() if k != "labels"})
    return flat


def manifest_diff(a: dict[str, Any], b: dict[str, Any], ignore: tuple[str, ...] = ()) -> list[str]:
    """``["settings.options: {...} -> {...}", ...]``: the compared entries (environment and settings) whose
    values differ between manifests ``a`` and ``b``, leaving out the keys in ``ignore``."""
    fa, fb = ({k: v for k, v in flat.items() if k not in ignore} for flat in (_flat(a), _flat(b)))
    return settings_diff(fa, fb)
