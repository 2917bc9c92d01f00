"""``polestar.testing`` on a stage written outside the package: a good Hellinger drift passes every check, three
broken variants fail with a message naming the stage and the fault; the pytest plugin runs the same checks, and
the run-time contract checks (on by default for stages from outside the package) name the stage and what it
returned."""

import re
import subprocess
import sys

import pytest

import polestar
from polestar import contracts, plugins
from polestar.contracts import StageContractError
from polestar.testing import CHECKS, check_stage, tiny_model
from tests.test_plugins import HELLINGER

#: broken variants of the Hellinger drift: the score line replaced
BROKEN = {
    "negative": ("return h.mean(dim=1)", "return h.mean(dim=1) - 1.0"),
    "shape": ("return h.mean(dim=1)", "return h.mean(dim=1).flatten()"),
    "random": ("return h.mean(dim=1)", "return h.mean(dim=1) + torch.rand(h.shape[0], h.shape[2])"),
}


def _plugin(tmp_path, name: str, source: str):
    path = tmp_path / f"hellinger_{name.replace('-', '_')}.py"
    path.write_text("import torch\n" + source)
    return plugins.load_plugin(str(path))


@pytest.fixture
def good(tmp_path, isolated_registry):
    _plugin(tmp_path, "good", HELLINGER.format(name="hellinger"))
    return "hellinger"


def test_a_good_outside_stage_passes_every_check(good):
    check_stage("drift", good)


@pytest.mark.parametrize("variant,message", [
    ("negative", "drift stage 'bad' \\(HellingerDrift.score\\) returned a torch.float32 tensor of shape .*: a drift "
                 "must be >= 0"),
    ("shape", "drift stage 'bad' \\(HellingerDrift.score\\) returned a torch.float32 tensor of shape \\[\\d+\\]: "
              "expected a floating \\[B, R\\] tensor of shape"),
    ("random", "drift stage 'bad' fails the contract check: drift stage 'bad' is not deterministic"),
])
def test_broken_stages_fail_naming_the_fault(tmp_path, isolated_registry, variant, message):
    old, new = BROKEN[variant]
    _plugin(tmp_path, variant, HELLINGER.format(name="bad").replace(old, new))
    with pytest.raises((AssertionError, StageContractError), match=message):
        check_stage("drift", "bad", CHECKS)


def test_run_time_switch_names_the_stage_and_what_it_returned(tmp_path, isolated_registry, monkeypatch):
    old, new = BROKEN["shape"]
    _plugin(tmp_path, "shape", HELLINGER.format(name="bad").replace(old, new))
    model = tiny_model("llada", seed=3)
    kw = dict(policy="polestar", drift="bad", gen_length=16, block_length=8)
    with pytest.raises(StageContractError, match="drift stage 'bad' \\(HellingerDrift.score\\) returned"):
        polestar.generate(model, [[5, 17, 3]], check_stages=True, **kw)
    monkeypatch.setenv(contracts.ENV_SWITCH, "1")
    assert contracts.is_checked(polestar.assemble("polestar", {"drift": "bad"}).stages["drift"])
    with pytest.raises(StageContractError):
        polestar.generate(model, [[5, 17, 3]], **kw)
    monkeypatch.setenv(contracts.ENV_SWITCH, "0")  # off: the stage's methods are its own, nothing wraps them
    stage = polestar.assemble("polestar", {"drift": "bad"}).stages["drift"]
    assert "score" not in vars(stage)


@pytest.mark.slow
def test_pytest_plugin_runs_the_checks(tmp_path):
    path = tmp_path / "hellinger_pytest.py"
    path.write_text(HELLINGER.format(name="hellinger"))
    (tmp_path / "conftest.py").write_text("")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "polestar.testing", "--polestar-plugin", str(path),
           "--polestar-stage", "drift:hellinger", "--polestar-checks", "contract,laws", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "2 passed" in proc.stdout
    path.write_text(HELLINGER.format(name="hellinger").replace(*BROKEN["negative"]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 1 and "a drift must be >= 0" in proc.stdout, proc.stdout[-2000:]
    assert "polestar-stage[drift:hellinger:contract]" in proc.stdout



# ------------------------------------------------------------------ run-time checks of stages from outside the package

#: a drift whose scores are NaN (its tables would look normal without the check)
NAN_LINE = ("return h.mean(dim=1)", "return h.mean(dim=1) * float('nan')")
BENCH = ["bench", "--policies", "polestar", "--n", "2", "--batch-size", "2", "--gen-length", "16", "--block-length",
         "16", "--quiet"]


def test_outside_stages_are_checked_by_default_and_built_ins_only_when_asked(tmp_path, isolated_registry,
                                                                              monkeypatch):
    monkeypatch.delenv(contracts.ENV_SWITCH, raising=False)
    _plugin(tmp_path, "default", HELLINGER.format(name="hellinger"))
    stages = polestar.assemble("polestar", {"drift": "hellinger"}).stages
    assert "score" in vars(stages["drift"]) and contracts.is_checked(stages["drift"])  # wrapped, still compilable
    assert not hasattr(stages["drift"], "compilable")
    assert all(not vars(s).keys() & {"plan", "select", "decode", "cluster", "read_rows"}
               for kind, s in stages.items() if kind != "drift")  # the built-ins are their own
    assert not any("score" in vars(s) for s in polestar.assemble("polestar", {"drift": "hellinger"},
                                                                 check_stages=False).stages.values())
    assert "plan" in vars(polestar.assemble("fast-dllm", check_stages=True).refresh)
    monkeypatch.setenv(contracts.ENV_SWITCH, "1")
    assert "plan" in vars(polestar.assemble("fast-dllm").refresh)


@pytest.mark.parametrize("variant, broken", [
    ("nan", "a drift must be finite; it holds NaN or inf"),
    ("shape", "expected a floating \\[B, R\\] tensor of shape \\[2, \\d+\\]"),
])
def test_a_broken_plugin_stage_fails_the_run_in_one_line(tmp_path, isolated_registry, monkeypatch, capsys,
                                                        variant, broken):
    from polestar.cli import main

    monkeypatch.delenv(contracts.ENV_SWITCH, raising=False)
    path = tmp_path / f"hellinger_{variant}.py"
    path.write_text("import torch\n" + HELLINGER.format(name=f"tv-{variant}").replace(
        *(NAN_LINE if variant == "nan" else BROKEN["shape"])))
    code = main([*BENCH, "--plugin", str(path), "--set", f"drift=tv-{variant}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 2 and err[0].startswith("[model]"), err
    assert re.fullmatch(f"error: bench failed: StageContractError: drift stage 'tv-{variant}' "
                        f"\\(HellingerDrift.score\\) returned a torch.float32 tensor of shape .*: {broken} "
                        f"\\(defined in {re.escape(str(path.resolve()))}\\)", err[1]), err[1]
    if variant == "nan":  # what the check catches: without it the NaN drift runs to a normal-looking table
        monkeypatch.setenv(contracts.ENV_SWITCH, "0")
        assert main([*BENCH, "--plugin", str(path), "--set", f"drift=tv-{variant}"]) == 0
        assert "polestar[drift=tv-nan]" in capsys.readouterr().out
