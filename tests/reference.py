"""Deliberately naive re-statements of the reference behaviour, used only by tests.

* ``naive_logits``: the LLaDA / Dream forward written out per layer from the formulas (no plan, no cache).
* ``llada_generate`` / ``fastdllm_generate``: LLaDA's and Fast-dLLM's generation loops restated with per-row
  Python loops and ``torch.topk``; the cache variants take ``stale`` forwards where K/V outside the recomputed
  span come from the block-start forward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _rms(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos.float()[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    rot = torch.cat([-x2, x1], -1)
    return x * ang.cos() + rot * ang.sin()


def layer_kv_inputs(model, ids):
    """Per-layer input hidden states of a full forward: list of ``[B, L, d]`` (index n_layers = final)."""
    spec = model.spec
    h = model.embed(ids)
    outs = [h]
    for layer in range(spec.n_layers):
        h = naive_layer(model, layer, h, h)
        outs.append(h)
    return outs


def naive_layer(model, layer, h_query, h_kv, query_pos=None):
    """One layer: queries from ``h_query [B, Q, d]`` (positions ``query_pos``), keys/values from ``h_kv [B, L, d]``."""
    spec = model.spec
    p = model.layer_parts(layer)
    B, Q, _ = h_query.shape
    L = h_kv.shape[1]
    if query_pos is None:
        query_pos = torch.arange(Q)
    hd, H, Hkv = spec.head_dim, spec.n_heads, spec.n_kv_heads
    xq = _rms(h_query, p.attn_norm.weight, spec.norm_eps)
    xk = _rms(h_kv, p.attn_norm.weight, spec.norm_eps)
    q = p.q(xq).view(B, Q, H, hd).transpose(1, 2)
    k = p.k(xk).view(B, L, Hkv, hd).transpose(1, 2)
    v = p.v(xk).view(B, L, Hkv, hd).transpose(1, 2)
    q = _rope(q, query_pos, spec.rope_theta)
    k = _rope(k, torch.arange(L), spec.rope_theta)
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), -1) @ v
    h = h_query + p.o(att.transpose(1, 2).reshape(B, Q, spec.d_model))
    y = _rms(h, p.mlp_norm.weight, spec.norm_eps)
    return h + p.down(F.silu(p.gate(y)) * p.up(y))


def naive_logits(model, ids):
    """Full-forward logits ``[B, L, V]``; shifted one position for Dream (``logits[:, 0]`` from hidden 0)."""
    h = layer_kv_inputs(model, ids)[-1]
    logits = model.head(model.final_norm(h))
    if model.spec.logit_shift:
        logits = torch.cat([logits[:, :1], logits[:, :-1]], 1)
    return logits


def stale_logits(model, ids, stale_inputs, start, end, shift=None):
    """Logits of positions ``[start, end)`` when only they are recomputed and every other position's K/V come from
    ``stale_inputs`` (the per-layer inputs of an earlier full forward) — Fast-dLLM's dual/prefix cache semantics.
    The recomputed span starts ``shift`` positions early (default: the model's logit shift, one for Dream's shifted
    logits; 0 gives the unshifted logits of hidden states ``[start, end)``)."""
    shift = model.spec.logit_shift if shift is None else shift
    s = start - shift
    pos = torch.arange(s, end)
    h = model.embed(ids[:, s:end])
    for layer in range(model.spec.n_layers):
        kv = stale_inputs[layer].clone()
        kv[:, s:end] = h
        h = naive_layer(model, layer, h, kv, pos)
    logits = model.head(model.final_norm(h))
    return logits[:, : end - start]


def _conf(logits, x0):
    p = torch.softmax(logits.double(), -1)
    return p.gather(-1, x0[..., None]).squeeze(-1)


def _argmax_no_mask(logits, mask_id):
    l2 = logits.clone()
    l2[..., mask_id] = float("-inf")
    return l2.argmax(-1)


def llada_generate(model, prompt, steps, gen_length, block_length):
    """LLaDA's greedy ``generate`` (low-confidence remasking) at batch 1; returns (x, nfe)."""
    spec = model.spec
    mask_id = spec.mask_id
    P = prompt.shape[1]
    x = torch.full((1, P + gen_length), mask_id, dtype=torch.long)
    x[:, :P] = prompt
    nb = gen_length // block_length
    spb = steps // nb
    nfe = 0
    for b in range(nb):
        s, e = P + b * block_length, P + (b + 1) * block_length
        n_mask = int((x[0, s:e] == mask_id).sum())
        counts = [n_mask // spb + (1 if i < n_mask % spb else 0) for i in range(spb)]
        for i in range(spb):
            if not (x[0, s:e] == mask_id).any():
                break  # the reference would spend a no-op forward here
            logits = naive_logits(model, x)
            nfe += 1
            x0 = _argmax_no_mask(logits, mask_id)
            conf = _conf(logits, x0)
            conf[:, e:] = float("-inf")
            conf = torch.where(x == mask_id, conf, torch.tensor(float("-inf"), dtype=conf.dtype))
            _, sel = torch.topk(conf[0], k=counts[i])
            x[0, sel] = x0[0, sel]
    return x, nfe


def fastdllm_generate(model, prompt, gen_length, block_length, threshold, cache="none"):
    """Fast-dLLM's greedy threshold decoding at batch 1 with ``cache`` in {"none", "prefix", "dual"}."""
    spec = model.spec
    mask_id = spec.mask_id
    P = prompt.shape[1]
    T = P + gen_length
    x = torch.full((1, T), mask_id, dtype=torch.long)
    x[:, :P] = prompt
    nfe = 0
    for b in range(gen_length // block_length):
        s, e = P + b * block_length, P + (b + 1) * block_length
        step = 0
        stale = None
        while (x[0, s:e] == mask_id).any():
            if cache == "none" or step == 0:
                stale = layer_kv_inputs(model, x)
                logits = naive_logits(model, x)[:, s:e]
            else:
                end = T if cache == "prefix" else e
                logits = stale_logits(model, x, stale, s, end)[:, : e - s]
            nfe += 1
            x0 = _argmax_no_mask(logits, mask_id)
            conf = _conf(logits, x0)
            masked = x[:, s:e] == mask_id
            conf = torch.where(masked, conf, torch.tensor(float("-inf"), dtype=conf.dtype))
            n = int(masked.sum())
            _, sel = torch.topk(conf[0], k=n)
            keep = [int(sel[0])] + [int(j) for j in sel[1:] if conf[0, j] >= threshold]
            for j in keep:
                x[0, s + j] = x0[0, j]
            step += 1
    return x, nfe
