"""What a user reads: an unknown name ends its one-line error with the closest registered names (``_`` and ``-``
read alike), an option of a stage the policy did not select names that stage, ``bench --help`` shows its defaults,
``generate --compile`` says when compiling starts and ends, ``generate``'s stats line names the drift metric, and
``policies`` marks the stages a plugin added, ``agree`` sets two runs' metrics side by side, and the stage kit and
the benchmark suite take a plugin."""

import pytest

from polestar import registry
from polestar.policy import assemble, get_policy


def test_a_policy_name_with_an_underscore_suggests_the_registered_one():
    with pytest.raises(registry.UnknownNameError, match=r"unknown policy 'polestar_cache' \(did you mean "
                                                        r"'polestar-cache'"):
        get_policy("polestar_cache")


def test_a_misspelt_option_suggests_the_option():
    with pytest.raises(ValueError, match=r"unknown option 'tresh' for this policy \(did you mean 'threshold'\?\)"):
        assemble("fast-dllm", {"tresh": 0.5})


def test_an_option_of_a_stage_not_selected_names_that_stage():
    with pytest.raises(ValueError, match=r"unknown option 'commit.alpha' for this policy \('alpha' is an option of "
                                         r"the commit stage 'polestar': select that stage, commit=polestar\)"):
        assemble("fast-dllm", {"commit.alpha": 5.0})


def test_a_misspelt_stage_suggests_the_stage():
    with pytest.raises(registry.UnknownNameError, match=r"unknown drift stage 'kll' \(did you mean 'kl'\?\)"):
        registry.lookup("drift", "kll")


def test_nothing_close_suggests_nothing():
    assert registry.did_you_mean("zzzz", ["fast-dllm", "polestar"]) == ""
    assert registry.did_you_mean("FAST_DLLM", ["fast-dllm", "polestar"]) == " (did you mean 'fast-dllm'?)"


def test_bench_help_shows_the_defaults(capsys):
    from polestar.cli import main

    assert main(["bench", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for shown in ("(default tiny-llada)", "(default arith)", "(default 200;", "(default 1)"):
        assert shown in out, shown


@pytest.mark.slow
def test_generate_says_when_compiling_starts_and_ends(capsys):
    """``generate --compile`` says before the first batch that it compiles, and how long it took after it (the
    silence of a first compiled batch looked like a hang)."""
    from polestar.cli import main

    assert main(["generate", "--model", "tiny-llada", "--task", "arith", "--prompt", "3+4*2", "--prompt", "7*3-2",
                 "--batch-size", "1", "--policy", "fast-dllm", "--compile"]) == 0
    err = capsys.readouterr().err.splitlines()
    start = next(i for i, line in enumerate(err) if line.startswith("compiling fast-dllm: its layer regions"))
    assert err[start + 1].startswith("compiled in ") and err[start + 1].endswith(" s")
    assert sum(line.startswith("compiled in") for line in err) == 1  # the second batch reuses the regions


def test_the_stats_line_of_generate_names_the_drift_metric(capsys):
    from polestar.cli import main

    assert main(["generate", "--model", "tiny-llada", "--task", "arith", "--prompt", "3+4*2", "--policy", "polestar",
                 "--set", "drift=js"]) == 0
    assert capsys.readouterr().err.splitlines()[-1].startswith("[polestar drift=js] nfe=")
    assert main(["generate", "--model", "tiny-llada", "--task", "arith", "--prompt", "3+4*2", "--policy",
                 "fast-dllm"]) == 0
    assert capsys.readouterr().err.splitlines()[-1].startswith("[fast-dllm] nfe=")


def test_policies_marks_plugin_stages_with_their_file(capsys, isolated_registry):
    import json
    from pathlib import Path

    from polestar.cli import main

    plugin = Path(__file__).parent.parent / "docs" / "examples" / "drift_hellinger.py"
    assert main(["policies", "--plugin", str(plugin)]) == 0
    lines = capsys.readouterr().out.splitlines()
    hellinger = next(line for line in lines if " hellinger " in line)
    assert hellinger.strip().startswith("drift") and hellinger.endswith(f"[plugin: {plugin.resolve()}]")
    assert not any("[plugin" in line for line in lines if " kl " in line)
    assert main(["policies", "--json", "--plugin", str(plugin)]) == 0
    assert json.loads(capsys.readouterr().out)["plugins"] == {"drift": {"hellinger": str(plugin.resolve())}}


def test_a_stage_without_options_needs_no_config(isolated_registry):
    from polestar import registry
    from polestar.policies.commit_basic import ThresholdCommit
    from polestar.policies.drift import DriftMetric
    from polestar.policy import assemble
    from polestar.stages import NoOptions

    @registry.register("drift", "no-options")
    class L1Drift(DriftMetric):
        """Mean absolute difference of two attention distributions ``[B, H, R, T]`` → ``[B, R]``."""

        def score(self, now, before):
            return (now - before).abs().sum(-1).mean(1)

    assert L1Drift.Config is NoOptions and registry.config_fields("drift", "no-options") == {}
    pipeline = assemble("polestar", {"drift": "no-options"})
    assert pipeline.stages["drift"].name == "no-options"
    assert ThresholdCommit.Config is not NoOptions


def test_check_stage_says_which_checks_passed_and_the_old_check_name_still_runs(capsys):
    from polestar.testing import check_stage

    check_stage("drift", "kl", ["contract", "pure"])
    assert capsys.readouterr().out.splitlines()[-1] == "drift stage 'kl' passed: contract, laws"


@pytest.mark.slow
def test_bench_says_when_each_policy_compiles(capsys):
    from polestar.cli import main

    assert main(["bench", "--model", "tiny-llada", "--task", "arith", "--policies", "fast-dllm,parallel", "--n", "2",
                 "--compile"]) == 0
    err = capsys.readouterr().err
    for policy in ("fast-dllm", "parallel"):
        assert f"compiling {policy}: its layer regions, at the first steps of each step phase..." in err
        assert f"compiled {policy} in " in err


def test_agree_sets_the_metrics_of_two_runs_side_by_side():
    from polestar.bench.agreement import compare_metrics, format_metrics

    a = {"summary": {"polestar": {"tpf": 2.0, "nfe": 10.0, "token_layer_evals_per_token": 40.0}}}
    b = {"summary": {"polestar": {"tpf": 3.0, "nfe": 10.0, "token_layer_evals_per_token": 30.0}}}
    result = compare_metrics(a, b)
    assert result == {"polestar": {"tpf": (2.0, 3.0), "nfe": (10.0, 10.0), "token_layer_evals_per_token": (40.0, 30.0)}}
    table = format_metrics(result).splitlines()
    assert any(line.split()[:2] == ["polestar", "TPF"] and line.endswith("1.500x") for line in table)
    assert any(line.split()[:2] == ["polestar", "evals/tok"] and line.endswith("0.750x") for line in table)
    assert compare_metrics(a, b, "polestar", "polestar") == {"polestar vs polestar": result["polestar"]}


@pytest.mark.slow
def test_the_documented_benchmark_of_a_plugin_policy_runs():
    """docs/policies.md's pytest-benchmark command for a policy of your own, as written (timing off: this checks that
    the plugin's policy is collected beside the built-in ones and decodes)."""
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    page = (root / "docs" / "policies.md").read_text()
    block = page.split("<!-- benchmark-command -->\n```bash\n", 1)[1].split("\n```", 1)[0]
    argv = shlex.split(block)
    assert argv[0] == "pytest" and "--benchmark-only" in argv
    argv = [sys.executable, "-m", *(a for a in argv if a != "--benchmark-only"), "--benchmark-disable", "-q",
            "-p", "no:cacheprovider"]
    done = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "4 passed" in done.stdout  # polestar-hellinger and fast-dllm, on both tasks


def test_policies_entries_with_their_own_settings_parse_and_spell_back():
    from polestar.cli_checks import _parse_value
    from polestar.entries import parse_entry, split_entries

    assert split_entries("polestar, polestar[drift=peakjs,commit.threshold=0.8],fast-dllm") == [
        "polestar", "polestar[drift=peakjs,commit.threshold=0.8]", "fast-dllm"]
    entry = parse_entry("polestar[drift=peakjs, commit.threshold=0.8]", _parse_value)
    assert entry.policy == "polestar" and entry.own == {"drift": "peakjs", "commit.threshold": 0.8}
    assert entry.text == "polestar[commit.threshold=0.8,drift=peakjs]"
    assert parse_entry(entry.text, _parse_value) == entry
    assert entry.overrides({"threshold": 0.9, "drift": "kl"}) == {"threshold?": 0.9, "drift": "peakjs",
                                                                   "commit.threshold": 0.8}
    for bad in ("polestar[drift=kl", "polestar[drift]", "polestar]"):
        with pytest.raises(ValueError, match="e.g. polestar\\[drift=kl\\]"):
            parse_entry(bad, _parse_value)


@pytest.mark.parametrize("policies, message", [
    ("polestar[drift=nope]", "--policies entry 'polestar[drift=nope]': unknown drift stage 'nope'"),
    ("fast-dllm[gamma=0.1]", "--policies entry 'fast-dllm[gamma=0.1]':"),
    ("polestar_cache[drift=kl]", "unknown policy 'polestar_cache' in --policies (did you mean 'polestar-cache'"),
    ("polestar,polestar[]", "--policies names 'polestar' twice"),
    ("polestar[drift=kl,", "is malformed"),
])
def test_a_bad_policies_entry_is_one_line_before_any_work(capsys, policies, message):
    from polestar.cli import main

    assert main(["bench", "--model", "tiny-llada", "--task", "arith", "--policies", policies, "--n", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_every_label_the_bench_table_prints_is_a_policies_entry(tmp_path, capsys):
    """A row per entry (one policy with two drift metrics in one table); the labels printed, given back to
    --policies, decode the same items; --resume keys items by entry."""
    import json

    from polestar.cli import main

    common = ["bench", "--model", "tiny-llada", "--task", "arith", "--n", "3", "--set", "threshold=0.8", "--quiet"]
    first = tmp_path / "first.json"
    assert main([*common, "--policies", "polestar,polestar[drift=hellinger-free],fast-dllm", "--json", str(first)]
                ) == 2  # an unknown drift metric is refused before any work
    assert main([*common, "--policies", "polestar,polestar[drift=kl,commit.alpha=0],fast-dllm", "--json",
                 str(first)]) == 0
    run = json.loads(first.read_text())
    labels = [s["label"] for s in run["summary"].values()]
    assert labels == ["polestar[threshold=0.8]", "polestar[commit.alpha=0,drift=kl,threshold=0.8]",
                      "fast-dllm[threshold=0.8]"]
    assert {i["policy"] for i in run["items"]} == set(run["summary"])
    table = capsys.readouterr().out
    assert all(label in table for label in labels)
    again = tmp_path / "again.json"
    assert main(["bench", "--model", "tiny-llada", "--task", "arith", "--n", "3", "--quiet", "--policies",
                 ",".join(labels), "--json", str(again)]) == 0
    rerun = json.loads(again.read_text())
    assert [s["label"] for s in rerun["summary"].values()] == labels
    assert [i["generation"] for i in rerun["items"]] == [i["generation"] for i in run["items"]]
    assert main([*common, "--policies", "polestar,polestar[drift=kl,commit.alpha=0],fast-dllm", "--json",
                 str(first), "--resume"]) == 0  # every item found under its entry: nothing decoded twice
    assert json.loads(first.read_text())["items"] == run["items"]


def test_the_bench_bar_rates_problems_after_a_policys_first_batch():
    """A policy's first batch (compile, first allocations) is kept off the bar's rate: after 100 s of warm-up and one
    problem a second, the ETA of 8 problems left reads ~8 s, not ~7 minutes."""
    import io

    from tqdm import tqdm

    from polestar.bench.harness import restart_rate

    bar = tqdm(total=10, file=io.StringIO(), smoothing=0)
    bar.start_t -= 100.0  # the warm-up batch
    restart_rate(bar, 1)
    assert bar.n == bar.initial == 1
    bar.start_t -= 1.0
    bar.update(1)
    meter = bar.format_dict
    rate = (meter["n"] - meter["initial"]) / meter["elapsed"]
    assert 0.5 < rate <= 1.0 and 8 <= (meter["total"] - meter["n"]) / rate < 16
    bar.close()
