"""The ``d2cache`` refresh selector (d2Cache, Jiang et al. 2025, "d2Cache: Accelerating Diffusion-Based LLMs via
Dual Adaptive Caching"): its row choice against a plain per-row restatement of the paper's description (certainty
density, the current-block bias and search range, the commits, the attention-rollout nucleus, the inflation), its
attention rollout against the product of the model's full attention maps, its reduction to no-cache decoding when
every row is chosen, batch invariance, and the stage laws."""

import math

import pytest
import torch

import polestar
from polestar.api import encode_prompts
from polestar.config import GenerationConfig
from polestar.engine import decode
from polestar.policies.certainty import certainty_density, density_kernel
from polestar.policies.refresh_d2cache import D2CacheRefresh, choose_rows
from polestar.policy import assemble
from polestar.stages import LayerHook
from polestar.testing import check_stage
from tests.conftest import make_model

GEN, BLOCK = 32, 8
CONFIG = GenerationConfig(gen_length=GEN, block_length=BLOCK, steps=GEN, stop_at_eos=False)
PROMPTS = ("arith:7-7-7-5*5*0=", "arith:4+6=", "arith:9*3-8=")


# -- a per-row restatement of the paper's choice ------------------------------------------------------------------
def reference_density(decoded: list[bool], sigma: float) -> list[float]:
    """Gaussian-weighted share of decoded positions around each position; left of the generation counts as decoded,
    right of it as the last position; normalised by the kernel's weight over offsets ``-3G .. 3G - 1``."""
    G = len(decoded)

    def at(j):
        return 1.0 if j < 0 else float(decoded[min(j, G - 1)])

    weight = [math.exp(-d * d / (2 * sigma**2)) for d in range(-3 * G, 3 * G)]
    total = sum(weight)
    return [sum(math.exp(-(g - j) ** 2 / (2 * sigma**2)) * at(j) for j in range(-G, 2 * G)) / total
            for g in range(G)]


def reference_rows(conf, masked, committed, importance, valid, block, P, shift, k, p, w, sigma):
    """The rows one sequence recomputes next (a set of positions), restated from the paper's description with the
    released loop's block: ``block`` the block's positions that were masked before the step, whose count is the
    width the search range is rounded up to."""
    T = len(masked)
    G = T - P
    remaining = masked[P:]
    density = reference_density([not m for m in remaining], sigma)
    score = [c * d for c, d in zip(conf, density)]
    top = max(score)
    score = [s + top if g in block else s for g, s in enumerate(score)]
    width, start = len(block), min(block)
    count, end = 0, G - 1
    for g in range(G):
        count += remaining[g]
        if count >= k:
            end = g
            break
    end = (end // width + 1) * width - 1
    candidates = [g for g in range(start, end + 1) if remaining[g]]
    picked = sorted(candidates, key=lambda g: -score[g])[:k]
    rows = {P + g - shift for g in picked if g - shift >= 0} | {t for t in range(T) if committed[t]}
    allowed = [t for t in range(T) if t not in rows and valid[t]]
    total = sum(importance[t] for t in allowed)
    mass = 0.0
    for i, t in enumerate(sorted(allowed, key=lambda t: -importance[t])):
        mass += importance[t] / total
        if i > 0 and mass > p:
            break
        rows.add(t)
    if shift:
        rows.discard(P - 1)
        if 0 in picked:
            rows.add(P - 1)
    if w > 0:
        chosen = sorted(rows)
        for a, b in zip(chosen, chosen[1:]):
            if b - a <= w:
                rows |= set(range(a, b))
    return rows


@pytest.mark.parametrize("sigma", [3.0, 10.0])
def test_density_equals_the_gaussian_sum(sigma):
    gen = torch.Generator().manual_seed(1)
    decoded = torch.rand(4, 40, generator=gen) < 0.4
    decoded[0, -1], decoded[1, -1] = True, False
    got = certainty_density(decoded, density_kernel(40, sigma, decoded.device))
    for b in range(4):
        want = torch.tensor(reference_density(decoded[b].tolist(), sigma), dtype=torch.float64)
        assert torch.allclose(got[b], want, atol=1e-6), b


CASES = [  # (current_k, rollout_p, inflate_w, shift, block index)
    (32, 0.1, 0, 0, 0), (8, 0.1, 0, 0, 1), (4, 0.3, 4, 0, 2), (16, 0.5, 2, 1, 1), (8, 0.05, 0, 1, 0),
]


@pytest.mark.parametrize("k, p, w, shift, block", CASES)
def test_choice_equals_the_restated_rule(k, p, w, shift, block):
    P, G, bl = 7, 48, 8
    T = P + G
    gen = torch.Generator().manual_seed(k + block)
    config = D2CacheRefresh.Config(rollout_p=p, current_k=k, inflate_w=w)
    for trial in range(6):
        conf = 0.2 + 0.8 * torch.rand(1, G, generator=gen)
        start = block * bl
        masked = torch.zeros(1, T, dtype=torch.bool)
        masked[0, P + start:] = True
        masked[0, P + start: P + start + bl] = torch.rand(bl, generator=gen) < 0.6  # some of the block decoded
        masked[0, P + start] = True
        before = masked.clone()
        j = P + start + trial % bl
        masked[0, j] = False  # the step's commit (when it was masked)
        committed = before & ~masked
        columns = before[:, P + start: P + start + bl].nonzero()[:, 1] + start
        block_mask = torch.zeros(1, G, dtype=torch.bool)
        block_mask[0, columns] = True
        importance = torch.rand(1, T, generator=gen) ** 3
        valid = torch.ones(1, T, dtype=torch.bool)
        kernel = density_kernel(G, config.sigma, "cpu")
        got = choose_rows(config, kernel, conf, masked, committed, importance, valid, block_mask, P, shift)
        want = reference_rows(conf[0].tolist(), masked[0].tolist(), committed[0].tolist(), importance[0].tolist(),
                              valid[0].tolist(), set(columns.tolist()), P, shift, k, p, w, config.sigma)
        assert set(torch.nonzero(got[0]).flatten().tolist()) == want, trial


# -- decoding -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints():
    return {name: polestar.load(name, dtype=torch.float32) for name in ("tiny-llada", "tiny-dream-noisy")}


def test_every_row_chosen_equals_no_cache_decoding(checkpoints):
    """``rollout_p = 1`` chooses every position left after the density pick: each forward recomputes every position,
    as the no-cache baseline (ranked the same way) does; the first forward's second pass over the last layer for the
    confidences is the only extra work. (With Dream's shifted logits the released rule sets the last prompt row to
    "the first generation position was picked" after the nucleus, so once that position is decoded the row is never
    recomputed again: no setting recomputes every row there.)"""
    model = checkpoints["tiny-llada"]
    for text in PROMPTS:
        ids, mask = encode_prompts(model, [text])
        want, base = decode(model, ids, mask, assemble("baseline", {"commit.mask_in_softmax": True}), CONFIG)
        got, stats = decode(model, ids, mask, assemble("d2cache", {"refresh.rollout_p": 1.0}), CONFIG)
        assert got.tolist() == want.tolist(), text
        assert stats.nfe == base.nfe
        assert stats.token_layer_evals == base.token_layer_evals + GEN


def test_fewer_rows_than_no_cache(checkpoints):
    model = checkpoints["tiny-llada"]
    ids, mask = encode_prompts(model, [PROMPTS[0]])
    _, base = decode(model, ids, mask, assemble("baseline"), CONFIG)
    _, stats = decode(model, ids, mask, assemble("d2cache", {"refresh.current_k": 8}), CONFIG)
    assert stats.sequences[0].token_layer_evals < 0.8 * base.sequences[0].token_layer_evals


@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream-noisy"])
def test_rows_of_a_batch_decode_as_alone(checkpoints, name):
    """A left-padded batch: each row's tokens and own counters equal its decoding alone (no top-up to the batch's
    largest count)."""
    model = checkpoints[name]
    ids, mask = encode_prompts(model, list(PROMPTS))
    policy = assemble("d2cache", {"refresh.current_k": 8, "refresh.inflate_w": 3})
    tokens, stats = decode(model, ids, mask, policy, CONFIG)
    for i, text in enumerate(PROMPTS):
        one, alone = decode(model, *encode_prompts(model, [text]), policy, CONFIG)
        assert tokens[i, -GEN:].tolist() == one[0, -GEN:].tolist(), text
        assert stats.sequences[i] == alone.sequences[0], text


def test_rollout_equals_the_product_of_the_full_attention_maps():
    """At the first forward (every row recomputed) the rollout's column sums are those of the product over layers
    of ``(A_l + I) / 2`` (``A_l`` the layer's attention, mean over heads), computed here from the model's full
    forward with every layer's attention kept."""
    from polestar.models.layer_ops import LayerOps
    from polestar.models.plan import full_plan
    from polestar.policies import refresh_d2cache as d2

    model = make_model("llada", seed=5, n_layers=3, d_model=32)
    ids = torch.randint(0, 20, (1, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(1, 12, dtype=torch.bool)
    T = 12
    maps = []

    class Keep(LayerHook):
        evals = torch.zeros(1, dtype=torch.long)

        def members(self, layer, qkv):
            probs = LayerOps(model).attention_probs(qkv.q, cache.k[layer], cache.key_valid)
            maps.append(probs.mean(dim=1)[0, :, :T].double())

    with torch.no_grad():
        cache = model.new_cache(mask)
        model.run_plan(ids, cache, full_plan(1, T, ids.device), hook=Keep())
        want = torch.eye(T, dtype=torch.float64)
        for a in maps:
            want = ((a + torch.eye(T, dtype=torch.float64)) / 2) @ want
        local = d2.D2State(member=None, before=None, stepped=None, rollout=torch.eye(T + 1, T)[None].clone(),
                           eye=torch.eye(T + 1, T), confidence=None, kernel=None)

        class State:
            length, prompt_len, logit_shift, batch_size, n_layers = T, 0, 0, 1, 3
            active = torch.ones(1, dtype=torch.bool)
            x = ids

        cache = model.new_cache(mask)
        hook = d2._RolloutHook(State, cache, LayerOps(model), local, first=False)
        model.run_plan(ids, cache, full_plan(1, T, ids.device), hook=hook)
    got = local.rollout[0, :T].double()
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(got.sum(dim=0), want.sum(dim=0), atol=1e-5)


def test_stage_laws():
    """``polestar check-stage refresh:d2cache``: the contract, laws, decode invariants, determinism and batch
    invariance (each raises naming the broken law)."""
    check_stage("refresh", "d2cache")
