"""Finished bench items kept on disk, so an interrupted ``polestar bench`` resumes where it stopped.

Beside ``--json OUT.json`` each process appends every finished batch to ``OUT.items.jsonl`` (rank ``r`` of a
multi-process run: ``OUT.items.rank<r>.jsonl``). The first line of a file is a header with the run's settings
(model, task, problems, decoding, options, batch size, dtype, device); ``--resume`` reads every items file of
``OUT``, refuses files written with other settings, and skips the batches whose items are all there. A line cut
short by a kill is ignored.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from polestar.evaluation import distributed


def items_path(json_out: str | Path, rank: int = 0, world_size: int = 1) -> Path:
    """The items file of ``rank`` for ``--json json_out`` (``OUT.items.jsonl`` / ``OUT.items.rank<r>.jsonl``)."""
    json_out = Path(json_out)
    stem = json_out.name[: -len(json_out.suffix)] if json_out.suffix else json_out.name
    tail = "items.jsonl" if world_size == 1 else f"items.rank{rank}.jsonl"
    return json_out.with_name(f"{stem}.{tail}")


def all_items_paths(json_out: str | Path) -> list[Path]:
    """Every items file of ``json_out`` that exists, whatever the number of ranks that wrote it."""
    first = items_path(json_out)
    return sorted(p for p in first.parent.glob(first.name.replace(".items.jsonl", ".items*.jsonl")) if p.is_file())


def _canonical(obj: Any) -> Any:
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


class ItemLog:
    """Append-only log of finished items of one process (see the module docstring)."""

    def __init__(self, json_out: str | Path, header: dict[str, Any], rank: int = 0, world_size: int = 1):
        self.json_out = Path(json_out)
        self.header = _canonical(header)
        self.rank = rank
        self.path = items_path(json_out, rank, world_size)

    def finished(self) -> dict[tuple[str, int], dict]:
        """Records already on disk, keyed by ``(policy, problem index)``; a ValueError when a file was written by a
        run with other settings."""
        out: dict[tuple[str, int], dict] = {}
        for path in all_items_paths(self.json_out):
            lines = path.read_text().splitlines()
            if not lines:
                continue
            try:
                header = json.loads(lines[0]).get("header")
            except json.JSONDecodeError:
                header = None
            if header != self.header:
                diff = sorted(k for k in set(self.header) | set(header or {})
                              if (header or {}).get(k) != self.header.get(k))
                raise ValueError(f"{path} was written by a run with other settings ({', '.join(diff)} differ); "
                                 "rerun with the same settings, or without --resume to start over")
            for line in lines[1:]:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line cut short when the run was killed
                    continue
                out[(rec["policy"], rec["index"])] = rec
        return out

    def start(self, resume: bool) -> None:
        """Open this process's file: without ``resume`` rank 0 first removes every items file of ``json_out`` (all
        ranks wait for it); a new or emptied file starts with the header."""
        if not resume and self.rank == 0:
            for path in all_items_paths(self.json_out):
                path.unlink()
        distributed.barrier()
        if not self.path.exists() or self.path.stat().st_size == 0:
            self.path.write_text(json.dumps({"header": self.header}) + "\n")

    def append(self, records: list[dict]) -> None:
        """Append one finished batch's records and flush them to disk."""
        with self.path.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))
            f.flush()
            os.fsync(f.fileno())


def check_writable(paths: list[str | Path | None]) -> None:
    """Raise one ValueError naming every output path that cannot be written (missing folder, no permission, a
    folder in the way), before any work starts."""
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
        elif not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            bad.append(f"{path} is not writable")
    if bad:
        raise ValueError("cannot write the outputs: " + "; ".join(bad) + " (create the folder or pick another path)")
