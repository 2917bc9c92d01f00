"""Stage kinds as records: everything the library knows about a kind, declared once, next to its base class.

A :class:`StageKind` names a kind's base class, its contract (the checks :mod:`polestar.contracts` runs on what
the kind's methods return), the example inputs and the laws of the property tests (:mod:`polestar.testing`) and a
one-line description. The registry's tables (:mod:`polestar.registry`), the contract wrapping
(:func:`polestar.contracts.checked`), :func:`polestar.testing.check_stage`, the registry-parametrized tests and the
docs' list of kinds all read :data:`KINDS`, so a new kind is one module that defines its base class and calls
:func:`register_kind` (see "Adding a stage kind" in the docs' policies page).

The built-in kinds: ``refresh`` and ``commit`` (:mod:`polestar.stages`, the kinds the engine calls every step)
and ``drift``, ``cluster``, ``quant``, ``offload`` (``polestar.policies.*``, composed kinds read by other stages).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import attrs

#: a contract check: ``check(stage, output, *the method's arguments, **its keyword arguments)``, raising
#: :class:`~polestar.contracts.StageContractError` on an output the kind forbids
ContractCheck = Callable[..., None]

#: ``examples(generator, n)``: ``n`` seeded example inputs of the kind, each a tuple of arguments for its laws
ExampleInputs = Callable[[Any, int], Iterable[tuple]]


def _frozen_mapping(value: Mapping[str, ContractCheck]) -> Mapping[str, ContractCheck]:
    return MappingProxyType(dict(value))


@attrs.frozen
class StageKind:
    """One stage kind: what a stage of it is, what it must return and how the property tests exercise it.

    ``name``: the kind's name (the registry's namespace, the policy key, ``kind=name`` overrides); ``base``: the
    base class its stages derive from; ``summary``: one line for the docs; ``engine_driven``: the engine calls a
    stage of this kind every step, so every policy names one (``refresh``, ``commit``); the other kinds are composed
    (a stage reads them through its ``requires``). ``contract``: method name → check of its output (wrapped around a
    stage's method by :func:`polestar.contracts.checked`). ``examples``: seeded example inputs (``examples(gen,
    n)`` yields ``n`` argument tuples) and ``laws(stage, *example)``: the kind's invariants on one example (the
    stage is a fresh instance with its contract checked), asserting with a message that names the stage; a kind
    without them (refresh, commit: their input is a decoding state) is checked inside a decode instead.
    ``default``: the registered name of the stage :func:`polestar.assemble` adds when a chosen stage requires this
    kind (``Stage.requires``) and the policy names none; stated here once for every stage that requires the kind.
    """

    name: str = attrs.field(validator=[attrs.validators.instance_of(str),
                                       attrs.validators.matches_re(r"[a-z][a-z0-9_]*")])
    base: type = attrs.field(validator=attrs.validators.instance_of(type))
    summary: str = attrs.field(validator=attrs.validators.instance_of(str))
    engine_driven: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    contract: Mapping[str, ContractCheck] = attrs.field(factory=dict, converter=_frozen_mapping)
    examples: ExampleInputs | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.is_callable()))
    laws: Callable[..., None] | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.is_callable()))
    default: str | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.instance_of(str)))

    def __attrs_post_init__(self) -> None:
        if (self.examples is None) != (self.laws is None):
            raise ValueError(f"stage kind {self.name!r}: give both examples and laws, or neither")
        for method, check in self.contract.items():
            if not callable(getattr(self.base, method, None)) or not callable(check):
                raise ValueError(f"stage kind {self.name!r}: contract method {method!r} must be a method of "
                                 f"{self.base.__name__} with a callable check")


#: kind name → its record, in registration order (the order kinds are listed in messages)
KINDS: dict[str, StageKind] = {}


def register_kind(kind: StageKind) -> StageKind:
    """Declare ``kind``; returns it. Declaring an equal record again (a re-imported module) keeps it; another record
    under a taken name is a ValueError."""
    taken = KINDS.get(kind.name)
    if taken is not None and taken != kind and _identity(taken.base) != _identity(kind.base):
        raise ValueError(f"stage kind {kind.name!r} is already declared with base class {_identity(taken.base)}")
    KINDS[kind.name] = kind
    return kind


def engine_driven() -> tuple[str, ...]:
    """The kinds every policy names (the engine calls them every step), in declaration order."""
    return tuple(name for name, kind in KINDS.items() if kind.engine_driven)


def _identity(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
