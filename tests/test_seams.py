"""The seams stages plug into: a swap no stage of the policy reads is refused, naming who would read it; checks
across a stage's options live in its own Config."""

import pytest

import polestar
from polestar import registry
from polestar.cli import main


@pytest.mark.parametrize("kind,name", [("drift", "js"), ("cluster", "chunks"), ("quant", "fp8"), ("offload", "cpu")])
def test_a_swap_nothing_reads_is_an_error(kind, name):
    readers = [f"{k} {n!r}" for k in registry.KINDS for n in registry.names(k)
               if kind in registry.lookup(k, n).requires]
    with pytest.raises(ValueError) as err:
        polestar.assemble("fast-dllm", {kind: name})
    message = str(err.value)
    assert f"{kind}={name}: no stage of policy 'fast-dllm' reads a {kind} stage" in message
    assert "refresh 'dual', commit 'threshold'" in message
    assert readers and all(r in message for r in readers)
    # the same swap where a stage reads it, and an optional swap where none does, are fine
    assert polestar.assemble("polestar", {kind: name}).stages[kind].name == name
    assert kind not in polestar.assemble("fast-dllm", {kind + "?": name}).stages


def test_a_swap_nothing_reads_is_a_usage_error(capsys):
    assert main(["generate", "--prompt", "3+4", "--policy", "fast-dllm", "--set", "drift=js"]) == 2
    assert "no stage of policy 'fast-dllm' reads a drift stage" in capsys.readouterr().err


def test_cross_option_rules_live_in_the_stage_config():
    with pytest.raises(ValueError, match="refresh stage 'polestar': topk \\(9\\) cannot exceed n_clusters \\(8\\)"):
        polestar.assemble("polestar", {"refresh.topk": 9})
    with pytest.raises(ValueError, match="topk_last \\(3\\) cannot exceed n_clusters \\(2\\)"):
        registry.build("refresh", "polestar", n_clusters=2, topk=2, topk_last=3)
    stage = polestar.assemble("polestar", {"refresh.topk": 12, "refresh.n_clusters": 16}).refresh
    assert (stage.config.topk, stage.config.n_clusters) == (12, 16)
    assert not hasattr(polestar.policy, "OPTION_RULES")
