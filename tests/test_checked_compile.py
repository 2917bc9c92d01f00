"""A stage from outside the package is contract-checked and takes the same compiled route as a built-in one: its
code runs as Python in every step (never traced), the layer regions are compiled, and the tokens are eager
decoding's. A plugin that breaks its contract fails with the contract error; where a step cannot be captured as a
CUDA graph (a stage declares ``compilable = False``) one log line says why and the steps run uncaptured.

The compiled runs here use dynamo's ``"eager"`` backend for the regions (``fullgraph=True``, no code generated:
seconds); the last test compiles with inductor through the command line, as a user would."""

import json
import logging
import re
from pathlib import Path

import pytest

import polestar
from polestar import compile_off, contracts, plugins
from polestar.config import GenerationConfig
from polestar.contracts import StageContractError
from polestar.engine import decode
from polestar.policy import assemble
from polestar.step import StepRunner, pipeline_compilable, taped_step_graphs
from tests.conftest import make_model
from tests.test_plugins import HELLINGER
from tests.test_stage_checks import BROKEN, NAN_LINE

EXAMPLES = Path(__file__).parent.parent / "docs" / "examples"
PROMPTS = [[5, 7, 1, 3, 9, 2, 4], [3, 4]]
CONFIG = GenerationConfig(gen_length=16, block_length=16, stop_at_eos=False)

#: a commit rule that reads a tensor's value on the host (``{condition}``: a Python branch on a tensor, or its
#: ``bool``): correct eagerly, not traceable
HOST_READ = '''
import attrs
import torch

from polestar.registry import register
from polestar.state import CommitSelection
from polestar.stages import CommitRule


@register("commit", "{name}")
class BranchyCommit(CommitRule):
    """Commit positions above 0.5 confidence, decided by a Python branch on a tensor."""

    @attrs.frozen
    class Config:
        pass

    def select(self, pred, masked, state, local):
        if {condition}:
            return CommitSelection(masked & (pred.confidence > 0.5))
        return CommitSelection(torch.zeros_like(masked))
'''


@pytest.fixture(autouse=True)
def fresh_reports(monkeypatch):
    """Each test sees its own "compile is off" lines (they are said once per process) and checks stages by the
    default rule (outside stages only)."""
    monkeypatch.setattr(compile_off, "_REPORTED", set())
    monkeypatch.delenv(contracts.ENV_SWITCH, raising=False)


def _plugin(tmp_path, stem: str, source: str):
    path = tmp_path / f"{stem}.py"
    path.write_text("import torch\n" + source)
    plugins.load_plugin(str(path))
    return path


def _decode(model, policy: str, overrides: dict, compile, graphs=None):
    pipeline = assemble(policy, {"threshold?": 0.3, **overrides})
    ids, mask = polestar.api.encode_prompts(model, PROMPTS)
    runner = StepRunner(compile, ids.device, pipeline, graphs=graphs)
    tokens, stats = decode(model, ids, mask, pipeline, CONFIG, runner=runner)
    return tokens, stats, runner, pipeline


def test_a_checked_plugin_is_checked_at_every_step_and_its_regions_compile(tmp_path, isolated_registry):
    _plugin(tmp_path, "hellinger_compiled", HELLINGER.format(name="hellinger-compiled"))
    model = make_model("llada", seed=11, n_layers=2, d_model=32)
    overrides = {"drift": "hellinger-compiled"}
    eager_tokens, eager_stats, _, _ = _decode(model, "polestar", overrides, False)
    tokens, stats, runner, pipeline = _decode(model, "polestar", overrides, "eager")
    drift = pipeline.stages["drift"]
    assert contracts.is_checked(drift) and "score" in vars(drift) and pipeline_compilable(pipeline)
    assert runner.regions is not None and stats.compiled_steps == stats.nfe == eager_stats.nfe
    assert tokens.tolist() == eager_tokens.tolist()
    assert [getattr(stats, c) for c in ("token_layer_evals", "weight_bytes", "kv_bytes")] == [
        getattr(eager_stats, c) for c in ("token_layer_evals", "weight_bytes", "kv_bytes")]


@pytest.mark.parametrize("variant, message", [
    ("nan", "a drift must be finite; it holds NaN or inf"),
    ("shape", "expected a floating \\[B, R\\] tensor of shape"),
])
def test_a_plugin_that_breaks_its_contract_fails_the_compiled_run_with_the_contract_error(
        tmp_path, isolated_registry, variant, message):
    name = f"hellinger-broken-{variant}"
    path = _plugin(tmp_path, f"hellinger_broken_{variant}", HELLINGER.format(name=name).replace(
        *(NAN_LINE if variant == "nan" else BROKEN["shape"])))
    model = make_model("llada", seed=11, n_layers=2, d_model=32)
    with pytest.raises(StageContractError, match=f"drift stage '{name}' \\(HellingerDrift.score\\) returned a "
                                                 f".*: {message}.*\\(defined in {re.escape(str(path.resolve()))}\\)"):
        polestar.generate(model, PROMPTS, policy="polestar", drift=name, compile="eager", gen_length=16,
                          block_length=16)


def test_graph_replays_check_the_first_step_of_each_phase_and_capture_unchecked(tmp_path, isolated_registry):
    """The graphs that replay uncompiled steps on CUDA (here a ReplayTape, the same capture path on a CPU, which
    fails on any host read while capturing): captured after the checked first step of each phase."""
    _plugin(tmp_path, "hellinger_taped", HELLINGER.format(name="hellinger-taped"))
    model = make_model("llada", seed=11, n_layers=2, d_model=32)
    eager_tokens, *_ = _decode(model, "polestar", {"drift": "hellinger-taped"}, False)
    graphs = taped_step_graphs()
    tokens, stats, runner, _ = _decode(model, "polestar", {"drift": "hellinger-taped"}, False, graphs=graphs)
    assert graphs.captured > 0 and graphs.eager + graphs.replayed == stats.nfe
    assert tokens.tolist() == eager_tokens.tolist()
    broken = "hellinger-taped-nan"
    _plugin(tmp_path, "hellinger_taped_nan", HELLINGER.format(name=broken).replace(*NAN_LINE))
    with pytest.raises(StageContractError, match="a drift must be finite"):
        _decode(model, "polestar", {"drift": broken}, False, graphs=taped_step_graphs())


def _compile_off_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == compile_off.__name__]


def test_a_stage_that_declares_itself_not_compilable_says_why_capture_is_off_in_one_line(isolated_registry, caplog):
    plugins.load_plugin(str(EXAMPLES / "offload_host.py"))
    model = make_model("llada", seed=11, n_layers=2, d_model=32)
    eager_tokens, *_ = _decode(model, "polestar", {"offload": "host"}, False)
    caplog.set_level(logging.WARNING, logger=compile_off.__name__)
    for _ in range(2):  # said once, however many decodes meet it
        tokens, stats, runner, _ = _decode(model, "polestar", {"offload": "host"}, "eager", graphs=taped_step_graphs())
        assert runner.graphs is None and stats.compiled_steps == stats.nfe
        assert tokens.tolist() == eager_tokens.tolist()
    source = (EXAMPLES / "offload_host.py").resolve()
    assert _compile_off_lines(caplog) == [
        f"CUDA-graph capture is off: offload stage 'host' (HostOffload, defined in {source}) declares "
        "compilable = False; every step runs as Python (the layer regions still compile)"]


@pytest.mark.parametrize("condition", ["(pred.confidence > 0.5).any()", "bool((pred.confidence > 0.5).any())"])
def test_a_plugin_that_reads_the_host_takes_the_compiled_route_and_decodes_as_eagerly(
        tmp_path, isolated_registry, caplog, condition):
    """A stage is never traced: a plugin's Python branch on a tensor runs as it does eagerly, with the regions
    compiled, and nothing says compile is off."""
    _plugin(tmp_path, "hellinger_branchy", HOST_READ.format(name="branchy", condition=condition))
    model = make_model("llada", seed=11, n_layers=2, d_model=32)
    eager_tokens, *_ = _decode(model, "parallel", {"commit": "branchy"}, False)
    caplog.set_level(logging.WARNING, logger=compile_off.__name__)
    tokens, stats, runner, _ = _decode(model, "parallel", {"commit": "branchy"}, "eager")
    assert tokens.tolist() == eager_tokens.tolist()
    assert runner.regions is not None and stats.compiled_steps == stats.nfe and _compile_off_lines(caplog) == []


@pytest.mark.slow
def test_a_plugin_file_compiles_from_the_command_line(isolated_registry, capsys):
    """``polestar generate --plugin docs/examples/drift_hellinger.py --compile`` (inductor): the plugin's drift is
    checked at every step and every step runs with the compiled regions, with eager decoding's tokens."""
    from polestar.cli import main

    argv = ["generate", "--plugin", str(EXAMPLES / "drift_hellinger.py"), "--policy", "polestar", "--set",
            "drift=hellinger", "--task", "arith", "--prompt", "3+4*2", "--json", "--gen-length", "16",
            "--block-length", "16"]
    runs = {}
    for mode in ("eager", "compiled"):
        assert main([*argv, *(["--compile"] if mode == "compiled" else [])]) == 0
        out, err = capsys.readouterr()
        runs[mode] = json.loads(out.splitlines()[0]), err
    record, err = runs["compiled"]
    compiled = int(re.search(r" compiled_steps=(\d+)", err).group(1))
    assert compiled == record["stats"]["nfe"] > 0
    assert record["tokens"] == runs["eager"][0]["tokens"] and record["stages"]["drift"]["name"] == "hellinger"
    assert "compile is off" not in err
