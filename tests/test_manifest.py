"""Every bench run writes a manifest beside its results; `polestar agree` compares only runs whose manifests differ
in the compared setting alone, unless told to."""

import json

import pytest
import torch

from polestar.bench.agreement import check_comparable
from polestar.bench.manifest import manifest_diff, manifest_path
from polestar.cli import main

ARGS = ["bench", "--model", "tiny-llada", "--task", "arith", "--policies", "fast-dllm,polestar-cache", "--n", "2",
        "--batch-size", "2", "--gen-length", "16", "--block-length", "16", "--quiet"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three runs of the same problems: exact, lossy quant (one setting changed), lossy quant and another dtype
    (two settings changed)."""
    root = tmp_path_factory.mktemp("manifest")
    paths = {name: root / f"{name}.json" for name in ("exact", "lossy", "lossy-bf16")}
    assert main([*ARGS, "--set", "quant=none", "--json", str(paths["exact"])]) == 0
    assert main([*ARGS, "--set", "quant=nvfp4", "--json", str(paths["lossy"])]) == 0
    assert main([*ARGS, "--set", "quant=nvfp4", "--dtype", "bfloat16", "--json", str(paths["lossy-bf16"])]) == 0
    return paths


def test_manifest_beside_the_results_and_inside_them(runs):
    path = runs["exact"]
    beside = json.loads(manifest_path(path).read_text())
    assert json.loads(path.read_text())["manifest"] == beside
    assert beside["torch_version"] == torch.__version__ and beside["device"] == "cpu"
    assert beside["threads"] == torch.get_num_threads() and beside["polestar_version"]
    assert beside["git_commit"] is None or len(beside["git_commit"]) == 40  # a checkout gives its commit
    settings = beside["settings"]
    assert settings["options"] == {"quant": "none"} and settings["n"] == 2 and settings["batch_size"] == 2
    assert settings["decoding"]["gen_length"] == 16 and settings["policies"] == ["fast-dllm", "polestar-cache"]
    assert settings["labels"] == {"fast-dllm": "fast-dllm", "polestar-cache": "polestar-cache[quant=none]"}


def test_agree_compares_runs_that_differ_in_one_setting(runs, capsys):
    assert main(["agree", str(runs["exact"]), str(runs["lossy"])]) == 0
    out = capsys.readouterr().out
    assert "compared: settings.options" in out


def test_agree_refuses_runs_that_differ_in_more(runs, capsys):
    assert main(["agree", str(runs["exact"]), str(runs["lossy-bf16"])]) == 2
    err = capsys.readouterr().err
    assert ("differ in more than the compared setting" in err and "settings.dtype" in err
            and "--allow-differences" in err)
    assert main(["agree", str(runs["exact"]), str(runs["lossy-bf16"]), "--allow-differences"]) == 0


def test_manifest_diff_and_policy_comparisons():
    a = {"torch_version": "1", "threads": 1, "settings": {"n": 2, "policies": ["a"], "labels": {"a": "a"}}}
    b = {"torch_version": "1", "threads": 2, "settings": {"n": 2, "policies": ["b"], "labels": {"b": "b"}}}
    assert manifest_diff(a, b) == ["settings.policies: [\"a\"] -> [\"b\"]", "threads: 1 -> 2"]  # labels follow
    # --policy-a/--policy-b compare policies on purpose: only the thread count is left, one difference
    assert check_comparable([a, b], ["A", "B"], by_policy=True, allow=False) == ["threads: 1 -> 2"]
    with pytest.raises(ValueError, match="more than the compared setting"):
        check_comparable([a, b], ["A", "B"], by_policy=False, allow=False)
