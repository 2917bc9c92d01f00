"""Backbones and their plan / cache paths against the naive per-layer forward of ``tests/reference.py``; strict
HF-format loading."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from polestar.models.loading import load_model, save_model
from polestar.models.plan import full_plan, span_plan
from tests.conftest import make_model
from tests.reference import layer_kv_inputs, naive_logits, stale_logits


def test_full_forward_matches_naive(model):
    ids = torch.randint(0, 38, (2, 17))
    torch.testing.assert_close(model(ids), naive_logits(model, ids), atol=1e-5, rtol=1e-5)


def test_full_forward_under_autograd_backpropagates_and_equals_the_stacked_cache_forward(model):
    # a write into one layer of a stacked K/V tensor would bump the version of the keys saved by earlier layers
    ids = torch.randint(0, 38, (2, 13))
    with torch.no_grad():
        stacked = model(ids)
    logits = model(ids)
    torch.testing.assert_close(logits, stacked, atol=1e-6, rtol=1e-6)
    logits.float().logsumexp(-1).sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("over", [dict(qkv_bias=True), dict(tie_embeddings=True), dict(n_kv_heads=1)])
def test_llada_variants_match_naive(over):
    m = make_model("llada", **over)
    ids = torch.randint(0, 38, (1, 11))
    torch.testing.assert_close(m(ids), naive_logits(m, ids), atol=1e-5, rtol=1e-5)


def raw_reference_logits(model, ids):
    """Unshifted reference logits ``[B, L, V]``: position ``i`` from hidden state ``i`` (both families)."""
    return model.head(model.final_norm(layer_kv_inputs(model, ids)[-1]))


def plan_logits(model, ids, cache, plan):
    """Unshifted logits ``[B, C, V]`` of the last layer's slots of ``plan``."""
    return model.head(model.run_plan(ids, cache, plan).hidden)


def test_dream_logits_are_shifted():
    m = make_model("dream")
    ids = torch.randint(0, 38, (1, 9))
    full, raw = m(ids), raw_reference_logits(m, ids)
    torch.testing.assert_close(full[:, 1:], raw[:, :-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(full[:, 0], raw[:, 0], atol=1e-5, rtol=1e-5)


def test_left_padded_forward_matches_reference_per_row(model):
    lengths = [13, 9, 5]
    am = torch.zeros(len(lengths), 13, dtype=torch.bool)
    ids = torch.full((len(lengths), 13), model.spec.pad_id)
    rows = [torch.randint(0, 38, (1, n)) for n in lengths]
    for b, row in enumerate(rows):
        am[b, 13 - row.shape[1]:] = True
        ids[b, 13 - row.shape[1]:] = row[0]
    out = model(ids, am)
    # Dream's shifted logit at a row's first real position comes from the padding before it: compare from the next
    skip = model.spec.logit_shift
    for b, row in enumerate(rows):
        got = out[b : b + 1, 13 - row.shape[1] + skip :]
        torch.testing.assert_close(got, naive_logits(model, row)[:, skip:], atol=1e-5, rtol=1e-5)


def test_all_position_plan_matches_reference(model):
    ids = torch.randint(0, 38, (2, 13))
    cache = model.new_cache(torch.ones(2, 13, dtype=torch.bool), store_hidden=True)
    got = plan_logits(model, ids, cache, full_plan(2, 13, "cpu"))
    torch.testing.assert_close(got, raw_reference_logits(model, ids), atol=1e-5, rtol=1e-5)


def test_block_plan_on_fresh_cache_matches_reference(model):
    ids = torch.randint(0, 38, (2, 20))
    cache = model.new_cache(torch.ones(2, 20, dtype=torch.bool))
    model.run_plan(ids, cache, full_plan(2, 20, "cpu"))
    got = plan_logits(model, ids, cache, span_plan(2, 8, 8, "cpu"))
    torch.testing.assert_close(got, raw_reference_logits(model, ids)[:, 8:16], atol=1e-5, rtol=1e-5)


def test_block_plan_on_stale_cache_matches_reference(model):
    """Dual-cache semantics: the block is recomputed from new tokens, the rest attends to the old K/V."""
    old = torch.randint(0, 38, (2, 20))
    new = old.clone()
    new[:, 8:16] = torch.randint(0, 38, (2, 8))
    cache = model.new_cache(torch.ones(2, 20, dtype=torch.bool))
    model.run_plan(old, cache, full_plan(2, 20, "cpu"))
    got = plan_logits(model, new, cache, span_plan(2, 8, 8, "cpu"))
    ref = stale_logits(model, new, layer_kv_inputs(model, old), 8, 16, shift=0)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    fresh = raw_reference_logits(model, new)[:, 8:16]
    assert (got - fresh).abs().max() > 1e-3  # the stale K/V matter: the comparison above can fail


def test_per_layer_plan_with_identical_layers_equals_uniform(model):
    ids = torch.randint(0, 38, (1, 12))
    L = model.spec.n_layers
    c1 = model.new_cache(torch.ones(1, 12, dtype=torch.bool), store_hidden=True)
    c2 = model.new_cache(torch.ones(1, 12, dtype=torch.bool), store_hidden=True)
    model.run_plan(ids, c1, full_plan(1, 12, "cpu"))
    model.run_plan(ids, c2, full_plan(1, 12, "cpu"))
    uni = span_plan(1, 4, 5, "cpu")
    per = uni._replace(index=uni.index.expand(L, 1, 5), valid=uni.valid.expand(L, 1, 5))
    a = model.run_plan(ids, c1, uni).hidden
    b = model.run_plan(ids, c2, per).hidden
    torch.testing.assert_close(a, b)


def test_attention_probe_rows_sum_to_one_and_ignore_padding(model):
    ids = torch.randint(0, 38, (2, 10))
    am = torch.ones(2, 10, dtype=torch.bool)
    am[1, :3] = False
    cache = model.new_cache(am)
    from polestar.models.backbone import AttentionProbe

    out = model.run_plan(ids, cache, full_plan(2, 10, "cpu"), AttentionProbe(1, torch.tensor([[0, 5], [4, 9]])))
    probs = out.probe
    assert probs.shape == (2, model.spec.n_heads, 2, 11)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, model.spec.n_heads, 2))
    assert probs[1, :, :, :3].abs().max() == 0 and probs[..., -1].abs().max() == 0
    from polestar.models.cost import CostMeter
    from polestar.models.layer_ops import LayerOps

    q = LayerOps(model).project_queries(1, torch.randn(2, 3, model.spec.d_model), torch.tensor([[0, 4, 9]] * 2),
                                        CostMeter())
    proxy = model.attention_probs(q, cache.k[1], cache.key_valid)
    torch.testing.assert_close(proxy.sum(-1), torch.ones(2, model.spec.n_heads, 3))


@pytest.mark.parametrize("shard", [None, 4])
def test_checkpoint_round_trip(model, tmp_path, shard):
    save_model(model, tmp_path, shard_size=shard)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] in ("llada", "Dream")
    loaded = load_model(tmp_path)
    ids = torch.randint(0, 38, (1, 9))
    torch.testing.assert_close(loaded(ids), model(ids))
    names = set(load_file(tmp_path / "model.safetensors")) if shard is None else set(
        json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    )
    prefix = "model.transformer.blocks.0." if model.spec.family == "llada" else "model.layers.0.self_attn."
    assert any(n.startswith(prefix) for n in names)


def test_loading_errors_name_the_tensor(tmp_path):
    m = make_model("llada")
    save_model(m, tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    bad = dict(state)
    del bad["model.transformer.blocks.1.q_proj.weight"]
    bad["model.transformer.extra.weight"] = torch.zeros(2)
    bad["model.transformer.ln_f.weight"] = torch.zeros(5)
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(ValueError) as err:
        load_model(tmp_path)
    msg = str(err.value)
    assert "blocks.1.q_proj.weight" in msg and "transformer.extra.weight" in msg and "ln_f.weight has shape (5,)" in msg


def test_loading_bad_paths_and_configs(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llada", "d_model": 8, "n_heads": 2, "n_layers": 1,
                                                      "vocab_size": 10, "block_type": "sequential"}))
    with pytest.raises(ValueError, match="block_type"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llada", "d_model": 8, "n_heads": 2, "n_layers": 1,
                                                      "vocab_size": 10, "mask_token_id": 9}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="pickled"):
        load_model(tmp_path)


def test_dtype_option(tmp_path):
    m = make_model("dream")
    save_model(m, tmp_path)
    bf = load_model(tmp_path, dtype="bf16")
    assert bf.dtype == torch.bfloat16
    ids = torch.randint(0, 38, (1, 8))
    assert bf(ids).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="not supported"):
        load_model(tmp_path, dtype="int8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_the_official_formula_bit_for_bit(dtype):
    """The fused fp32 path and the explicit one (fp32 statistics, cast back, then the weight) give the official
    LLaDA / Qwen2 RMSNorm's bits."""
    from polestar.models.layers import RMSNorm

    norm = RMSNorm(48, 1e-5).to(dtype)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(2, 9, 48).to(dtype) * 3
    xf = x.float()
    official = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    assert torch.equal(norm(x), official)
