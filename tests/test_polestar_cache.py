"""Polestar-Cache and the refresh baselines: equivalences with no-cache decoding and stage invariants."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import polestar
from polestar.bench.harness import load_problems
from polestar.policies.polestar_hooks import top_clusters
from polestar.policies.refresh_polestar import split_clusters
from polestar.registry import names
from polestar.tasks import get_task
from tests.conftest import make_model

PROMPTS = [[5, 7, 1, 3, 9, 2, 4], [3, 4, 6]]
# topk = topk_last = n_clusters (8): every cluster refreshed (a larger topk is an error)
EXACT = dict(topk=8, topk_last=8, tau_upd=0, prefix_blocks=64, suffix_blocks=64, window_refresh_every=0,
             quant="none")


def _gen(m, policy, **kw):
    base = dict(gen_length=32, block_length=8, threshold=0.3, stop_at_eos=False)
    base.update(kw)
    return polestar.generate(m, PROMPTS, policy=policy, **base)


def test_split_clusters_matches_paper():
    assert split_clusters(8, 64, 32) == (5, 3)
    assert split_clusters(8, 0, 32) == (0, 8)
    assert split_clusters(8, 20, 0) == (7, 0)  # no suffix (the last block): the authors' cap of total - 1
    assert split_clusters(8, 3, 32) == (1, 7)
    assert split_clusters(8, 2, 2) == (2, 2)


@pytest.mark.parametrize("cluster", names("cluster"))
def test_polestar_refreshing_all_clusters_every_step_equals_no_cache(family, cluster):
    m = make_model(family, seed=2)
    ref = _gen(m, "parallel")
    out = _gen(m, "polestar-cache", cluster=cluster, **EXACT)
    assert out.tokens.tolist() == ref.tokens.tolist()


@pytest.mark.parametrize("proxy_rope", [False, True])
def test_clustering_layers_together_equals_clustering_each_inside_its_pass(family, proxy_rope):
    """One clusterer call over every layer after the block start's forward gives each layer the clusters, drifts and
    tokens that clustering it inside its own pass gives (the centroid queries differ only by the q projection's
    rounding), with un-rotated centroid queries and with queries rotated at their members' mean position."""
    m = make_model(family, seed=4)
    runs = {}
    for together in (False, True):
        records = []
        out = _gen(m, "polestar", cluster_layers_together=together, tau_upd=0, proxy_rope=proxy_rope,
                   on_step=records.append)
        runs[together] = (out, [r.detail.stages.get("clusters", {}) for r in records])
    (each, each_clusters), (joint, joint_clusters) = runs[False], runs[True]
    assert joint.tokens.tolist() == each.tokens.tolist()
    assert joint.stats.proxy_query_evals == each.stats.proxy_query_evals
    assert joint.stats.weight_bytes > each.stats.weight_bytes  # the centroid queries' own q passes
    compared = 0
    for a, b in zip(each_clusters, joint_clusters):
        assert a.keys() == b.keys()
        for layer in a:
            assert torch.equal(a[layer].labels, b[layer].labels) and torch.equal(a[layer].counts, b[layer].counts)
            torch.testing.assert_close(b[layer].drift, a[layer].drift, rtol=1e-4, atol=1e-6)
            compared += 1
    assert compared > 0


def test_layers_clustered_in_groups_equal_all_layers_in_one_call(monkeypatch):
    """Where keeping every layer's window inputs for one clusterer call would take too much memory, the layers go to
    the clusterer in groups: each (layer, part, row) is clustered on its own either way, so nothing changes."""
    from polestar.policies.refresh_polestar import PolestarRefresh

    m = make_model("llada", seed=4, n_layers=3)
    records = {}
    for budget in (PolestarRefresh.CLUSTER_CALL_BYTES, 1):
        monkeypatch.setattr(PolestarRefresh, "CLUSTER_CALL_BYTES", budget)
        steps = []
        out = _gen(m, "polestar", tau_upd=0, on_step=steps.append)
        records[budget] = (out, steps)
    (one, one_steps), (grouped, grouped_steps) = records.values()
    assert grouped.tokens.tolist() == one.tokens.tolist()
    assert (grouped.stats.token_layer_evals, grouped.stats.weight_bytes) == (one.stats.token_layer_evals,
                                                                             one.stats.weight_bytes)
    for a, b in zip(one_steps, grouped_steps):
        for layer, clusters in a.detail.stages.get("clusters", {}).items():
            assert torch.equal(clusters.drift, b.detail.stages["clusters"][layer].drift)
    monkeypatch.undo()
    assert PolestarRefresh(PolestarRefresh.Config()).layers_per_cluster_call(32, 96, 4096, 32) == 1  # 8B, batch 32
    assert PolestarRefresh(PolestarRefresh.Config()).layers_per_cluster_call(1, 96, 4096, 32) == 32  # 8B, batch 1


# Elastic-Cache at gamma 1 recomputes from cached inputs, so it is not no-cache decoding
@pytest.mark.parametrize("policy,kw", [("dllm-cache", dict(ratio=1.0, prompt_interval=1, commit="threshold"))])
def test_adaptive_baselines_refreshing_everything_equal_no_cache(family, policy, kw):
    m = make_model(family, seed=2)
    assert _gen(m, policy, **kw).tokens.tolist() == _gen(m, "parallel").tokens.tolist()


def test_cpu_offload_gives_identical_tokens(family):
    m = make_model(family, seed=3)
    a = _gen(m, "polestar-cache", quant="nvfp4", offload="none", tau_upd=0)
    b = _gen(m, "polestar-cache", quant="nvfp4", offload="cpu", tau_upd=0)
    assert a.tokens.tolist() == b.tokens.tolist()


@pytest.fixture(scope="module")
def tiny_dream():
    return polestar.load("tiny-dream")


@pytest.mark.parametrize("drift", names("drift"))
@pytest.mark.parametrize("quant", names("quant"))
def test_every_drift_and_quant_stage_drives_suffix_commits_at_or_above_threshold(tiny_dream, drift, quant):
    """With every registered drift metric and quantizer, Polestar's update packets yield suffix-block commits, and
    each had confidence >= tau (read from the typed commit origins of every step)."""
    task = get_task("arith")
    prompts = [task.format_prompt(p.input) for p in load_problems("arith", 8)]
    records = []
    polestar.generate(tiny_dream, prompts, policy="polestar", drift=drift, quant=quant, gen_length=64,
                      block_length=16, on_step=records.append)
    suffixes = [r.origins.suffix for r in records if r.origins.suffix is not None]
    confs = torch.cat([s.confidence[s.commit] for s in suffixes]) if suffixes else torch.zeros(0)
    assert confs.numel() > 0
    assert (confs >= 0.9).all()


@pytest.mark.parametrize("policy", ["elastic-cache", "dllm-cache"])
def test_adaptive_refresh_rows_decode_as_alone(family, policy):
    """A row's tokens and computed positions do not depend on the other rows of its batch (Elastic-Cache used to
    recompute a row one layer late when another row had triggered below it). Equal prompt lengths, since full
    refreshes count left padding as computed."""
    m = make_model(family, seed=12)
    prompts = [[5, 7, 1, 3], [3, 4, 6, 2], [8, 9, 1, 1]]
    kw = dict(gen_length=32, block_length=8, threshold=0.3, stop_at_eos=False, gamma=0.99999, ratio=0.5)
    kw = {k: v for k, v in kw.items() if k not in ({"ratio"} if policy == "elastic-cache" else {"gamma"})}
    batch = polestar.generate(m, prompts, policy=policy, **kw)
    for i, p in enumerate(prompts):
        single = polestar.generate(m, [p], policy=policy, **kw)
        assert batch.generations[i].tolist() == single.generations[0].tolist()
        assert batch.stats.sequences[i].token_layer_evals == single.stats.sequences[0].token_layer_evals


def test_sparse_updates_cost_more_than_dual_cache_and_less_than_no_cache(family):
    m = make_model(family, seed=5)
    dual = _gen(m, "fast-dllm").stats.token_layer_evals
    pol = _gen(m, "polestar-cache", tau_upd=0).stats.token_layer_evals
    full = _gen(m, "parallel").stats.token_layer_evals
    assert dual < pol < full


def test_polestar_is_seed_reproducible():
    m = make_model("dream", seed=6)
    assert _gen(m, "polestar-cache", seed=3).tokens.tolist() == _gen(m, "polestar-cache", seed=3).tokens.tolist()


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(2, 9), st.data())
def test_larger_k_selects_a_superset(batch, n_clusters, data):
    drift = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, float("inf")]),
                                            min_size=batch * n_clusters, max_size=batch * n_clusters)))
    drift = drift.view(batch, n_clusters)
    counts = torch.tensor(data.draw(st.lists(st.integers(0, 3), min_size=batch * n_clusters,
                                             max_size=batch * n_clusters))).view(batch, n_clusters)
    prev = top_clusters(drift, counts, 0)
    assert not prev.any()
    for k in range(1, n_clusters + 2):
        cur = top_clusters(drift, counts, k)
        assert (cur | ~prev).all()
        assert (cur.sum(1) <= k).all() and not (cur & (counts == 0)).any()
        prev = cur


@pytest.mark.parametrize("block_start,shift", [(2, 0), (9, 0), (9, 1), (17, 0)])
def test_window_columns_follow_the_definition(block_start, shift):
    """``make_window``: ``prefix`` columns before the block (those before column 0 stand at 0 and are invalid, as is
    left padding), ``n_post`` after it (the suffix clipped at the sequence end by the caller), from a block start
    given as a device scalar, as inside a step: the same columns as from a Python int."""
    from types import SimpleNamespace

    from polestar.policies.sparse_update import make_window

    T, prefix, suffix, bl = 22, 6, 4, 4
    key_valid = torch.ones(2, T + 1, dtype=torch.bool)
    key_valid[1, :3] = False  # row 1 is left-padded by 3
    cache = SimpleNamespace(key_valid=key_valid, length=T)
    block_end = block_start + bl
    n_post = min(T, block_end + suffix) - block_end
    w = make_window(torch.tensor(block_start), bl, shift, prefix, n_post, cache)
    pre = list(range(block_start - shift - prefix, block_start - shift))
    post = list(range(block_end, min(T, block_end + suffix)))
    assert w.positions.tolist() == [max(c, 0) for c in pre] + post and w.n_prefix == prefix
    for row in range(2):
        expected = [c >= 0 and bool(key_valid[row, max(c, 0)]) for c in pre + post]
        assert w.valid[row].tolist() == expected
    from_int = make_window(block_start, bl, shift, prefix, n_post, cache)
    assert from_int.positions.tolist() == w.positions.tolist() and torch.equal(from_int.valid, w.valid)
