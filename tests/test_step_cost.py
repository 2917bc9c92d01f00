"""The step-cost counters, pinned to values computed by hand from the model's shape on a small case.

Setting: the tiny LLaDA of ``tests/conftest.py`` (2 layers, d 32, 4 heads of 8, MLP 64, vocab 40, fp32, no bias),
batch 2 with prompts of 5 tokens, generation 16 in 2 blocks of 8, one token per step (commit ``topk`` with
``steps = gen_length``), so every policy takes 16 steps: 2 block starts and 14 block steps.
"""

import math

import pytest

import polestar
from tests.conftest import make_model

B, P, G, BL, L = 2, 5, 16, 8, 2
T = P + G
D, H, HD, MLP, V = 32, 4, 8, 64, 40
F32 = 4
LAYER_W = (2 * D + 4 * D * D + 3 * D * MLP) * F32  # two norms, q k v o, gate up down
HEAD_W = V * D * F32 + D * F32  # LM head + final norm
KV_READ = 2 * B * H * (T + 1) * HD * F32  # one layer's K and V, trash slot included
K_READ = KV_READ // 2
ONE_PER_STEP = dict(commit="topk", gen_length=G, block_length=BL, steps=G, stop_at_eos=False)
PROMPTS = [[5, 7, 1, 3, 9], [3, 4, 6, 2, 8]]

# Polestar-Cache: windows of 1 prefix + 1 suffix block, 4 clusters, top 2 (last layer 1), capacity 1x.
POLESTAR = dict(prefix_blocks=1, suffix_blocks=1, window_refresh_every=0, n_clusters=4, topk=2, topk_last=1,
                capacity=1.0, tau_upd=0, quant="none")


@pytest.fixture(scope="module")
def llada():
    return make_model("llada", seed=5)


def _run(model, policy, **kw):
    return polestar.generate(model, PROMPTS, policy=policy, **ONE_PER_STEP, **kw).stats


def _dense_step(rows: int) -> int:
    """Weight bytes of a step whose plan has ``rows`` slots per sequence (embedding rows are read, not the table)."""
    return L * LAYER_W + HEAD_W + B * rows * D * F32


def test_fast_dllm_counters_equal_the_hand_count(llada):
    s = _run(llada, "fast-dllm")
    assert s.nfe == G
    starts, block_steps = G // BL, G - G // BL
    assert s.weight_bytes == starts * _dense_step(T) + block_steps * _dense_step(BL)
    assert s.token_layer_evals == B * L * (starts * T + block_steps * BL)
    assert s.kv_bytes == G * L * KV_READ
    assert s.proxy_query_evals == 0


def _capacities(window: int, k_mid: int, k_last: int, k_total: int) -> list[int]:
    return [math.ceil(window * k_mid / k_total)] * (L - 1) + [math.ceil(window * k_last / k_total)]


Q_PASS = (D + D * D) * F32  # a layer's attention norm and q weight


@pytest.mark.parametrize("together", [False, True], ids=["each-layer", "layers-together"])
def test_polestar_cache_counters_equal_the_hand_count(llada, together):
    s = _run(llada, "polestar-cache", **POLESTAR, cluster_layers_together=together)
    assert s.nfe == G
    # block 0: window = 8 prefix columns (3 of them before column 0, invalid) + 8 suffix; 2 + 2 clusters
    # block 1: window = 8 prefix columns, no suffix (end of the sequence); 3 clusters (the authors' cap of
    # n_clusters - 1 for the prefix; member capacities still count n_clusters)
    blocks = [(4, _capacities(16, 2, 1, 4)), (3, _capacities(8, 2, 1, 4))]  # (clusters, member capacities)
    weight = evals = probes = kv = 0
    # the commit rule (top-k) reads no update packet, so the last layer scores no proxies and recomputes no members
    # (its outputs would feed nothing): only the first S = L - 1 layers do
    S = L - 1
    for k, caps in blocks:
        # the block start: a full forward; the centroids ride along each scoring layer's q pass, or (clustered
        # together after the forward) take a q pass of their own per scoring layer; per scoring layer the keys are
        # read twice more: once to undo their rotary embedding, once by the proxy attention
        weight += _dense_step(T) + (S * Q_PASS if together else 0)
        evals += B * L * T
        probes += B * S * k
        kv += L * KV_READ + S * 2 * K_READ
        # 7 update steps: block + members through the MLP; centroids and the previous layer's packet through q/k/v;
        # layer 0's members read their embedding rows
        for _ in range(BL - 1):
            weight += _dense_step(BL) + B * caps[0] * D * F32
            evals += B * (L * BL + sum(caps[:S]))
            probes += B * (S * k + sum(caps[:-1]))
            kv += L * KV_READ + S * 2 * K_READ
    assert (s.weight_bytes, s.token_layer_evals, s.proxy_query_evals, s.kv_bytes) == (weight, evals, probes, kv)


def test_polestar_cache_reads_each_weight_once_per_step(llada):
    """On the same schedule, Polestar-Cache clustering each layer inside its pass reads at most 5% more weight bytes
    than Fast-dLLM's dual cache (the difference is the members' embedding rows at layer 0); the packet's logits
    share the block's LM-head pass."""
    dual = _run(llada, "fast-dllm")
    for policy in ("polestar-cache", "polestar"):
        kw = dict(POLESTAR) if policy == "polestar-cache" else {}
        sparse = _run(llada, policy, cluster_layers_together=False, **kw)
        assert sparse.nfe == dual.nfe
        assert sparse.weight_bytes <= 1.05 * dual.weight_bytes, policy
        assert sparse.weight_bytes >= dual.weight_bytes


def test_run_totals_count_buffer_padding_and_sequences_count_their_own_rows(llada):
    """The run's token-layer evaluations count every computed row, unused slots of the member buffers included; a
    sequence's own count covers the plan slots and members it used."""
    dual = _run(llada, "fast-dllm")
    assert sum(q.token_layer_evals for q in dual.sequences) == dual.token_layer_evals  # no buffer, no padding slot
    sparse = _run(llada, "polestar-cache", **POLESTAR)
    own = sum(q.token_layer_evals for q in sparse.sequences)
    assert dual.token_layer_evals < own < sparse.token_layer_evals


def test_profile_shares_cover_the_step_and_see_polestar_stages():
    """``polestar bench --profile``: per policy the shares of step time sum to 1; Polestar's drift stages get time,
    `fast-dllm` has none; the table has one line per policy."""
    from polestar.bench.harness import format_profile, profile_policies

    decoding = dict(gen_length=32, block_length=16, threshold=0.9)
    shares = profile_policies("tiny-llada", "arith", ["fast-dllm", "polestar"], 4, {}, decoding, batch_size=4)
    for name, parts in shares.items():
        assert sum(parts.values()) == pytest.approx(1.0, abs=1e-6), name
        assert all(v >= 0 for k, v in parts.items() if k != "model_forward"), name
    assert shares["polestar"]["proxy_attention"] > 0 and shares["polestar"]["cluster"] > 0
    assert shares["fast-dllm"]["proxy_attention"] == shares["fast-dllm"]["cluster"] == 0
    assert len(format_profile(shares).splitlines()) == 2 + 2


def test_stages_declare_their_profiling_scopes_where_they_are_written(monkeypatch):
    """The core names only the step's own scopes; Polestar-Cache's hooks declare theirs (in the order the profile
    table shows them); a declared name is kept once and may not shadow a step scope."""
    from polestar import profiling

    assert profiling.STEP_SCOPES == ("forward", "commit")
    assert profiling.FORWARD_SCOPES[:4] == ["proxy_attention", "drift", "cluster", "store"]
    monkeypatch.setattr(profiling, "FORWARD_SCOPES", list(profiling.FORWARD_SCOPES))
    profiling.declare_scopes("my_stage", "drift")
    assert profiling.FORWARD_SCOPES.count("drift") == 1 and profiling.scope_names()[-1] == "my_stage"
    with pytest.raises(ValueError, match="step's own scopes"):
        profiling.declare_scopes("commit")
