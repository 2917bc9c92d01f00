"""Stage overrides as one typed value: which stages to swap in and which stage options to set.

The string forms (``refresh=prefix``, ``commit.threshold=0.8``, ``threshold=0.8``, a trailing ``?`` for an
optional setting) are the syntax of ``--set`` on the command line, of lm-eval's ``set.`` model arguments and of
the keyword overrides of :func:`polestar.generate` / :func:`polestar.assemble`; :meth:`Overrides.parse` is the one
place they are read, and :meth:`Overrides.as_dict` writes them back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from . import registry

OPTIONAL_MARK = "?"  # a key ending in it is optional: it applies only where the policy has the stage or option


@attrs.frozen
class Overrides:
    """Stage swaps and stage options to apply to a policy (see :func:`polestar.assemble`).

    ``swaps``: stage kind -> registered stage name (``refresh=prefix``); ``scoped``: (kind, option) -> value, an
    option of one stage (``commit.threshold=0.8``); ``generic``: option -> value, set on every chosen stage that
    has the option (``threshold=0.8``). ``optional`` holds the names (as :meth:`names` spells them) of the
    settings that apply only where the policy has that stage kind or option; elsewhere they are ignored, never an
    error. A scoped option wins over a generic one on the same stage.
    """

    swaps: Mapping[str, str] = attrs.field(factory=dict, converter=dict)
    scoped: Mapping[tuple[str, str], Any] = attrs.field(factory=dict, converter=dict)
    generic: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)
    optional: frozenset[str] = attrs.field(factory=frozenset, converter=frozenset)

    @optional.validator
    def _check_optional(self, _, value: frozenset[str]) -> None:
        unknown = sorted(value - set(self.names()))
        if unknown:
            raise ValueError(f"optional settings {unknown} are not among the overrides {self.names()}")

    @classmethod
    def parse(cls, overrides: Overrides | Mapping[str, Any] | None) -> Overrides:
        """Read ``{"refresh": "prefix", "commit.threshold": 0.8, "threshold?": 0.9}``: a key that is a stage
        kind swaps that stage, ``kind.option`` sets an option of one stage, a bare ``option`` sets it on every
        stage that has it, and a trailing ``?`` makes the setting optional. An :class:`Overrides` is returned as
        it is. Within one mapping a later spelling of the same setting (``threshold`` then ``threshold?``) wins."""
        if isinstance(overrides, Overrides):
            return overrides
        settings: dict[str, Any] = {}
        optional: set[str] = set()
        for key, value in (overrides or {}).items():
            name = key.rstrip(OPTIONAL_MARK)
            settings[name] = value
            (optional.add if key != name else optional.discard)(name)
        return cls._of(settings, optional)

    @classmethod
    def _of(cls, settings: Mapping[str, Any], optional: set[str] | frozenset[str]) -> Overrides:
        """Overrides from ``name -> value`` (names as :meth:`names` spells them) and the names that are optional."""
        swaps: dict[str, str] = {}
        scoped: dict[tuple[str, str], Any] = {}
        generic: dict[str, Any] = {}
        for name, value in settings.items():
            if name in registry.KINDS:
                swaps[name] = str(value)
            elif "." in name:
                kind, opt = name.split(".", 1)
                scoped[kind, opt] = value
            else:
                generic[name] = value
        return cls(swaps, scoped, generic, optional)

    def names(self) -> list[str]:
        """The settings, spelled as on the command line without the ``?``: swaps, generic, then scoped options."""
        return [*self.swaps, *self.generic, *(f"{kind}.{opt}" for kind, opt in self.scoped)]

    def items(self) -> list[tuple[str, Any]]:
        """``(name, value)`` of every setting, in :meth:`names` order."""
        return list(zip(self.names(), [*self.swaps.values(), *self.generic.values(), *self.scoped.values()]))

    def as_dict(self) -> dict[str, Any]:
        """The overrides in their string form (``{"threshold?": 0.9, "refresh.topk": 2}``), which :meth:`parse`
        reads back to an equal value; what :func:`polestar.generate` takes as keywords."""
        return {name + (OPTIONAL_MARK if name in self.optional else ""): value for name, value in self.items()}

    def merge(self, other: Overrides | Mapping[str, Any]) -> Overrides:
        """These overrides with ``other``'s on top: a setting ``other`` gives, optional or not, replaces this one's
        (a preset's options under the ones asked for explicitly: ``Overrides.parse(preset.options).merge(mine)``)."""
        other = Overrides.parse(other)
        given = set(other.names())
        settings = {name: value for name, value in self.items() if name not in given}
        return Overrides._of({**settings, **dict(other.items())}, (self.optional - given) | other.optional)

    def as_optional(self) -> Overrides:
        """Every setting made optional (one setting given to several policies applies to those that take it)."""
        return attrs.evolve(self, optional=self.names())

    def swaps_only(self) -> Overrides:
        """Only the stage swaps, each as optional as it was."""
        return Overrides(self.swaps, optional=self.optional & set(self.swaps))

    def without(self, name: str) -> Overrides:
        """These overrides less the setting ``name`` (spelled as :meth:`names` spells it)."""
        return Overrides._of({k: v for k, v in self.items() if k != name}, self.optional - {name})

    def swapped(self, optional: bool) -> dict[str, str]:
        """The stage swaps that are optional (``optional=True``) or not: kind -> stage name, in kind order."""
        return {kind: self.swaps[kind] for kind in registry.KINDS
                if kind in self.swaps and (kind in self.optional) == optional}

    def stage_options(self, fields: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
        """The option values for each chosen stage, given each one's config fields (kind -> option -> default):
        the generic options on every stage that has the field, then the scoped ones on their stage."""
        out: dict[str, dict[str, Any]] = {kind: {} for kind in fields}
        for opt, value in self.generic.items():
            for kind in fields:
                if opt in fields[kind]:
                    out[kind][opt] = value
        for (kind, opt), value in self.scoped.items():
            if kind in fields and opt in fields[kind]:
                out[kind][opt] = value
        return out

    def unconsumed(self, fields: Mapping[str, Mapping[str, Any]]) -> list[str]:
        """The options, not optional, that no chosen stage takes (given each one's config fields, kind -> option
        -> default), in :meth:`names` order: each is an unknown option for the policy."""
        generic = [opt for opt in self.generic if not any(opt in options for options in fields.values())]
        scoped = [f"{kind}.{opt}" for kind, opt in self.scoped if kind not in fields or opt not in fields[kind]]
        return [name for name in (*generic, *scoped) if name not in self.optional]
