"""Stage kinds are records (:mod:`polestar.stage_kinds`): the registry, the contract checks, ``check_stage``, the
property tests and the docs all follow them.

Parametrized from :data:`polestar.stage_kinds.KINDS` and the registry, so a new kind or stage is covered without
editing this file; a kind declared here (``echo``) shows that one record is all ``check_stage`` needs."""

from pathlib import Path

import attrs
import pytest
import torch

from polestar import contracts, registry
from polestar.stage_kinds import KINDS, StageKind, engine_driven, register_kind
from polestar.stages import Stage
from polestar.testing import check_contract, check_stage

ROOT = Path(__file__).resolve().parent.parent

WITH_EXAMPLES = [(kind, name) for kind, record in KINDS.items() if record.examples is not None
                 for name in registry.names(kind)]


@pytest.mark.parametrize("kind, name", WITH_EXAMPLES, ids=[f"{k}:{n}" for k, n in WITH_EXAMPLES])
def test_every_stage_keeps_its_kind_contract_and_laws(kind, name):
    check_contract(kind, name, examples=6)


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_registered_stage_derives_from_its_kind_base(kind):
    for name in registry.names(kind):
        assert issubclass(registry.lookup(kind, name), KINDS[kind].base), f"{kind} stage {name!r}"


def test_the_engine_drives_refresh_and_commit_and_every_policy_names_them():
    from polestar.policy import get_policy, policy_names

    assert engine_driven() == ("refresh", "commit")
    for policy in policy_names():
        assert set(engine_driven()) <= set(get_policy(policy).stages), policy


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_docs_describe_every_kind(kind):
    base = KINDS[kind].base
    assert f"::: {base.__module__}.{base.__qualname__}" in (ROOT / "docs" / "api.md").read_text()
    assert f"(kind `{kind}`)" in (ROOT / "docs" / "policies.md").read_text()


# ------------------------------------------------------------------------------------------- a kind of one's own


class Echo(Stage):
    """Base of the test kind ``echo``: ``echo(x [N])`` → ``x`` itself."""

    def echo(self, x):
        raise NotImplementedError


def check_echo(stage, out, x):
    contracts.expect_tensor(stage, "echo", out, tuple(x.shape), "a tensor shaped like x")


SEEN: list = []


def echo_examples(gen, n):
    for _ in range(n):
        yield (torch.randn(int(torch.randint(1, 9, (1,), generator=gen)), generator=gen),)


def echo_laws(stage, x):
    SEEN.append(x)
    assert torch.equal(stage.echo(x), x), f"echo stage {stage.name!r} changed its input"


@attrs.frozen
class NoOptions:
    pass


def _declare(isolated):
    register_kind(StageKind("echo", Echo, "gives its input back", contract={"echo": check_echo},
                            examples=echo_examples, laws=echo_laws))
    for name, fn in {"good": lambda x: x, "short": lambda x: x[:0], "negated": lambda x: -x}.items():
        registry.register("echo", name)(type(f"Echo_{name}", (Echo,), {"Config": NoOptions,
                                                                         "echo": lambda self, x, _f=fn: _f(x)}))


def test_a_declared_kind_drives_the_contract_and_the_property_checks(isolated_registry):
    with pytest.raises(registry.UnknownNameError, match="kinds: "):
        registry.register("echo", "early")
    _declare(isolated_registry)
    assert registry.names("echo") == ["good", "negated", "short"]
    SEEN.clear()
    check_stage("echo", "good", ["contract", "laws"])
    assert len(SEEN) == 12 + 3  # the contract check's examples, then the pure check's
    with pytest.raises(contracts.StageContractError, match=r"echo stage 'short' \(Echo_short.echo\)"):
        check_stage("echo", "short", ["contract"])
    with pytest.raises(AssertionError, match="echo stage 'negated' fails the contract check: .*changed its input"):
        check_stage("echo", "negated", ["contract"])


def test_a_declared_kind_is_gone_after_an_isolated_test():
    assert "echo" not in KINDS and "echo" not in registry._REGISTRY


def test_a_kind_record_is_checked_when_declared():
    with pytest.raises(ValueError, match="both examples and laws"):
        StageKind("echo", Echo, "x", examples=echo_examples)
    with pytest.raises(ValueError, match="contract method 'score'"):
        StageKind("echo", Echo, "x", contract={"score": check_echo})
    with pytest.raises(ValueError):
        StageKind("Echo kind", Echo, "x")
    with pytest.raises(ValueError, match="already declared"):
        register_kind(StageKind("drift", Echo, "x"))
