"""Properties of the naive dLLM-Cache and Elastic-Cache references (``tests/reference.py``) that hold without the
official code.

Token identity of the references with the official dLLM-Cache and Elastic-Cache code is measured outside the repository
(a side-by-side run, 100 arith problems per setting); these tests pin what the references must keep doing:
where each method reduces to plain decoding, how its rows are counted, the sliding window, the trigger's extremes,
the EOS rule, and that a batch row decodes as if alone. Small sizes keep the file to a few seconds.
"""

import pytest
import torch

import polestar
from tests.reference import dllm_cache_generate, elastic_cache_generate, llada_generate, naive_logits

GEN, BLOCK = 8, 4
PROMPTS = ("arith:7-7-7-5*5*0=", "arith:4+6=")


@pytest.fixture(scope="module")
def llada():
    return polestar.load("tiny-llada", dtype=torch.float32)


@pytest.fixture(scope="module")
def dream():
    return polestar.load("tiny-dream", dtype=torch.float32)


def ids_of(model, *texts):
    """Left-padded ids ``[B, P]`` and mask of ``texts`` (pad id on the left, as the library batches prompts)."""
    rows = [model.tokenizer(t)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), model.spec.pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for b, r in enumerate(rows):
        ids[b, width - len(r):] = torch.tensor(r)
        mask[b, width - len(r):] = True
    return ids, mask


@torch.no_grad()
def test_dllm_cache_that_refreshes_every_row_is_llada(llada):
    """Prompt refreshed every forward and every response row recomputed (response interval 1, or ratio 1): plain
    LLaDA low-confidence decoding, all ``T`` rows in every layer of every forward, no value probe."""
    ids, _ = ids_of(llada, PROMPTS[0])
    T, L = ids.shape[1] + GEN, llada.spec.n_layers
    want, _ = llada_generate(llada, ids, steps=GEN, gen_length=GEN, block_length=BLOCK)
    for gen_interval, ratio in ((1, 0.25), (5, 1.0)):
        x, stats = dllm_cache_generate(llada, ids, gen_length=GEN, steps=GEN, block_length=BLOCK, prompt_interval=1,
                                       gen_interval=gen_interval, ratio=ratio)
        assert torch.equal(x, want)
        assert stats[0]["rows"] == GEN * T * L and stats[0]["nfe"] == GEN
        assert stats[0]["probe_rows"] == (GEN * (L - 1) * GEN * (1 - ratio) if gen_interval > 1 else 0)


def dllm_rows(P, G, L, steps, prompt_interval, gen_interval, ratio):
    """Rows and value-probe rows of dLLM-Cache's schedule: layer 0 recomputes all ``T`` rows every forward; layer
    ``l > 0`` at forward ``n`` all rows (both refreshes due), the response rows (response refresh), the prompt rows
    plus the ``int(G * ratio)`` picked rows (prompt refresh), or only the picked rows (neither)."""
    n_sel = int(G * ratio) if 0 < ratio <= 1 else 0
    rows = steps * (P + G)
    probe = 0
    for n in range(1, steps + 1):
        gen, prompt = (n - 1) % gen_interval == 0, (n - 1) % prompt_interval == 0
        per_layer = P + G if gen and prompt else G if gen else P + n_sel if prompt else n_sel
        rows += (L - 1) * per_layer
        if not gen and n_sel:
            probe += (L - 1) * (G - n_sel)
    return rows, probe


@pytest.mark.parametrize("ratio", [0.25, 0.0])
@torch.no_grad()
def test_dllm_cache_rows_follow_its_fixed_schedule(llada, ratio):
    ids, _ = ids_of(llada, PROMPTS[0])
    _, stats = dllm_cache_generate(llada, ids, gen_length=GEN, steps=GEN, block_length=BLOCK, prompt_interval=5,
                                   gen_interval=3, ratio=ratio)
    want = dllm_rows(ids.shape[1], GEN, llada.spec.n_layers, GEN, 5, 3, ratio)
    assert (stats[0]["rows"], stats[0]["probe_rows"]) == want
    assert stats[0]["rows_per_token"] == want[0] / GEN


@torch.no_grad()
def test_dllm_cache_dream_full_refresh_variants_agree(dream):
    """On Dream (its own entropy-ordered loop over the whole response) the two ways of recomputing every row agree
    once the picked rows' keys are written whole (``dream_k_cols=None``; the official hook writes only the first
    ``d_model // 7`` key columns, which is Dream-7B's K width but short of the tiny model's)."""
    ids, _ = ids_of(dream, PROMPTS[1])
    full = GEN * (ids.shape[1] + GEN) * dream.spec.n_layers
    a, sa = dllm_cache_generate(dream, ids, gen_length=GEN, steps=GEN, prompt_interval=1, gen_interval=1)
    b, sb = dllm_cache_generate(dream, ids, gen_length=GEN, steps=GEN, prompt_interval=1, gen_interval=4, ratio=1.0,
                                dream_k_cols=None)
    assert torch.equal(a, b) and sa[0]["rows"] == sb[0]["rows"] == full


@torch.no_grad()
def test_elastic_gamma_zero_never_triggers(llada):
    """Attention rows are non-negative, so their cosine is never below 0: every forward after the first recomputes
    only its query rows (tracked, newly decoded, window), the same rows in every layer."""
    ids, _ = ids_of(llada, PROMPTS[0])
    T, L = ids.shape[1] + GEN, llada.spec.n_layers
    _, stats = elastic_cache_generate(llada, ids, gen_length=GEN, window_length=4, gamma=0.0)
    st = stats[0]
    assert st["triggers"] == 0 and st["nfe"] > 1
    assert st["rows"] % L == 0 and T * L < st["rows"] < st["nfe"] * T * L
    assert st["probe_rows"] >= (st["nfe"] - 1) * L  # at least one tracked token re-scored per layer


@torch.no_grad()
def test_elastic_gamma_above_one_triggers_at_layer_zero_every_step(llada):
    """``gamma > 1``: layer 0's check always fires, so layers 1.. recompute all ``T`` rows from cached inputs."""
    ids, _ = ids_of(llada, PROMPTS[0])
    T, L = ids.shape[1] + GEN, llada.spec.n_layers
    _, stats = elastic_cache_generate(llada, ids, gen_length=GEN, window_length=4, gamma=2.0)
    st = stats[0]
    later = st["nfe"] - 1
    assert later > 0 and st["triggers"] == later
    layer0 = st["rows"] - T * L - later * (L - 1) * T  # layer 0's query rows over the later forwards
    assert later * 2 <= layer0 <= later * T
    assert later <= st["probe_rows"] <= later * L  # only layer 0 is checked


@torch.no_grad()
def test_elastic_window_slides_over_the_masks(llada):
    """Threshold 0 commits the whole window each forward: ``G / w`` forwards left to right; the first forward is the
    full forward, so the first window holds its greedy tokens. A window covering the generation commits everything
    from the full forward; block caching off (the window cut after the forward) changes nothing there."""
    ids, _ = ids_of(llada, PROMPTS[0])
    P = ids.shape[1]
    x0 = naive_logits(llada, torch.cat([ids, torch.full((1, GEN), llada.spec.mask_id)], 1))[0, P:].argmax(-1)
    x, stats = elastic_cache_generate(llada, ids, gen_length=GEN, window_length=4, threshold=0.0)
    assert stats[0]["nfe"] == GEN // 4 and torch.equal(x[0, P:P + 4], x0[:4])
    whole, stats = elastic_cache_generate(llada, ids, gen_length=GEN, window_length=GEN, threshold=0.0)
    assert stats[0]["nfe"] == 1 and torch.equal(whole[0, P:], x0)
    a, _ = elastic_cache_generate(llada, ids, gen_length=GEN, window_length=GEN)
    b, _ = elastic_cache_generate(llada, ids, gen_length=GEN, window_length=4 * GEN)
    c, _ = elastic_cache_generate(llada, ids, gen_length=GEN, window_length=GEN, block_caching=False)
    assert torch.equal(a, b) and torch.equal(a, c)


@torch.no_grad()
def test_elastic_eos_leaves_the_positions_right_of_the_first_eos_masked(llada):
    """The official EOS rule: once an EOS is committed, masks right of it are dropped (they stay masks)."""
    ids, _ = ids_of(llada, PROMPTS[0])
    P, mask_id = ids.shape[1], llada.spec.mask_id
    free, _ = elastic_cache_generate(llada, ids, gen_length=GEN, window_length=4)
    eos = int(free[0, P + GEN // 2])  # a token the generation commits mid-way stands in for EOS
    x, _ = elastic_cache_generate(llada, ids, gen_length=GEN, window_length=4, eos_id=eos)
    gen = x[0, P:].tolist()
    masks = [j for j, t in enumerate(gen) if t == mask_id]
    assert eos in gen
    if masks:
        assert eos in gen[:masks[0]]
    assert elastic_cache_generate(llada, ids, gen_length=GEN, window_length=4, eos_id=None)[0].equal(free)


@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
@torch.no_grad()
def test_mixed_length_batch_rows_decode_as_alone(name, llada, dream):
    model = llada if name == "tiny-llada" else dream
    ids, mask = ids_of(model, *PROMPTS)
    for generate, kw in ((dllm_cache_generate, {"steps": GEN, "block_length": BLOCK, "prompt_interval": 5,
                                                "gen_interval": 3}),
                         (elastic_cache_generate, {"window_length": 4})):
        batch, stats = generate(model, ids, attention_mask=mask, gen_length=GEN, **kw)
        for b, text in enumerate(PROMPTS):
            alone_ids, _ = ids_of(model, text)
            alone, alone_stats = generate(model, alone_ids, gen_length=GEN, **kw)
            width = alone.shape[1]
            assert torch.equal(batch[b, -width:], alone[0])
            assert (batch[b, :-width] == model.spec.pad_id).all()
            assert stats[b] == alone_stats[0]
