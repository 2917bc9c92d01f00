"""The entries of ``--policies``: a registered policy, optionally with options of its own.

``polestar bench --policies "polestar,polestar[drift=peakjs],fast-dllm"`` compares one policy with two drift
metrics in one table: an entry is a policy name with ``[key=value,...]`` settings that apply to that entry only (the
syntax of ``--set``, values read as ``--set`` reads them), on top of the run's ``--set`` options (which apply to
every entry whose stages take them). The bench table labels each row with its policy and every setting applied to
it (:meth:`BenchEntry.label`), and that label is itself an entry ``--policies`` accepts.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from polestar.overrides import Overrides


class BenchEntry(NamedTuple):
    """One ``--policies`` entry: ``policy`` (a registered name) and ``own`` (its bracketed settings, ``{key:
    value}``, every one required to apply); ``text`` is the entry's canonical spelling (settings in key order),
    which keys the run's summary and items."""

    policy: str
    own: dict
    text: str

    def overrides(self, shared: dict[str, Any]) -> dict[str, Any]:
        """The overrides this entry decodes with: the run's ``--set`` options ``shared`` as optional settings
        (each applies where a stage takes it), the entry's own on top as required ones."""
        return Overrides.parse(shared).as_optional().merge(self.own).as_dict()

    def label(self, applied_shared: dict[str, Any]) -> str:
        """``policy[k=v,...]`` over ``applied_shared`` (the ``--set`` options that apply to this entry) and the
        entry's own settings (which win), in key order; the bare policy name without any."""
        return spell(self.policy, {**applied_shared, **self.own})


def value_text(value: Any) -> str:
    """A setting's value as ``--set`` spells it (strings bare, everything else as JSON)."""
    return value if isinstance(value, str) else json.dumps(value)


def spell(policy: str, settings: dict[str, Any]) -> str:
    """``policy[k=v,...]`` in key order, or ``policy`` without settings."""
    if not settings:
        return policy
    return f"{policy}[{','.join(f'{k}={value_text(settings[k])}' for k in sorted(settings))}]"


def split_entries(text: str) -> list[str]:
    """``"a,b[x=1,y=2],c"`` → ``["a", "b[x=1,y=2]", "c"]``: commas inside brackets belong to the entry."""
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        depth += (ch == "[") - (ch == "]")
        current.append(ch)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def parse_entry(text: str, parse_value) -> BenchEntry:
    """``"polestar[drift=peakjs,commit.threshold=0.8]"`` → :class:`BenchEntry` (``parse_value``: how ``--set``
    reads a value). A malformed entry is a ValueError that shows the expected form."""
    text = text.strip()
    name, bracket, rest = text.partition("[")
    name = name.strip()
    own: dict[str, Any] = {}
    if bracket:
        if not rest.endswith("]") or "[" in rest[:-1] or "]" in rest[:-1]:
            raise ValueError(f"--policies entry {text!r} is malformed; write NAME[KEY=VALUE,...], "
                             f"e.g. polestar[drift=kl]")
        for item in filter(None, (s.strip() for s in rest[:-1].split(","))):
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"--policies entry {text!r}: {item!r} is not KEY=VALUE; e.g. polestar[drift=kl]")
            own[key.strip()] = parse_value(value.strip())
    elif "]" in text:
        raise ValueError(f"--policies entry {text!r} is malformed; write NAME[KEY=VALUE,...], e.g. polestar[drift=kl]")
    return BenchEntry(name, own, spell(name, own))
