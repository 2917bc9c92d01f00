"""Typed registry of pipeline stages: one namespace per stage kind, each name bound to a stage class.

The kinds are the :class:`~polestar.stage_kinds.StageKind` records of :data:`KINDS` (declared next to each kind's
base class); a kind's table holds the stages registered under it.

A stage class declares ``Config`` (a frozen attrs class) and is built as ``cls(cls.Config(**options))``.
Lookups happen when a pipeline is assembled, never inside a decoding step.

The registry imports no stage: stage modules register themselves when imported. The built-in stages
(``polestar.policies``) are imported by the package façade ``polestar/__init__.py``, which runs before any
``polestar.*`` module, so they are always registered and the core never imports a policy (no import cycle).
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import attrs

from .stage_kinds import KINDS

T = TypeVar("T")

#: kind → name → stage class (a kind's table is created by the first stage registered under it)
_REGISTRY: dict[str, dict[str, type]] = {}


class UnknownNameError(KeyError, ValueError):
    """Raised for a stage or policy name that is not registered; the message lists the registered names."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def did_you_mean(name: str, candidates) -> str:
    """`` (did you mean 'x'?)`` for the candidates closest to ``name`` (``_`` and ``-`` and case read alike), or ""
    when none is close: the hint an unknown name's error ends with."""
    def norm(text: str) -> str:
        return text.lower().replace("_", "-")

    by_norm = {norm(c): c for c in candidates}
    close = difflib.get_close_matches(norm(name), list(by_norm), n=3, cutoff=0.7)
    if not close:
        return ""
    return f" (did you mean {' or '.join(repr(by_norm[c]) for c in close)}?)"


def register(kind: str, name: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: register a stage class under ``kind`` / ``name``.

    Registering a class with the same module and qualified name again (a re-run notebook cell) replaces the
    registered one; another class under a taken name raises ValueError naming both."""
    _known_kind(kind)

    def deco(cls: type[T]) -> type[T]:
        if not attrs.has(getattr(cls, "Config", None)):
            raise TypeError(f"stage {cls.__name__} must define an attrs 'Config' class")
        table = _REGISTRY.setdefault(kind, {})
        existing = table.get(name)
        if existing is not None and _identity(existing) != _identity(cls):
            raise ValueError(f"{kind} stage {name!r} is already registered by {_identity(existing)}; "
                             f"register {_identity(cls)} under another name")
        table[name] = cls
        cls.kind = kind
        cls.name = name
        return cls

    return deco


#: the package's own top-level module: a stage class defined under it is a built-in stage
PACKAGE = "polestar"


def is_builtin(cls: type) -> bool:
    """Whether stage class ``cls`` ships with the package (its module is ``polestar`` or under it); a stage of a
    plugin file, an installed entry point, a notebook or a test is not."""
    module = getattr(cls, "__module__", None) or ""
    return module == PACKAGE or module.startswith(PACKAGE + ".")


def source_file(obj) -> str | None:
    """The source file a class or module was loaded from (resolved), or None (a notebook cell, a built-in).

    For a class, the file its methods were compiled from, so a class defined by a script run as ``__main__``
    (``runpy``, ``python mydrift.py``) names that script, not the process's main module."""
    if isinstance(obj, ModuleType):
        path = getattr(obj, "__file__", None)
    else:
        codes = [getattr(v, "__code__", None) for v in vars(obj).values()]
        path = next((c.co_filename for c in codes if c is not None), None)
        if path is None:
            path = getattr(sys.modules.get(obj.__module__), "__file__", None)
    if not path or not Path(path).is_file():
        return None
    return str(Path(path).resolve())


def _identity(cls: type) -> str:
    """``module.qualname`` of a stage class: the same class defined again (a notebook cell or a plugin run twice)
    has the same identity and replaces the registered one; a different class under a taken name is an error."""
    return f"{cls.__module__}.{cls.__qualname__}"


def names(kind: str) -> list[str]:
    """Registered names of ``kind``, sorted."""
    _known_kind(kind)
    return sorted(_REGISTRY.get(kind, {}))


def _known_kind(kind: str) -> None:
    """An undeclared kind is an :class:`UnknownNameError` listing the declared ones."""
    if kind not in KINDS:
        raise UnknownNameError(f"unknown stage kind {kind!r}{did_you_mean(kind, KINDS)}; kinds: {', '.join(KINDS)}")


def lookup(kind: str, name: str) -> type:
    """The stage class registered as ``kind`` / ``name``; an unknown name lists the registered ones."""
    registered = names(kind)
    if name not in registered:
        raise UnknownNameError(f"unknown {kind} stage {name!r}{did_you_mean(name, registered)}; registered {kind} "
                               f"stages: {', '.join(registered)}")
    return _REGISTRY[kind][name]


def config_fields(kind: str, name: str) -> dict[str, Any]:
    """Field name → default of a stage's config."""
    cls = lookup(kind, name)
    return {f.name: f.default for f in attrs.fields(cls.Config)}


def build(kind: str, name: str, **options: Any):
    """Instantiate stage ``kind``/``name`` with validated config ``options``.

    A bad value raises one ValueError naming the stage, the option, the value and what the option accepts
    (its type and range, read from the config field's annotation and attrs validators).
    """
    cls = lookup(kind, name)
    fields = {f.name: f for f in attrs.fields(cls.Config)}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ValueError(f"{kind} stage {name!r} has no option(s) {unknown}; its options: {sorted(fields)}")
    for key, value in options.items():
        _check_option(kind, name, fields[key], value)
    try:
        config = cls.Config(**options)
    except (TypeError, ValueError) as err:  # a check across options (the Config's own __attrs_post_init__)
        raise ValueError(f"{kind} stage {name!r}: {_one_line(err)}") from None
    return cls(config)


def describe_option(field: attrs.Attribute) -> str:
    """What a config field accepts, e.g. ``"an integer >= 1"`` or ``"a number >= 0.0 and <= 1.0"``."""
    type_name, optional = _optional_type(_type_name(field))
    text = _TYPE_WORDS.get(type_name, f"a {type_name}" if type_name else "a value")
    if optional:
        text += " (or null)"
    bounds, choices = [], None
    for validator in _flatten(field.validator):
        if type(validator).__name__ == "_NumberValidator":
            bounds.append(f"{validator.compare_op} {validator.bound}")
        elif type(validator).__name__ == "_InValidator":
            choices = ", ".join(map(repr, validator.options))
    if choices:
        return f"one of {choices}"
    return text + (" " + " and ".join(bounds) if bounds else "")


_TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


def _type_name(field: attrs.Attribute) -> str:
    """The field's annotated type as written (``"float"``, ``"bool | None"``); for a field without an annotation,
    the type of its default when that is a plain int, float, bool or str (so a typo'd option is still named)."""
    t = field.type
    if t is None:
        default = field.default
        return type(default).__name__ if type(default) in (int, float, bool, str) else ""
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def _optional_type(type_name: str) -> tuple[str, bool]:
    """``"bool | None"`` / ``"Optional[bool]"`` → ``("bool", True)``; ``"float"`` → ``("float", False)``."""
    name = type_name.replace(" ", "")
    if name.startswith("Optional[") and name.endswith("]"):
        return name[len("Optional["):-1], True
    parts = name.split("|")
    if len(parts) == 2 and "None" in parts:
        return next(p for p in parts if p != "None"), True
    return type_name, False


def _flatten(validator) -> list:
    if validator is None:
        return []
    inner = getattr(validator, "_validators", None)
    if inner is not None:
        return [x for v in inner for x in _flatten(v)]
    return [validator]


def _type_ok(type_name: str, value: Any) -> bool:
    type_name, optional = _optional_type(type_name)
    if optional and value is None:
        return True
    if type_name == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if type_name == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if type_name == "bool":
        return isinstance(value, bool)
    if type_name == "str":
        return isinstance(value, str)
    return True


def _check_option(kind: str, name: str, field: attrs.Attribute, value: Any) -> None:
    """Type and range of one option, checked on its own with the field's validator (checks across options run when
    the whole Config is built) so the error names it."""
    where = f"option {field.name!r} of {kind} stage {name!r}"
    if not _type_ok(_type_name(field), value):
        raise ValueError(f"{where} must be {describe_option(field)}; got {value!r} ({type(value).__name__})")
    if field.validator is None:
        return
    try:
        field.validator(None, field, field.converter(value) if field.converter is not None else value)
    except (TypeError, ValueError) as err:  # attrs' own validators put a tuple in a TypeError: keep its text
        text = " ".join((err.args[0] if err.args and isinstance(err.args[0], str) else str(err)).split())
        # the type is right, so the value itself is refused: a number out of its range, or another value
        what = "is out of range" if isinstance(value, (int, float)) and not isinstance(value, bool) else "is refused"
        raise ValueError(f"{where}: {value!r} {what} ({text})") from None


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())

