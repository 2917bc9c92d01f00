"""The files a command writes: every output path checked before any work (:func:`check_writable`), never inside
the installed package's own source folders (:func:`check_outside_source`), and each summary, table or plot
written whole or not at all (:func:`write_atomic`)."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from functools import cache
from pathlib import Path

#: the packages of the distribution that map to their own source folders (pyproject.toml's ``package-dir``); the
#: subpackages of ``polestar`` (``polestar.evaluation``, ``polestar.tracing``) live inside its folder
SOURCE_PACKAGES = ("polestar", "polestar.policies", "polestar.kernels", "polestar.models", "polestar.bench",
                   "polestar.tasks", "polestar.training")


@cache
def source_folders() -> dict[Path, str]:
    """The folder of each of :data:`SOURCE_PACKAGES` as installed (resolved) → the package it holds."""
    folders = {}
    for name in SOURCE_PACKAGES:
        spec = importlib.util.find_spec(name)
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            folders[Path(location).resolve()] = name
    return folders


def source_folder_of(path: str | Path) -> tuple[Path, str] | None:
    """``(folder, package)`` when ``path`` (resolved; it need not exist) lies inside a source folder of the
    installed package, else None."""
    target = Path(path).expanduser().resolve()
    for folder, package in source_folders().items():
        if target == folder or folder in target.parents:
            return folder, package
    return None


def check_outside_source(paths: list[str | Path | None], what: str = "") -> None:
    """One ValueError naming the first of ``paths`` that lies inside the installed package's source folders
    (:data:`SOURCE_PACKAGES`): files written there become part of the package (and break its layering tests);
    the fix is a scratch folder. ``what``: the flag or argument that named the path, for the message."""
    for p in paths:
        if p is None:
            continue
        found = source_folder_of(p)
        if found is not None:
            folder, package = found
            named = f"{what} {p}" if what else str(p)
            raise ValueError(f"{named} is inside the source folder {folder} of the package {package}; files written "
                             "there become part of the package: write to a scratch folder instead (e.g. runs/, "
                             "which git ignores, or a tempfile.mkdtemp() folder)")


def _umask() -> int:
    """The process's file-creation mask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomic(path: str | Path, data: str | bytes | None = None, writer=None) -> None:
    """Write ``path`` whole or not at all: into a temporary file in the same folder (``data``, or ``writer(tmp)``
    for a file another library writes, e.g. a plot), flushed, then renamed over ``path``. The file gets the
    permissions any tool's new file gets (``0o666`` less the umask, e.g. group- and world-readable under the usual
    022), not the owner-only mode of a temporary file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp" + path.suffix)
    os.chmod(tmp, 0o666 & ~_umask())
    try:
        if writer is None:
            with os.fdopen(fd, "wb") as f:
                f.write(data.encode() if isinstance(data, str) else data)
                f.flush()
                os.fsync(f.fileno())
        else:
            os.close(fd)
            writer(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_writable(paths: list[str | Path | None]) -> None:
    """Raise one ValueError naming every output path that cannot be written (missing folder, no permission, a
    folder in the way, a file system that refuses new files such as /proc), before any work starts: a file is
    created and removed in each folder to find out. A path inside the package's source folders is refused first
    (:func:`check_outside_source`)."""
    check_outside_source(paths)
    bad = []
    for p in paths:
        if p is None:
            continue
        path = Path(p)
        parent = path.parent if str(path.parent) else Path(".")
        if path.is_dir():
            bad.append(f"{path} is a folder")
        elif not parent.is_dir():
            bad.append(f"{path}: folder {parent} does not exist")
        elif path.exists() and not os.access(path, os.W_OK):
            bad.append(f"{path} is not writable")
        else:
            try:
                fd, probe = tempfile.mkstemp(dir=parent, prefix=".polestar-probe-")
                os.close(fd)
                os.unlink(probe)
            except OSError as err:
                bad.append(f"{path}: cannot create files in {parent} ({err.strerror or err})")
    if bad:
        raise ValueError("cannot write the outputs: " + "; ".join(bad) + " (create the folder or pick another path)")
