"""The command line and the bench harness on a small random checkpoint with the project's tokenizer."""

import json

import pytest

from polestar.bench.agreement import compare_runs
from polestar.bench.harness import wilson_interval
from polestar.cli import main
from polestar.models.loading import build_model, save_model
from polestar.models.tokenizer import build_char_tokenizer, special_ids


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tok = build_char_tokenizer()
    ids = special_ids(tok)
    vocab = tok.get_vocab_size()
    spec = dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=4, mlp_hidden=64, vocab_size=vocab,
                embedding_size=vocab, rope_theta=10000.0, norm_eps=1e-5, max_seq_len=128, mask_id=ids["mask"],
                eos_id=ids["eos"], pad_id=ids["pad"])
    path = tmp_path_factory.mktemp("ckpt")
    save_model(build_model("llada", spec, seed=0), path, tokenizer=tok)
    return str(path)


def test_generate_json(checkpoint, capsys):
    assert main(["generate", "--model", checkpoint, "--task", "arith", "--prompt", "3+4*2-5", "--prompt", "1+1",
                 "--policy", "polestar", "--gen-length", "32", "--block-length", "16", "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert len(out["tokens"]) == 2 and len(out["texts"]) == 2
    assert out["stats"]["nfe"] >= 1 and out["stages"]["refresh"]["name"] == "polestar"
    assert set(out["stats"]) >= {"token_layer_evals", "proxy_query_evals", "weight_bytes", "weight_bytes_per_token",
                                 "weight_bytes_per_step", "kv_bytes"}
    for key in ("token_layer_evals=", "proxy_query_evals=", "weight_bytes/token=", "weight_bytes/step=", "kv_bytes="):
        assert key in captured.err  # the stats line


def test_no_stop_at_eos_decodes_every_block(checkpoint, capsys):
    args = ["generate", "--model", checkpoint, "--prompt", "3+4", "--policy", "fast-dllm", "--gen-length", "32",
            "--block-length", "16", "--json"]
    assert main(args + ["--no-stop-at-eos"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    stopped = json.loads(capsys.readouterr().out)
    mask_id = special_ids(build_char_tokenizer())["mask"]
    assert mask_id not in full["tokens"][0][full["prompt_len"]:]
    assert full["stats"]["nfe"] >= stopped["stats"]["nfe"] >= 1


def test_policies_lists_every_policy(capsys):
    assert main(["policies", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"baseline", "fast-dllm", "polestar", "polestar-cache", "eb", "klass"} <= set(info["policies"])
    assert info["stages"]["commit"]["threshold"]["threshold"] == 0.9


def test_clear_errors(checkpoint, capsys):
    assert main(["generate", "--model", checkpoint, "--prompt", "x", "--policy", "nope"]) == 2
    assert "registered policies" in capsys.readouterr().err
    assert main(["generate", "--model", checkpoint, "--prompt", "x", "--set", "threshold=3"]) == 2
    assert "threshold must be in [0, 1]" in capsys.readouterr().err
    assert main(["bench", "--model", checkpoint, "--policies", "baseline", "--set", "thresold=0.5", "--n", "1"]) == 2
    assert "unknown option 'thresold'" in capsys.readouterr().err


def test_bench_writes_items_summary_and_plot(checkpoint, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text('{"input": "3+4", "output": "3+4=7"}\n{"input": "2*2", "output": "2*2=4"}\n')
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    assert main(["bench", "--model", checkpoint, "--task", "arith", "--policies", "baseline,fast-dllm", "--n", "2",
                 "--data", str(data), "--gen-length", "32", "--block-length", "16", "--json", str(out_json),
                 "--plot", str(out_png), "--batch-size", "2"]) == 0
    res = json.loads(out_json.read_text())
    assert [i["input"] for i in res["items"]] == ["3+4", "2*2", "3+4", "2*2"]
    assert set(res["items"][0]) == {"policy", "label", "input", "generation", "correct", "nfe", "error"}
    assert all(item["error"] is None for item in res["items"])
    for summary in res["summary"].values():
        assert set(summary) >= {"accuracy", "accuracy_ci95", "tpf", "tps", "nfe", "token_layer_evals_per_token",
                                "steps", "weight_bytes", "weight_bytes_per_token", "weight_bytes_per_step", "kv_bytes",
                                "kv_bytes_per_token", "proxy_query_evals", "proxy_query_evals_per_token"}
    assert out_png.stat().st_size > 0
    table = capsys.readouterr().out
    assert "baseline" in table
    for column in ("evals/tok", "NFE", "W/tok", "W/step", "KV/tok", "proxy/tok"):
        assert column in table


def test_wilson_interval():
    lo, hi = wilson_interval(50, 100)
    assert lo < 0.5 < hi and abs((lo + hi) / 2 - 0.5) < 1e-9
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0


def _run(items):
    return {"items": [{"policy": p, "input": i, "generation": g, "correct": c} for p, i, g, c in items]}


def test_compare_runs_counts_changed_items_and_tokens():
    a = _run([("x", "1+1", "1+1=2", True), ("x", "2*2", "2*2=4", True), ("y", "1+1", "1+1=2", True)])
    b = _run([("x", "1+1", "1+1=2", True), ("x", "2*2", "2*2=5", False), ("y", "1+1", "1+1=2=", True)])
    res = compare_runs(a, b)
    assert res["x"]["changed_items"] == 1 and res["x"]["changed_item_rate"] == 0.5
    assert res["x"]["token_mismatch_rate"] == 1 / 10
    assert res["x"]["accuracy_a"] == 1.0 and res["x"]["accuracy_b"] == 0.5
    assert res["y"]["token_mismatch_rate"] == 1 / 6  # a missing character is a mismatch
    assert compare_runs(a, a)["x"]["token_mismatch_rate"] == 0.0
    with pytest.raises(ValueError, match="same policies and problems"):
        compare_runs(a, _run([("x", "1+1", "1+1=2", True)]))


def test_compare_runs_across_policies():
    a = _run([("x", "1+1", "1+1=2", True), ("x", "2*2", "2*2=4", True), ("y", "1+1", "1+1=3", False)])
    b = _run([("z", "1+1", "1+1=2", True), ("z", "2*2", "2*2=5", False)])
    res = compare_runs(a, b, policy_a="x", policy_b="z")
    assert list(res) == ["x vs z"]
    assert res["x vs z"]["n"] == 2 and res["x vs z"]["changed_items"] == 1
    assert res["x vs z"]["accuracy_a"] == 1.0 and res["x vs z"]["accuracy_b"] == 0.5
    with pytest.raises(ValueError, match="holds no items of policy 'q'; it holds z"):
        compare_runs(a, b, policy_a="x", policy_b="q")
    with pytest.raises(ValueError, match="both"):
        compare_runs(a, b, policy_a="x")


def test_agree_on_two_bench_runs(checkpoint, tmp_path, capsys):
    common = ["bench", "--model", checkpoint, "--task", "arith", "--policies", "polestar-cache", "--n", "2",
              "--gen-length", "32", "--block-length", "16", "--batch-size", "2"]
    exact, lossy = tmp_path / "exact.json", tmp_path / "lossy.json"
    assert main([*common, "--set", "quant=none", "--set", "offload=none", "--json", str(exact)]) == 0
    assert main([*common, "--set", "quant=nvfp4", "--set", "offload=cpu", "--json", str(lossy)]) == 0
    capsys.readouterr()
    assert main(["agree", str(exact), str(lossy)]) == 0
    out = capsys.readouterr().out
    assert "polestar-cache" in out and "token mismatch" in out
    assert main(["agree", str(exact), str(tmp_path / "missing.json")]) == 2
    assert "no such benchmark JSON" in capsys.readouterr().err


def test_generate_takes_an_assembled_pipeline(checkpoint):
    import polestar

    model = polestar.load(checkpoint)
    by_name = polestar.generate(model, ["3+4"], policy="polestar", gen_length=32, block_length=16, threshold=0.8)
    pipeline = polestar.assemble("polestar", {"threshold": 0.8})
    built = polestar.generate(model, ["3+4"], policy=pipeline, gen_length=32, block_length=16)
    assert built.tokens.equal(by_name.tokens) and built.pipeline is pipeline
    with pytest.raises(ValueError, match="polestar.assemble"):
        polestar.generate(model, ["3+4"], policy=pipeline, gen_length=32, block_length=16, threshold=0.8)


def test_bench_set_swaps_a_stage(checkpoint, tmp_path):
    # regression: bench passes --set as optional overrides, and stage swaps were dropped: the agreement check
    # of quant/offload compared two identical configurations
    common = ["bench", "--model", checkpoint, "--task", "arith", "--n", "3", "--gen-length", "32",
              "--block-length", "16", "--batch-size", "3", "--set", "threshold=0.01"]
    swapped, par = tmp_path / "swapped.json", tmp_path / "parallel.json"
    assert main([*common, "--policies", "baseline", "--set", "commit=threshold", "--json", str(swapped)]) == 0
    assert main([*common, "--policies", "parallel", "--json", str(par)]) == 0
    swapped, par = json.loads(swapped.read_text()), json.loads(par.read_text())
    # baseline with the threshold commit is `parallel`: same tokens, far fewer forwards than one per token
    assert [i["generation"] for i in swapped["items"]] == [i["generation"] for i in par["items"]]
    assert swapped["summary"]["baseline"]["nfe"] == par["summary"]["parallel"]["nfe"] < 32
    # the JSON records the stages each policy ran with
    assert swapped["summary"]["baseline"]["stages"]["commit"] == {"name": "threshold", "threshold": 0.01}
    assert par["summary"]["parallel"]["stages"]["refresh"]["name"] == "full"


def test_the_bench_commands_come_from_the_installed_entry_points(capsys, monkeypatch):
    """`bench`, `anatomy` and `agree` are registered by the benchmark package; an install whose metadata lacks them
    (installed before the group existed) names the fix in the one error line."""
    import importlib.metadata

    import polestar.cli as cli

    names = {e.name for e in importlib.metadata.entry_points(group=cli.COMMANDS_GROUP)}
    assert names == {"bench", "anatomy", "agree"}
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    assert main(["bench", "--task", "arith"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "invalid choice: 'bench'" in err[0] and "pip install -e ." in err[0]
