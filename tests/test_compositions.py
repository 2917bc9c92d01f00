"""Every refresh × commit pair of the registry either decodes (LLaDA and Dream, batch 1 and 2) or is refused by
``assemble`` before any work, in one line naming both stages; the docs' table is the registry's."""

import itertools
from pathlib import Path

import pytest

import polestar
from polestar import registry
from polestar.policy import assemble, composition_matrix, composition_table
from polestar.testing import tiny_model

PROMPTS = [[5, 17, 3, 8], [9, 1, 22, 30, 4, 11]]
PAIRS = sorted(composition_matrix(builtin_only=True))
_MODELS: dict = {}


def _model(family: str):
    if family not in _MODELS:
        _MODELS[family] = tiny_model(family, seed=3, n_layers=2)
    return _MODELS[family]


@pytest.mark.parametrize("refresh, commit", PAIRS, ids=[f"{r}+{c}" for r, c in PAIRS])
def test_every_pair_decodes_or_is_refused_at_assembly(refresh, commit):
    refusal = composition_matrix(builtin_only=True)[(refresh, commit)]
    if refusal is not None:
        with pytest.raises(ValueError) as err:
            assemble("fast-dllm", {"refresh": refresh, "commit": commit})
        message = str(err.value)
        assert message == refusal and "\n" not in message
        assert f"commit stage {commit!r}" in message and f"refresh stage {refresh!r}" in message
        return
    for family, batch in itertools.product(("llada", "dream"), (1, 2)):
        pipeline = assemble("fast-dllm", {"refresh": refresh, "commit": commit})
        out = polestar.generate(_model(family), PROMPTS[:batch], policy=pipeline, gen_length=16, block_length=8)
        assert out.tokens.shape[0] == batch and not out.stats.errors


def test_the_cli_refuses_a_pair_before_loading_the_model(capsys):
    from polestar.cli import main

    assert main(["generate", "--model", "tiny-llada-noisy", "--task", "arith", "--prompt", "4+6-1+3", "--policy",
                 "elastic-cache", "--set", "commit=polestar"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "[model]" not in err
    assert "commit stage 'polestar' cannot decode with refresh stage 'elastic'" in err


def test_at_least_one_pair_is_refused_and_most_decode():
    matrix = composition_matrix(builtin_only=True)
    refused = {pair for pair, why in matrix.items() if why is not None}
    assert ("dllm-cache", "polestar") in refused and ("elastic", "polestar") in refused
    assert len(refused) < len(matrix) // 4


def test_the_docs_show_the_registrys_table():
    page = (Path(__file__).parent.parent / "docs" / "policies.md").read_text()
    shown = page.split("<!-- composition-table -->\n", 1)[1].split("\n<!-- /composition-table -->", 1)[0]
    assert shown == composition_table(), "regenerate the table with polestar.policy.composition_table()"


def test_a_plugin_commit_rule_that_needs_a_probe_is_refused_with_dllm_cache(isolated_registry):
    from polestar.policies.commit_basic import ThresholdCommit
    from polestar.stages import Capability

    @registry.register("commit", "probe-reader")
    class ProbeReader(ThresholdCommit):
        """A threshold rule declaring that it reads the forward's attention probe."""

        needs = frozenset({Capability.ATTENTION_PROBE})

    with pytest.raises(ValueError, match="commit stage 'probe-reader' cannot decode with refresh stage 'dllm-cache'"):
        assemble("dllm-cache", {"commit": "probe-reader"})
    assert assemble("fast-dllm", {"commit": "probe-reader"}).stages["commit"].name == "probe-reader"
