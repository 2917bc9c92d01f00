"""WINO (Wide-In, Narrow-Out): the ``wino`` policy against a naive restatement of the rule, written out from the
paper ("Wide-In, Narrow-Out: Revokable Decoding for Efficient and Effective DLLMs") with Research dLLM's caps: one
full forward of ``[prompt, generation, shadow block]`` per step under a 4-D attention mask (no row but the shadow
block's sees the shadow block; shadow row ``j`` sees every column but the block's ``j``), no cache, batch 1."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import polestar
from polestar.policies.commit_wino import narrow_out, wide_in
from tests.conftest import make_model
from tests.reference import _rms, _rope

PROMPT = [5, 7, 1, 3, 9, 2, 4]
SETTINGS = [(0.7, 0.9), (0.0, 0.99), (0.05, 0.5)]


def masked_logits(model, ids, pos, allowed):
    """Full forward of ``ids [1, L]`` at RoPE positions ``pos [L]`` where row ``i`` attends to column ``j`` iff
    ``allowed [L, L]`` → logits ``[1, L, V]``, every layer written out from the formulas."""
    spec = model.spec
    hd, H, Hkv = spec.head_dim, spec.n_heads, spec.n_kv_heads
    h = model.embed(ids)
    L = ids.shape[1]
    for layer in range(spec.n_layers):
        p = model.layer_parts(layer)
        x = _rms(h, p.attn_norm.weight, spec.norm_eps)
        q = _rope(p.q(x).view(1, L, H, hd).transpose(1, 2), pos, spec.rope_theta)
        k = _rope(p.k(x).view(1, L, Hkv, hd).transpose(1, 2), pos, spec.rope_theta).repeat_interleave(H // Hkv, 1)
        v = p.v(x).view(1, L, Hkv, hd).transpose(1, 2).repeat_interleave(H // Hkv, 1)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~allowed, float("-inf"))
        h = h + p.o((torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(1, L, -1))
        y = _rms(h, p.mlp_norm.weight, spec.norm_eps)
        h = h + p.down(F.silu(p.gate(y)) * p.up(y))
    return model.head(model.final_norm(h))


def wino_reference(model, prompt, gen_length, block_length, wide, narrow):
    """WINO at batch 1 (LLaDA): returns (tokens, forwards, revocations)."""
    mask_id = model.spec.mask_id
    P, bl = len(prompt), block_length
    x = torch.full((1, P + gen_length), mask_id)
    x[0, :P] = torch.tensor(prompt)
    L = x.shape[1]
    nfe = revoked = 0
    for s in range(P, L, bl):
        e = s + bl
        allowed = torch.ones(L + bl, L + bl, dtype=torch.bool)
        allowed[:L, L:] = False  # nothing attends to the shadow block
        allowed[L:, s:e] &= ~torch.eye(bl, dtype=torch.bool)  # shadow row j: the block's column j left out
        pos = torch.cat([torch.arange(L), torch.arange(s, e)])
        while (x[0, s:e] == mask_id).any():
            ext = torch.cat([x, torch.full((1, bl), mask_id)], 1)
            logits = masked_logits(model, ext, pos, allowed)[0].double()
            nfe += 1
            probs = torch.softmax(logits, -1)  # Research dLLM: the whole vocabulary, mask token included
            no_mask = logits.clone()
            no_mask[:, mask_id] = float("-inf")
            x0 = no_mask[s:e].argmax(-1)  # proposals never the mask token
            masked = x[0, s:e] == mask_id
            conf = torch.where(masked, probs[s:e].gather(-1, x0[:, None])[:, 0], float("-inf"))
            cap = max(min(max(int(masked.sum() * 0.7), 5), 20), 1)
            above = (conf >= wide).nonzero().flatten()
            if len(above) > cap:
                sel = conf.topk(cap).indices
            elif len(above) == 0:
                sel = conf.argmax()[None]
            else:
                sel = above
            # narrow-out: drafts of earlier steps, scored by the shadow row of their position
            verify = torch.where(~masked, probs[L:].gather(-1, x[0, s:e, None])[:, 0], float("inf"))
            low = (verify < narrow).nonzero().flatten()
            k = len(sel) - 1
            if len(low) > k:
                low = verify.topk(k, largest=False).indices if k > 0 else low[:0]
            x[0, s + sel] = x0[sel]
            x[0, s + low] = mask_id
            revoked += len(low)
    return x, nfe, revoked


@pytest.mark.parametrize("wide, narrow", SETTINGS)
def test_wino_matches_the_naive_restatement(wide, narrow):
    m = make_model("llada", seed=1).double()
    out = polestar.generate(m, [PROMPT], policy="wino", gen_length=32, block_length=8, stop_at_eos=False,
                            wide_in_thres=wide, narrow_out_thres=narrow)
    ref, nfe, revoked = wino_reference(m, PROMPT, 32, 8, wide, narrow)
    assert out.tokens.tolist() == ref.tolist()
    assert out.stats.nfe == nfe
    assert out.stats.revoked == revoked


def test_some_setting_revokes():
    """The restatement is exercised with revocations (a random tiny model is unsure, so a low wide-in threshold
    drafts many tokens and a high narrow-out threshold takes some back)."""
    m = make_model("llada", seed=1).double()
    out = polestar.generate(m, [PROMPT], policy="wino", gen_length=32, block_length=8, stop_at_eos=False,
                            wide_in_thres=0.0, narrow_out_thres=0.99)
    assert out.stats.revoked > 0
    assert out.stats.tokens == 32 and out.stats.tpf == 32 / out.stats.nfe


def test_wide_in_caps_and_falls_back_to_the_top_one():
    conf = torch.tensor([[0.95, 0.9, 0.8, 0.75, 0.72, 0.71, 0.1, 0.2], [0.1, 0.3, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0]],
                        dtype=torch.float64)
    masked = torch.ones(2, 8, dtype=torch.bool)
    got = wide_in(conf, masked, 0.7)
    assert got[0].tolist() == [True] * 5 + [False] * 3  # 6 above, cap max(int(8 · 0.7), 5) = 5: the top 5
    assert got[1].tolist() == [False, True] + [False] * 6  # none above: the most confident


def test_narrow_out_keeps_net_progress():
    verify = torch.tensor([[0.1, 0.2, 0.3, 0.95, 0.5, 0.0, 0.0, 0.0]], dtype=torch.float64)
    drafted = torch.tensor([[True, True, True, True, True, False, False, False]])
    assert narrow_out(verify, drafted, torch.tensor([3]), 0.9)[0].tolist() == [True, True] + [False] * 6
    assert not narrow_out(verify, drafted, torch.tensor([1]), 0.9).any()  # one draft: nothing taken back
    assert narrow_out(verify, drafted, torch.tensor([6]), 0.9)[0].tolist() == [True] * 3 + [False, True] + [False] * 3


def test_shadow_pass_is_counted_in_rows_computed():
    """Past a block's first step every step runs ``bl`` shadow rows through every layer, counted in the run's and
    the sequence's rows."""
    m = make_model("llada", seed=1)
    kw = dict(gen_length=16, block_length=8, stop_at_eos=False)
    out = polestar.generate(m, [PROMPT], policy="wino", **kw)
    n_layers, L = m.spec.n_layers, len(PROMPT) + 16
    shadow_steps = out.stats.nfe - 2  # two blocks: their first steps verify nothing
    assert out.stats.token_layer_evals == n_layers * (out.stats.nfe * L + shadow_steps * 8)
    assert out.stats.sequences[0].token_layer_evals == out.stats.token_layer_evals


@pytest.mark.slow
def test_compiled_wino_equals_eager():
    m = polestar.load("tiny-llada", dtype=torch.float32, device="cpu")
    kw = dict(policy="wino", gen_length=32, block_length=8, wide_in_thres=0.3, narrow_out_thres=0.95)
    prompts = ["12+7=", "3*4+1="]
    eager = polestar.generate(m, prompts, **kw)
    compiled = polestar.generate(m, prompts, compile=True, **kw)
    assert compiled.tokens.tolist() == eager.tokens.tolist()
    assert compiled.stats.sequences == eager.stats.sequences
    assert compiled.stats.compiled_steps == compiled.stats.nfe
    assert eager.stats.revoked > 0  # the revoking path is compiled too


def test_wino_is_refused_with_a_sliding_window():
    with pytest.raises(ValueError, match="wino"):
        polestar.assemble("wino", {"refresh": "elastic"})
