"""Stages defined outside the package: a ``.py`` file named with ``--plugin`` (generate, bench — also under torchrun
with two processes — and lm-eval) and an installed distribution registering through the ``polestar.plugins`` entry
point group; the registry's rule for a class registered twice."""

import glob
import json
import os
import subprocess
import sys
import textwrap

import attrs
import pytest

from polestar import plugins, policy, registry
from polestar.cli import main
from polestar.evaluation.cli import run_lm_eval
from polestar.evaluation.tasks import write_task_dir

#: a drift metric written as a researcher would: Hellinger distance per head, averaged over heads; it counts its
#: calls so a test can see that the policy really used it
HELLINGER = textwrap.dedent('''
    import attrs

    from polestar.policies.drift import DriftMetric
    from polestar.registry import register

    CALLS = [0]


    @register("drift", "{name}")
    class HellingerDrift(DriftMetric):
        """Hellinger distance per head, averaged over heads: ``[B, H, R, T]`` twice -> ``[B, R]``."""

        @attrs.frozen
        class Config:
            pass

        def score(self, cur, prev):
            CALLS[0] += 1
            h = (cur.float().sqrt() - prev.float().sqrt()).pow(2).sum(-1).mul(0.5).clamp_min(0).sqrt()
            return h.mean(dim=1)
''')

FAST = ["--gen-length", "16", "--block-length", "16", "--seed", "0"]


@pytest.fixture
def plugin_file(tmp_path, isolated_registry):
    path = tmp_path / "outside" / "hellinger_drift.py"
    path.parent.mkdir()
    path.write_text(HELLINGER.format(name="hellinger"))
    return path


def test_generate_with_a_plugin_file(plugin_file, capsys):
    code = main(["generate", "--plugin", str(plugin_file), "--policy", "polestar", "--set", "drift=hellinger",
                 "--task", "arith", "--prompt", "3+4*2", "--json", *FAST])
    assert code == 0, capsys.readouterr().err
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    assert record["stages"]["drift"]["name"] == "hellinger"
    assert sys.modules["hellinger_drift"].CALLS[0] > 0


def test_the_same_plugin_twice_is_loaded_once(plugin_file):
    first = plugins.load_plugin(str(plugin_file))
    assert plugins.load_plugin(str(plugin_file)) is first
    assert registry.lookup("drift", "hellinger") is first.HellingerDrift


def test_bench_with_a_plugin_file(plugin_file, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "--plugin", str(plugin_file), "--policies", "polestar", "--set", "drift=hellinger",
                 "--n", "2", "--batch-size", "2", "--quiet", "--json", str(out), *FAST])
    assert code == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["summary"]["polestar"]["stages"]["drift"]["name"] == "hellinger"


def test_a_plugin_that_fails_is_a_usage_error(tmp_path, isolated_registry, capsys):
    broken = tmp_path / "hellinger_broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    assert main(["generate", "--plugin", str(broken), "--prompt", "x"]) == 2
    assert "plugin file" in capsys.readouterr().err
    assert main(["bench", "--plugin", "hellinger_no_such_module"]) == 2
    assert "no module named 'hellinger_no_such_module'" in capsys.readouterr().err


@pytest.mark.slow
def test_lm_eval_with_a_plugin(plugin_file, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    write_task_dir(tmp_path / "tasks", "arith", n=2, choices=2)
    out = tmp_path / "out"
    code = run_lm_eval(["--plugin", str(plugin_file), "--include_path", str(tmp_path / "tasks"),
                        "--tasks", "polestar_arith", "--model_args",
                        "pretrained=tiny-llada,policy=polestar,gen_length=16,block_length=16,set.drift=hellinger",
                        "--batch_size", "2", "--device", "cpu", "--output_path", str(out)])
    assert code == 0
    assert sys.modules["hellinger_drift"].CALLS[0] > 0
    assert glob.glob(f"{out}/*/results_*.json")


def test_lm_eval_model_argument_plugin(plugin_file):
    from polestar.evaluation.lm_eval_model import PolestarLM

    lm = PolestarLM(pretrained="tiny-llada", plugin=str(plugin_file), **{"set.drift": "hellinger"})
    assert registry.lookup("drift", "hellinger") is sys.modules["hellinger_drift"].HellingerDrift
    assert lm.policy == "polestar"


def _clean_env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


@pytest.mark.slow
def test_bench_with_a_plugin_under_torchrun(tmp_path):
    path = tmp_path / "hellinger_ranks.py"
    path.write_text(HELLINGER.format(name="hellinger"))
    out = tmp_path / "dp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "polestar.cli", "bench", "--plugin", str(path), "--policies", "polestar", "--set", "drift=hellinger",
           "--num-problems", "2", "--batch-size", "1", "--quiet", "--json", str(out), *FAST]
    proc = subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["summary"]["polestar"]["stages"]["drift"]["name"] == "hellinger"
    assert len(result["items"]) == 2


def _installed_package(root, entry: str) -> None:
    """A distribution ``hellinger-plugin`` with an entry point in ``polestar.plugins``, as pip would install it
    (package plus ``*.dist-info`` with METADATA and entry_points.txt), under ``root``."""
    (root / "hellinger_pkg").mkdir(parents=True)
    (root / "hellinger_pkg" / "__init__.py").write_text(HELLINGER.format(name="hellinger-ep"))
    info = root / "hellinger_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hellinger-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[polestar.plugins]\nhellinger = {entry}\n")


@pytest.mark.slow
def test_installed_package_registers_through_the_entry_point(tmp_path):
    _installed_package(tmp_path / "site", "hellinger_pkg")
    env = _clean_env(PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "polestar.cli", "generate", "--policy", "polestar", "--set", "drift=hellinger-ep",
           "--task", "arith", "--prompt", "3+4", "--json", *FAST]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.splitlines()[0])["stages"]["drift"]["name"] == "hellinger-ep"


def test_a_broken_entry_point_warns_and_the_rest_loads(tmp_path, monkeypatch, isolated_registry):
    site = tmp_path / "site"
    _installed_package(site, "hellinger_pkg")
    with open(site / "hellinger_plugin-0.1.dist-info" / "entry_points.txt", "a") as f:
        f.write("broken = hellinger_missing_module\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(plugins, "_entry_points_loaded", False)
    with pytest.warns(RuntimeWarning, match="'broken'.*hellinger-plugin"):
        loaded = plugins.load_entry_points()
    assert "hellinger" in loaded and "hellinger-ep" in registry.names("drift")
    assert plugins.load_entry_points() == []  # once per process


def _drift_class(module: str):
    @attrs.frozen
    class Config:
        pass

    return type("Twice", (), {"Config": Config, "__module__": module, "__qualname__": "Twice"})


def test_registering_the_same_class_again_replaces_it(isolated_registry):
    first, again = _drift_class("notebook"), _drift_class("notebook")  # a re-run cell: same module and name
    registry.register("drift", "twice")(first)
    registry.register("drift", "twice")(again)
    assert registry.lookup("drift", "twice") is again
    with pytest.raises(ValueError, match="already registered by notebook.Twice; register other.Twice under another"):
        registry.register("drift", "twice")(_drift_class("other"))


def test_registering_a_policy_again_follows_the_same_rule(isolated_registry):
    spec = policy.PolicySpec("twice-policy", {"refresh": "dual", "commit": "threshold"})
    policy.register_policy(spec)
    edited = policy.PolicySpec("twice-policy", {"refresh": "dual", "commit": "threshold"},
                               {"commit": {"threshold": 0.8}})
    policy.register_policy(edited)  # a re-run from the same module (a notebook cell) replaces it
    assert policy.get_policy("twice-policy") is edited
    exec_globals = {"__name__": "other_module", "policy": policy, "edited": edited, "spec": spec}
    exec("policy.register_policy(edited)", exec_globals)  # the identical spec from another module: accepted
    with pytest.raises(ValueError, match="already registered by other_module"):
        exec("policy.register_policy(spec)", {**exec_globals, "__name__": "third_module"})
