"""Typed registry of pipeline stages: one namespace per stage kind, each name bound to a stage class.

A stage class declares ``Config`` (a frozen attrs class) and is built as ``cls(cls.Config(**options))``.
Lookups happen when a pipeline is assembled, never inside a decoding step.

The registry imports no stage: stage modules register themselves when imported. The built-in stages
(``polestar.policies``) are imported by the package façade ``polestar/__init__.py``, which runs before any
``polestar.*`` module, so they are always registered and the core never imports a policy (no import cycle).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import attrs

KINDS = ("drift", "cluster", "quant", "refresh", "commit", "offload")

T = TypeVar("T")

_REGISTRY: dict[str, dict[str, type]] = {kind: {} for kind in KINDS}


class UnknownNameError(KeyError, ValueError):
    """Raised for a stage or policy name that is not registered; the message lists the registered names."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def register(kind: str, name: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: register a stage class under ``kind`` / ``name``."""
    if kind not in _REGISTRY:
        raise UnknownNameError(f"unknown stage kind {kind!r}; kinds: {', '.join(KINDS)}")

    def deco(cls: type[T]) -> type[T]:
        if not attrs.has(getattr(cls, "Config", None)):
            raise TypeError(f"stage {cls.__name__} must define an attrs 'Config' class")
        existing = _REGISTRY[kind].get(name)
        if existing is not None and existing is not cls:
            raise ValueError(f"{kind} stage {name!r} is already registered by {existing.__name__}")
        _REGISTRY[kind][name] = cls
        cls.kind = kind
        cls.name = name
        return cls

    return deco


def names(kind: str) -> list[str]:
    """Registered names of ``kind``, sorted."""
    if kind not in _REGISTRY:
        raise UnknownNameError(f"unknown stage kind {kind!r}; kinds: {', '.join(KINDS)}")
    return sorted(_REGISTRY[kind])


def lookup(kind: str, name: str) -> type:
    """The stage class registered as ``kind`` / ``name``; an unknown name lists the registered ones."""
    registered = names(kind)
    if name not in _REGISTRY[kind]:
        raise UnknownNameError(f"unknown {kind} stage {name!r}; registered {kind} stages: {', '.join(registered)}")
    return _REGISTRY[kind][name]


def config_fields(kind: str, name: str) -> dict[str, Any]:
    """Field name → default of a stage's config."""
    cls = lookup(kind, name)
    return {f.name: f.default for f in attrs.fields(cls.Config)}


def build(kind: str, name: str, **options: Any):
    """Instantiate stage ``kind``/``name`` with validated config ``options``."""
    cls = lookup(kind, name)
    known = {f.name for f in attrs.fields(cls.Config)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"{kind} stage {name!r} has no option(s) {unknown}; its options: {sorted(known)}")
    return cls(cls.Config(**options))

