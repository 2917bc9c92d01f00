"""Finished bench items kept on disk, so an interrupted ``polestar bench`` resumes where it stopped and no finished
item is ever dropped silently.

Beside ``--json OUT.json`` each process appends every finished batch to ``OUT.items.jsonl`` (rank ``r`` of a
multi-process run: ``OUT.items.rank<r>.jsonl``; named from the whole output name, see
:mod:`~polestar.bench.run_files`), one flushed and fsynced write per batch, so a kill loses at most
the batch in flight. The first line of a file is a header with the run's settings (model, task, problems,
decoding, options, batch size, dtype, device). Before any work :func:`check_previous` reads the files already
there: ``--resume`` reuses their items when the headers equal this run's settings (else a usage error naming the
settings that differ); without ``--resume`` finished items are a usage error offering ``--resume`` or
``--overwrite``; ``--overwrite`` moves the old files aside (``*.old-<time>``) and starts over. A line cut short by a
kill is ignored. Summaries and plots are written whole or not at all (:func:`~polestar.output_files.write_atomic`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

from polestar.evaluation import distributed

from .run_files import all_items_paths, items_path


def canonical(obj: Any) -> Any:
    """``obj`` as it reads back from JSON (sorted keys; values JSON cannot hold written as strings)."""
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def _read_file(path: Path) -> tuple[dict | None, list[dict]]:
    """The header and the complete records of one items file (a line cut short by a kill is skipped)."""
    lines = path.read_text().splitlines()
    header, records = None, []
    if lines:
        try:
            header = json.loads(lines[0]).get("header")
        except (json.JSONDecodeError, AttributeError):
            header = None
    for line in lines[1:]:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "policy" in rec and "index" in rec:
            records.append(rec)
    return header, records


class Previous(NamedTuple):
    """What earlier runs left beside ``--json``: the items files, their header (None when no file has one), their
    finished records keyed by ``(policy, problem index)`` and, when ``--resume-any-timing`` reuses records timed
    with other settings, those settings' differences (``["threads: 2 -> 1"]``; empty otherwise)."""

    paths: list[Path]
    header: dict | None
    records: dict[tuple[str, int], dict]
    mixed_timing: tuple[str, ...] = ()

    def counts(self) -> dict[str, int]:
        """Finished records per policy."""
        out: dict[str, int] = {}
        for policy, _ in self.records:
            out[policy] = out.get(policy, 0) + 1
        return out


def read_previous(json_out: str | Path) -> Previous:
    """Every items file of ``json_out`` with its header and finished records; a ValueError when the files were
    written by runs with different settings."""
    paths, header, records = all_items_paths(json_out), None, {}
    for path in paths:
        head, recs = _read_file(path)
        if header is not None and head is not None and head != header:
            raise ValueError(f"the items files of {json_out} were written with different settings ({path}); "
                             "move them aside or pass --overwrite")
        header = header if head is None else head
        records.update({(r["policy"], r["index"]): r for r in recs})
    return Previous(paths, header, records)


#: header entry with the digests of the plugins' source files (:func:`polestar.plugins.plugin_sources`)
PLUGINS = "plugins"


def describe_settings(header: dict) -> str:
    """``model=tiny-llada task=arith n=100 ...``: a header in one line (plugins counted, not listed)."""
    parts = [f"{k}={json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else v}"
             for k, v in sorted(header.items()) if k != PLUGINS]
    if header.get(PLUGINS):
        parts.append(f"plugins={len(header[PLUGINS])} file(s)")
    return " ".join(parts)


def plugin_changes(old: dict | None, new: dict | None) -> list[str]:
    """``["plugin /x/mydrift.py changed (sha256:1a2b3c4d5e6f -> sha256:9f8e7d6c5b4a)", ...]``: how the plugins of
    two headers differ."""
    old, new = old or {}, new or {}
    changes = []
    for path in sorted(set(old) | set(new)):
        if path not in new:
            changes.append(f"plugin {path} was loaded by the earlier run, not by this one")
        elif path not in old:
            changes.append(f"plugin {path} was not loaded by the earlier run")
        elif old[path] != new[path]:
            changes.append(f"plugin {path} changed ({old[path][:19]} -> {new[path][:19]})")
    return changes


#: settings that change how fast a run decodes, not which problems it decodes: ``--resume`` over items timed with
#: other values refuses (their TPS and wall time would blend two setups) unless ``--resume-any-timing``
TIMING_SETTINGS = ("threads", "compile", "device", "dtype", "batch_size")


def timing_settings(header: dict) -> dict[str, Any]:
    """The :data:`TIMING_SETTINGS` of an items header (``compile`` is read from its ``decoding``; a setting an
    older header lacks is None)."""
    values = {key: header.get(key) for key in TIMING_SETTINGS}
    values["compile"] = (header.get("decoding") or {}).get("compile")
    return values


def item_settings(header: dict) -> dict[str, Any]:
    """An items header less its :data:`TIMING_SETTINGS`: the settings that decide which problems are decoded and
    how (model, task, problems, decoding less ``compile``, options) and the plugins."""
    out = {k: v for k, v in header.items() if k not in TIMING_SETTINGS}
    if isinstance(out.get("decoding"), dict):
        out["decoding"] = {k: v for k, v in out["decoding"].items() if k != "compile"}
    return out


def _timing_text(value: Any) -> str:
    return "not recorded" if value is None else json.dumps(value)


def timing_diff(old: dict | None, new: dict) -> list[str]:
    """``["threads: 2 -> 1", ...]``: the :data:`TIMING_SETTINGS` whose values differ between two headers."""
    a, b = timing_settings(old or {}), timing_settings(new)
    return [f"{k}: {_timing_text(a[k])} -> {_timing_text(b[k])}" for k in TIMING_SETTINGS if a[k] != b[k]]


def settings_diff(old: dict | None, new: dict) -> list[str]:
    """``["n: 99 -> 100", ...]``: the settings whose values differ between two headers."""
    old = old or {}
    return [f"{k}: {json.dumps(old.get(k), sort_keys=True)} -> {json.dumps(new.get(k), sort_keys=True)}"
            for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def check_previous(json_out: str | Path, header: dict[str, Any], resume: bool, overwrite: bool,
                   any_timing: bool = False) -> Previous:
    """Decide, before any work, what to do with the items an earlier run left beside ``json_out``.

    Returns the finished records to reuse (``resume`` with equal settings; empty otherwise). Raises ValueError
    (a usage error) for ``resume`` with ``overwrite``, for ``resume`` over files written with other settings
    (naming each setting that differs), for ``resume`` over items timed with other :data:`TIMING_SETTINGS`
    (naming each, with the stored and the new value) unless ``any_timing`` (then the returned
    :class:`Previous` lists them in ``mixed_timing`` when it reuses any record), and for finished items without
    ``resume`` or ``overwrite``.
    """
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other: --resume continues the earlier run, "
                         "--overwrite starts over")
    if any_timing and not resume:
        raise ValueError("--resume-any-timing goes with --resume (it lets a resumed run reuse items timed with "
                         "other threads, compile, device, dtype or batch size); add --resume or drop it")
    prev = read_previous(json_out)
    header = canonical(header)
    if not resume:
        if prev.records and not overwrite:
            raise ValueError(f"{prev.paths[0]} holds {len(prev.records)} finished items of an earlier run; pass "
                             "--resume to continue it, or --overwrite to start over (the old files are kept beside "
                             "the new ones as *.old-<time>)")
        return Previous(prev.paths, prev.header, {})
    if not prev.paths or prev.header == header:
        return prev
    old = prev.header or {}
    settings = settings_diff(*({k: v for k, v in item_settings(h).items() if k != PLUGINS} for h in (old, header)))
    if settings:
        raise ValueError(f"--resume: {prev.paths[0]} was written by a run with other settings "
                         f"({'; '.join(settings)}); rerun with the same settings, or pass --overwrite "
                         "instead of --resume to start over (the old items are kept)")
    changes = plugin_changes(old.get(PLUGINS), header.get(PLUGINS))
    if changes:
        more = f" (and {len(changes) - 1} more)" if len(changes) > 1 else ""
        raise ValueError(f"--resume: {changes[0]}{more} since {prev.paths[0]} was written, so its finished items "
                         "may come from other code; restore the plugin as it was, or pass --overwrite instead "
                         "of --resume to start over (the old items are kept)")
    timing = timing_diff(old, header)
    if timing and not any_timing:
        raise ValueError(f"--resume: the finished items in {prev.paths[0]} were timed with other settings "
                         f"({'; '.join(timing)}), so TPS and wall time would blend two setups; rerun with the "
                         "stored values, or pass --resume-any-timing to reuse them anyway (the summary and "
                         "manifest mark the timings as mixed), or --overwrite instead of --resume to start over")
    return prev._replace(mixed_timing=tuple(timing) if prev.records else ())


def move_aside(paths: list[Path], stamp: str | None = None) -> list[Path]:
    """Rename each existing file of ``paths`` to ``<name>.old-<time>`` beside it (never over another file);
    returns the new paths."""
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S")
    moved = []
    for path in paths:
        if not path.exists():
            continue
        target, k = path.with_name(f"{path.name}.old-{stamp}"), 1
        while target.exists():
            target, k = path.with_name(f"{path.name}.old-{stamp}-{k}"), k + 1
        path.rename(target)
        moved.append(target)
    return moved


class ItemLog:
    """Append-only log of finished items of one process (see the module docstring)."""

    def __init__(self, json_out: str | Path, header: dict[str, Any], rank: int = 0, world_size: int = 1):
        self.json_out = Path(json_out)
        self.header = canonical(header)
        self.rank = rank
        self.path = items_path(json_out, rank, world_size)

    def start(self, previous: Previous, overwrite: bool = False, extra: list[Path] | None = None) -> None:
        """Open this process's file. Rank 0 first moves the earlier files aside (``overwrite``: the items files
        and ``extra``, e.g. the old summary) or removes items files that hold no finished item; every rank waits
        for it. A new or emptied file starts with the header."""
        if self.rank == 0 and not previous.records:
            if overwrite:
                move_aside([*all_items_paths(self.json_out), *(extra or [])])
            else:
                for path in all_items_paths(self.json_out):  # only headers (or cut lines): nothing finished
                    path.unlink()
        distributed.barrier()
        if not self.path.exists() or self.path.stat().st_size == 0:
            with self.path.open("w") as f:
                f.write(json.dumps({"header": self.header}) + "\n")
                f.flush()
                os.fsync(f.fileno())

    def append(self, records: list[dict]) -> None:
        """Append one finished batch's records with one ``write`` call on an ``O_APPEND`` descriptor, then fsync."""
        data = "".join(json.dumps(r) + "\n" for r in records).encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
