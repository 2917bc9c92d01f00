"""The engine-driven stage kinds keep a narrow interface: a few methods of their own each, every one of which some
built-in stage implements (so none is a hook that the engine calls every step for nobody).

Parametrized from the registry: a new built-in stage counts as soon as it is registered."""

import inspect

import pytest

from polestar import registry
from polestar.stages import CommitRule, LayerHook, RefreshSelector, Stage

#: the most public methods a kind's base class may define beyond :class:`Stage`'s lifecycle
MOST_OWN_METHODS = 6


def own_methods(base: type) -> list[str]:
    """Public methods ``base`` defines beyond :class:`Stage` (``plan``-like abstract ones included)."""
    return sorted(name for name, value in vars(base).items()
                  if inspect.isfunction(value) and not name.startswith("_") and not hasattr(Stage, name))


@pytest.mark.parametrize("base", [RefreshSelector, CommitRule], ids=lambda b: b.__name__)
def test_each_engine_driven_kind_defines_few_methods_of_its_own(base):
    assert 1 <= len(own_methods(base)) <= MOST_OWN_METHODS, own_methods(base)


@pytest.mark.parametrize("kind, base", [("refresh", RefreshSelector), ("commit", CommitRule)],
                         ids=["refresh", "commit"])
def test_every_method_of_a_kind_is_implemented_by_a_built_in_stage(kind, base):
    built_in = [registry.lookup(kind, name) for name in registry.names(kind)
                if registry.lookup(kind, name).__module__.startswith("polestar.")]
    unused = [m for m in own_methods(base)
              if not any(getattr(cls, m) is not getattr(base, m) for cls in built_in)]
    assert unused == []


def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _subclasses(sub)
    return out


def test_every_optional_hook_method_is_implemented_by_a_built_in_hook():
    registry.names("refresh")  # the built-in stages (and their hooks) are imported
    hooks = [c for c in _subclasses(LayerHook) if c.__module__.startswith("polestar.")]
    defaults = [name for name, value in vars(LayerHook).items() if inspect.isfunction(value)]
    assert defaults, "LayerHook has no default methods"
    unused = [m for m in defaults if not any(getattr(c, m) is not getattr(LayerHook, m) for c in hooks)]
    assert unused == []


def test_a_required_kinds_default_is_declared_once_on_the_kind():
    """A stage names the kinds it requires; the stage added where a policy names none is the kind's declared
    default, a registered stage of that kind."""
    from polestar.stage_kinds import KINDS

    for kind in registry.KINDS:
        for name in registry.names(kind):
            requires = registry.lookup(kind, name).requires
            assert isinstance(requires, tuple), f"{kind} {name!r}: requires is a tuple of kinds"
            for need in requires:
                assert KINDS[need].default in registry.names(need), (kind, name, need)


def test_composition_adds_the_required_defaults():
    from polestar.policy import assemble, composition, get_policy

    assert set(get_policy("polestar").stages) == {"refresh", "commit"}
    assert composition("polestar") == {"refresh": "polestar", "commit": "polestar", "drift": "kl",
                                       "cluster": "kmeans", "quant": "none", "offload": "none"}
    assert composition("polestar-commit") == {"refresh": "dual", "commit": "polestar", "drift": "kl"}
    for policy in ("polestar", "polestar-commit", "fast-dllm"):
        assert {k: s.name for k, s in assemble(policy).stages.items()} == composition(policy)


def test_a_required_kind_without_a_default_is_one_clear_error(monkeypatch):
    from polestar import policy

    class NeedsGauge:
        requires = ("gauge",)

    monkeypatch.setattr(policy.registry, "lookup", lambda kind, name: NeedsGauge)
    with pytest.raises(ValueError, match=r"commit stage 'x' requires a 'gauge' stage .* \(gauge=NAME\)"):
        policy._add_required({"commit": "x"})
