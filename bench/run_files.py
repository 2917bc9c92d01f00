"""The files one ``polestar bench --json OUT`` run writes, named from the whole output name.

A run's files share its *base*: the ``--json`` name less a final ``.json`` (``r.fd0.7.json`` → ``r.fd0.7``), or the
whole name when it does not end in ``.json`` (``r.fd0.7`` → ``r.fd0.7``). Beside the summary ``OUT`` it writes
``BASE.items.jsonl`` (``BASE.items.rank<r>.jsonl`` per rank of a multi-process run) and ``BASE.manifest.json``, so
the runs of a threshold sweep (``--json r.fd0.7``, ``--json r.fd0.8``) never share an items log or a manifest, as
they would if the name were cut at its first or last dot. :func:`result_files` lists the summaries of a folder
of runs without their manifests.
"""

from __future__ import annotations

import re
from pathlib import Path

#: what a run's own files end with, after its base
ITEMS_SUFFIX = ".items.jsonl"
MANIFEST_SUFFIX = ".manifest.json"


def run_base(json_out: str | Path) -> Path:
    """``--json`` name less a final ``.json``: ``r.fd0.7.json`` → ``r.fd0.7``; ``r.fd0.7`` stays ``r.fd0.7``."""
    json_out = Path(json_out)
    name = json_out.name
    return json_out.with_name(name[: -len(".json")] if name.endswith(".json") and len(name) > 5 else name)


def items_path(json_out: str | Path, rank: int = 0, world_size: int = 1) -> Path:
    """The items file of ``rank`` for ``--json json_out``: ``BASE.items.jsonl``, or ``BASE.items.rank<r>.jsonl``
    in a run of several processes."""
    base = run_base(json_out)
    tail = "items.jsonl" if world_size == 1 else f"items.rank{rank}.jsonl"
    return base.with_name(f"{base.name}.{tail}")


def all_items_paths(json_out: str | Path) -> list[Path]:
    """Every items file of ``json_out`` that exists, whatever the number of ranks that wrote it (and no file of
    another run whose name starts the same way)."""
    base = run_base(json_out)
    pattern = re.compile(re.escape(base.name) + r"\.items(\.rank\d+)?\.jsonl")
    folder = base.parent
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if pattern.fullmatch(p.name) and p.is_file())


def manifest_path(json_out: str | Path) -> Path:
    """``BASE.manifest.json`` beside ``--json json_out``."""
    base = run_base(json_out)
    return base.with_name(base.name + MANIFEST_SUFFIX)


def result_files(directory: str | Path) -> list[Path]:
    """The run summaries (``*.json``) in ``directory``, sorted, without the runs' manifests."""
    return sorted(p for p in Path(directory).glob("*.json") if not p.name.endswith(MANIFEST_SUFFIX) and p.is_file())
