"""Every example of the docs (``docs/examples/*.py``, included in docs/policies.md) runs as a script: it registers
its stage or policy, passes the ``polestar.testing`` checks it names and decodes with it."""

import runpy
from pathlib import Path

import pytest

from polestar import policy, registry

EXAMPLES = sorted((Path(__file__).parent.parent / "docs" / "examples").glob("*.py"))

#: what each example registers
REGISTERS = {
    "cluster_stride": ("cluster", "stride"), "commit_same_twice": ("commit", "same-twice"),
    "drift_hellinger": ("drift", "hellinger"), "offload_host": ("offload", "host"), "quant_int8": ("quant", "int8"),
    "refresh_lookahead": ("refresh", "lookahead"), "policy_hellinger": ("policy", "polestar-hellinger"),
}


def test_every_stage_kind_has_an_example():
    assert {kind for kind, _ in REGISTERS.values()} == set(registry.KINDS) | {"policy"}
    assert sorted(p.stem for p in EXAMPLES) == sorted(REGISTERS)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path, isolated_registry, capsys):
    runpy.run_path(str(path), run_name="__main__")
    kind, name = REGISTERS[path.stem]
    assert name in (policy.policy_names() if kind == "policy" else registry.names(kind))
    assert capsys.readouterr().out.strip()
