"""Named policies: compositions of stages with their options, and their assembly into a pipeline."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import attrs

from . import contracts, registry
from .overrides import Overrides
from .registry import UnknownNameError
from .stage_kinds import KINDS, engine_driven
from .stages import Capability


@attrs.frozen
class PolicySpec:
    """A named composition: which stage of each kind, with which options, plus a one-line description."""

    name: str
    stages: dict[str, str]
    options: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    description: str = ""


_POLICIES: dict[str, PolicySpec] = {}


_ORIGINS: dict[str, str] = {}  # policy name -> module that registered it


def register_policy(spec: PolicySpec) -> PolicySpec:
    """Add ``spec`` under ``spec.name``. Registering a name again from the same module (a notebook cell or a
    plugin re-run) replaces it, and so does an identical spec from anywhere; a different spec from another
    module under a taken name is a ValueError naming both modules."""
    for kind in spec.stages:
        if kind not in registry.KINDS:
            raise ValueError(f"policy {spec.name!r}: unknown stage kind {kind!r}")
    origin = sys._getframe(1).f_globals.get("__name__", "?")
    taken = _POLICIES.get(spec.name)
    if taken is not None and taken != spec and _ORIGINS.get(spec.name) != origin:
        raise ValueError(f"policy {spec.name!r} is already registered by {_ORIGINS.get(spec.name)} with other "
                         f"stages or options; register yours ({origin}) under another name")
    _POLICIES[spec.name] = spec
    _ORIGINS[spec.name] = origin
    return spec


def policy_names() -> list[str]:
    return sorted(_POLICIES)


def get_policy(name: str) -> PolicySpec:
    names = policy_names()
    if name not in _POLICIES:
        raise UnknownNameError(f"unknown policy {name!r}{registry.did_you_mean(name, names)}; registered policies: "
                               f"{', '.join(names)}")
    return _POLICIES[name]


def composition(name: str) -> dict[str, str]:
    """Every stage of policy ``name`` by kind, as :func:`assemble` builds it without overrides: the policy's own
    stages and the defaults of the kinds they require (:attr:`~polestar.stage_kinds.StageKind.default`)."""
    chosen = dict(get_policy(name).stages)
    _add_required(chosen)
    return chosen


@attrs.frozen
class Pipeline:
    """The assembled stages of one policy: ``stages[kind]`` is a stage instance."""

    policy: str
    stages: dict[str, Any]

    @property
    def refresh(self):
        return self.stages["refresh"]

    @property
    def commit(self):
        return self.stages["commit"]

    def describe(self) -> dict[str, Any]:
        return {kind: {"name": st.name, **attrs.asdict(st.config)} for kind, st in self.stages.items()}


def assemble(policy: str, overrides: Overrides | Mapping[str, Any] | None = None,
             check_stages: bool | None = None) -> Pipeline:
    """Build the stages of ``policy`` with ``overrides``: an :class:`~polestar.overrides.Overrides`, or a mapping
    in its string form, read by :meth:`Overrides.parse <polestar.overrides.Overrides.parse>`.

    An override whose key is a stage kind (``refresh=elastic``) swaps that stage; ``kind.option=value`` sets an
    option of one stage; a bare ``option=value`` sets that option on every stage that has it (``kind.option``
    wins over it on that stage). Options no stage has are an error that lists the valid ones. A key ending in
    ``?`` is optional: ``quant?=none`` swaps the stage only in a policy that has a ``quant`` stage,
    ``refresh.topk?=8`` and ``threshold?=0.8`` set the option only where a stage has it, and neither is an error
    elsewhere (``polestar bench`` passes ``--set`` this way, so one setting can apply to several policies). A swap
    of a composed kind (drift, cluster, quant, offload) that no stage of the policy reads is an error naming the
    stages that would read it. Stages from outside the package (plugins, entry points, your own classes) have
    every output checked against their kind's contract (:mod:`polestar.contracts`; with ``compile=True`` on the
    first step of each step phase, which runs eagerly, and the rest of the decode compiles unchecked);
    ``check_stages=True`` (or the environment variable ``POLESTAR_CHECK_STAGES=1``) checks the built-in stages
    too, ``check_stages=False`` (``=0``) none.
    """
    spec = get_policy(policy)
    overrides = Overrides.parse(overrides)
    chosen = dict(spec.stages)
    swapped = overrides.swapped(optional=False)
    chosen.update(swapped)
    _add_required(chosen)
    for kind in swapped:
        _check_consumed(policy, kind, chosen)
    for kind, name in overrides.swapped(optional=True).items():  # only in a policy that has this stage
        if kind in chosen:
            chosen[kind] = name
    _add_required(chosen)
    refusal = composition_refusal(chosen.get("refresh"), chosen.get("commit"))
    if refusal is not None:
        raise ValueError(refusal)
    fields = {kind: registry.config_fields(kind, name) for kind, name in chosen.items()}
    unknown = overrides.unconsumed(fields)
    if unknown:
        raise ValueError(_unknown_option(unknown[0], fields))
    given = overrides.stage_options(fields)
    options = {kind: {**(spec.options.get(kind, {}) if chosen[kind] == spec.stages.get(kind) else {}), **given[kind]}
               for kind in chosen}
    stages = {kind: registry.build(kind, name, **options[kind]) for kind, name in chosen.items()}
    stages = {kind: contracts.checked(stage) if contracts.wanted(stage, check_stages) else stage
              for kind, stage in stages.items()}
    for stage in stages.values():
        stage.bind(stages)
    return Pipeline(policy, stages)


def composition_refusal(refresh: str | None, commit: str | None) -> str | None:
    """Why refresh stage ``refresh`` and commit stage ``commit`` cannot decode together (one line naming both and
    the reason), or None when they can: the commit rule needs a :class:`~polestar.stages.Capability` the selector
    does not serve (:attr:`~polestar.stages.CommitRule.needs`, :attr:`~polestar.stages.RefreshSelector.not_served`)."""
    if refresh is None or commit is None:
        return None
    selector, rule = registry.lookup("refresh", refresh), registry.lookup("commit", commit)
    missing = [c for c in Capability if c in rule.needs and c in selector.not_served]
    if not missing:
        return None
    need = missing[0]
    return (f"commit stage {commit!r} cannot decode with refresh stage {refresh!r}: it needs {need.value}, which "
            f"{refresh!r} does not serve ({selector.not_served[need]}); pick another commit rule or refresh stage")


def composition_matrix(builtin_only: bool = False) -> dict[tuple[str, str], str | None]:
    """Every registered (refresh, commit) pair → its :func:`composition_refusal` (None: they decode together);
    ``builtin_only``: the package's own stages only (not plugins')."""
    def names(kind: str) -> list[str]:
        return [n for n in registry.names(kind)
                if not builtin_only or registry.is_builtin(registry.lookup(kind, n))]

    return {(r, c): composition_refusal(r, c) for r in names("refresh") for c in names("commit")}


def composition_table(builtin_only: bool = True) -> str:
    """:func:`composition_matrix` as a Markdown table (refresh stages as rows, commit rules as columns: "yes", or
    "no" with the missing :class:`~polestar.stages.Capability`), the one the docs show (the package's own stages;
    ``builtin_only=False`` adds plugins')."""
    matrix = composition_matrix(builtin_only)
    commits = sorted({c for _, c in matrix})
    refreshes = sorted({r for r, _ in matrix})
    needs = {c: [cap for cap in Capability if cap in registry.lookup("commit", c).needs] for c in commits}

    def cell(r: str, c: str) -> str:
        if matrix[(r, c)] is None:
            return "yes"
        missing = [cap for cap in needs[c] if cap in registry.lookup("refresh", r).not_served]
        return "no: " + ", ".join(cap.name.lower().replace("_", " ") for cap in missing)

    lines = ["| refresh \\ commit | " + " | ".join(f"`{c}`" for c in commits) + " |",
             "|---|" + "---|" * len(commits)]
    lines += [f"| `{r}` | " + " | ".join(cell(r, c) for c in commits) + " |" for r in refreshes]
    return "\n".join(lines)


def _add_required(chosen: dict[str, str]) -> None:
    """Add, in place, the default stage (:attr:`~polestar.stage_kinds.StageKind.default`) of every kind a chosen
    stage requires and the policy lacks; a required kind without a default that the policy lacks is a ValueError."""
    pending = list(chosen.items())
    while pending:
        kind, name = pending.pop()
        for need in registry.lookup(kind, name).requires:
            if need in chosen:
                continue
            record = KINDS.get(need)
            if record is None or record.default is None:
                why = "is not a declared stage kind" if record is None else "declares no default stage"
                raise ValueError(f"{kind} stage {name!r} requires a {need!r} stage and {need!r} {why}: name one in "
                                 f"the policy or the overrides ({need}=NAME), or declare the kind with "
                                 f"StageKind(..., default=NAME)")
            chosen[need] = record.default
            pending.append((need, record.default))


def _check_consumed(policy: str, kind: str, chosen: dict[str, str]) -> None:
    """A swapped-in stage of a composed kind (drift, cluster, quant, offload) must be read by a chosen stage: one
    ValueError naming the policy's stages and the registered stages that would read it."""
    if kind in engine_driven():
        return
    if any(kind in registry.lookup(k, n).requires for k, n in chosen.items() if k != kind):
        return
    readers = [f"{k} {n!r}" for k in registry.KINDS for n in registry.names(k)
               if kind in registry.lookup(k, n).requires]
    own = ", ".join(f"{k} {chosen[k]!r}" for k in engine_driven() if k in chosen)
    raise ValueError(f"{kind}={chosen[kind]}: no stage of policy {policy!r} reads a {kind} stage ({own} do not); "
                     f"stages that read one: {', '.join(readers) or 'none'} (swap one of them in, or pick a policy "
                     "that has one)")


def _unknown_option(key: str, fields: dict[str, dict[str, Any]]) -> str:
    valid = sorted({opt for f in fields.values() for opt in f} | {f"{k}.{o}" for k, f in fields.items() for o in f})
    return (f"unknown option {key!r} for this policy{_elsewhere(key, fields) or registry.did_you_mean(key, valid)}; "
            f"valid options: {', '.join(valid) or 'none'} (or a stage kind: {', '.join(registry.KINDS)})")


def _elsewhere(key: str, fields: dict[str, dict[str, Any]]) -> str:
    """Where an option ``kind.option`` the policy's ``kind`` stage lacks lives: `` ('tau' is an option of the
    drift stage 'peakjs': select it with --set drift=peakjs)``, or "" (no registered stage of that kind has it)."""
    kind, _, option = key.partition(".")
    if not option or kind not in registry.KINDS:
        return ""
    owners = [name for name in registry.names(kind)
              if option in attrs.fields_dict(registry.lookup(kind, name).Config)]
    chosen = fields.get(kind)
    if not owners or (chosen is not None and option in chosen):
        return ""
    which = " or ".join(repr(n) for n in owners)
    return f" ({option!r} is an option of the {kind} stage {which}: select that stage, {kind}={owners[0]})"
