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


# ---------------------------------------------------------------------------------------------------------------------
# dLLM-Cache and Elastic-Cache restated naively from their official code as it runs (per-row Python loops, no fixed
# shapes, every batch row decoded as if alone).  Both return ``(x, stats)``: ``x [B, P_max + gen_length]`` with the
# prompts right-aligned (left padding with the pad id) and ``stats`` one dict per row: ``nfe`` forward passes,
# ``rows`` token-layer evaluations (every row that went through a layer's attention and MLP, summed over layers and
# forwards), ``probe_rows`` the method's query-only rows (dLLM-Cache: rows whose value projection was computed only to
# pick the ``ratio`` rows; Elastic-Cache: tracked tokens whose old attention was re-scored for the trigger, one per
# tracked token and checked layer), ``rows_per_token`` = rows / gen_length and ``triggers`` (Elastic-Cache: forwards
# in which a layer before the last fired, so that the later layers recomputed every row) and ``similarity``
# (Elastic-Cache: ``(forward, layer, sim)`` for every checked layer, the tracked tokens' mean attention cosine).
# ---------------------------------------------------------------------------------------------------------------------


def _prompt_rows(prompt, attention_mask):
    """Each batch row's own prompt ids (its left padding dropped), as 1-D LongTensors."""
    if attention_mask is None:
        return [prompt[b] for b in range(prompt.shape[0])]
    return [prompt[b][attention_mask[b].bool()] for b in range(prompt.shape[0])]


def _right_align(seqs, pad_id):
    width = max(s.shape[0] for s in seqs)
    out = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for b, s in enumerate(seqs):
        out[b, width - s.shape[0]:] = s
    return out


def _rot(model, t, pos):
    """RoPE of ``t [1, H, N, hd]`` at positions ``pos [N]`` (half-split rotation, fp32)."""
    cos, sin = model.rotary.cos_sin(pos[None])
    return model.rotary.apply(t, cos, sin)


def _mlp(parts, h):
    y = parts.mlp_norm(h)
    return parts.down(F.silu(parts.gate(y)) * parts.up(y))


# -- dLLM-Cache -----------------------------------------------------------------------------------------------------


def _dllm_forward(model, x, P, n, cache, prompt_interval, gen_interval, ratio, k_cols, count):
    """One forward of dLLM-Cache's hooked model (forward ``n``, 1-based): logits ``[1, T, V]`` (unshifted).

    Per layer, ``cache[layer]`` holds the prompt and response K/V (before RoPE), attention outputs (after the output
    projection) and MLP outputs.  Layer 0 always recomputes everything; the other layers refresh the prompt rows every
    ``prompt_interval`` forwards and the response rows every ``gen_interval`` forwards (counted from forward 1); between
    response refreshes they recompute the ``int(G * ratio)`` response rows whose freshly projected values are least
    cosine-similar to the cached ones (the cached values are then replaced by all fresh values; keys, attention and
    MLP outputs only at the picked rows)."""
    spec = model.spec
    H, Hkv, hd, d = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.d_model
    T = x.shape[1]
    G = T - P
    every = torch.arange(T)
    transfer = 0 < ratio <= 1
    n_sel = int(G * ratio)
    h = model.embed(x)
    for layer in range(spec.n_layers):
        p = model.layer_parts(layer)
        c = cache[layer]
        refresh_gen = (n - 1) % gen_interval == 0 or layer == 0
        refresh_prompt = (n - 1) % prompt_interval == 0 or layer == 0

        def attend(q, qpos, k, v, p=p):
            N = q.shape[1]
            qh = _rot(model, q.view(1, N, H, hd).transpose(1, 2), qpos)
            kh = _rot(model, k.view(1, T, Hkv, hd).transpose(1, 2), every)
            vh = v.view(1, T, Hkv, hd).transpose(1, 2)
            if Hkv != H:
                kh = kh.repeat_interleave(H // Hkv, dim=1)
                vh = vh.repeat_interleave(H // Hkv, dim=1)
            att = F.scaled_dot_product_attention(qh, kh, vh)
            return p.o(att.transpose(1, 2).reshape(1, N, d))

        def pick(xg, c=c, p=p):
            """Fresh values of all response rows, the picked rows and their fresh q, k; updates the V/K caches."""
            v_new = p.v(xg)
            idx = torch.topk(F.cosine_similarity(v_new, c["vg"], dim=-1), largest=False, k=n_sel).indices[0]
            xs = xg[:, idx]
            qs, ks = p.q(xs), p.k(xs)
            c["vg"] = v_new
            kg = c["kg"].clone()
            cols = kg.shape[-1] if k_cols is None else k_cols
            kg[:, idx, :cols] = ks[:, :, :cols]
            c["kg"] = kg
            count["probe_rows"] += G - n_sel
            return idx, qs

        def put(name, idx, rows, c=c):
            t = c[name].clone()
            t[:, idx] = rows
            c[name] = t

        if refresh_gen and refresh_prompt:
            xn = p.attn_norm(h)
            q, k, v = p.q(xn), p.k(xn), p.v(xn)
            c["kp"], c["vp"], c["kg"], c["vg"] = k[:, :P], v[:, :P], k[:, P:], v[:, P:]
            att = attend(q, every, k, v)
            c["ap"], c["ag"] = att[:, :P], att[:, P:]
            h1 = h + att
            m = _mlp(p, h1)
            c["mp"], c["mg"] = m[:, :P], m[:, P:]
            count["rows"] += T
        elif refresh_gen:
            xg = p.attn_norm(h[:, P:])
            q, kg, vg = p.q(xg), p.k(xg), p.v(xg)
            c["kg"], c["vg"] = kg, vg
            ag = attend(q, every[P:], torch.cat([c["kp"], kg], 1), torch.cat([c["vp"], vg], 1))
            c["ag"] = ag
            h1 = h + torch.cat([c["ap"], ag], 1)
            mg = _mlp(p, h1[:, P:])
            c["mg"] = mg
            m = torch.cat([c["mp"], mg], 1)
            count["rows"] += G
        elif refresh_prompt:
            xp = p.attn_norm(h[:, :P])
            qp, kp, vp = p.q(xp), p.k(xp), p.v(xp)
            c["kp"], c["vp"] = kp, vp
            if transfer:
                idx, qs = pick(p.attn_norm(h[:, P:]))
            k, v = torch.cat([kp, c["kg"]], 1), torch.cat([vp, c["vg"]], 1)
            if transfer:
                a = attend(torch.cat([qp, qs], 1), torch.cat([every[:P], idx + P]), k, v)
                c["ap"] = a[:, :P]
                put("ag", idx, a[:, P:])
            else:
                c["ap"] = attend(qp, every[:P], k, v)
            h1 = h + torch.cat([c["ap"], c["ag"]], 1)
            if transfer:
                mz = _mlp(p, torch.cat([h1[:, :P], h1[:, P:][:, idx]], 1))
                c["mp"] = mz[:, :P]
                put("mg", idx, mz[:, P:])
            else:
                c["mp"] = _mlp(p, h1[:, :P])
            m = torch.cat([c["mp"], c["mg"]], 1)
            count["rows"] += P + (n_sel if transfer else 0)
        else:
            if transfer:
                idx, qs = pick(p.attn_norm(h[:, P:]))
                a = attend(qs, idx + P, torch.cat([c["kp"], c["kg"]], 1), torch.cat([c["vp"], c["vg"]], 1))
                put("ag", idx, a)
            h1 = h + torch.cat([c["ap"], c["ag"]], 1)
            if transfer:
                put("mg", idx, _mlp(p, h1[:, P:][:, idx]))
                count["rows"] += n_sel
            m = torch.cat([c["mp"], c["mg"]], 1)
        h = h1 + m
    return model.head(model.final_norm(h))


def _dllm_llada_row(model, ids, gen_length, steps, block_length, prompt_interval, gen_interval, ratio, k_cols):
    """dLLM-Cache's LLaDA generation loop (its ``utils.generate``: blocks of ``block_length``, ``steps // blocks``
    forwards per block, low-confidence remasking, greedy) for one prompt (on Dream with its logits shifted by one)."""
    mask_id = model.spec.mask_id
    P = ids.shape[0]
    x = torch.full((1, P + gen_length), mask_id, dtype=torch.long)
    x[0, :P] = ids
    n_blocks = gen_length // block_length
    per_block = steps // n_blocks
    cache = [{} for _ in range(model.spec.n_layers)]
    count = {"rows": 0, "probe_rows": 0}
    n = 0
    for b in range(n_blocks):
        n_mask = int((x[0, P + b * block_length:P + (b + 1) * block_length] == mask_id).sum())
        counts = [n_mask // per_block + (1 if i < n_mask % per_block else 0) for i in range(per_block)]
        for i in range(per_block):
            masked = x[:, P:] == mask_id
            n += 1
            logits = _dllm_forward(model, x, P, n, cache, prompt_interval, gen_interval, ratio, k_cols, count)
            if model.spec.logit_shift:  # Dream: position j predicted from row j - 1
                logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
            logits = logits[:, P:]
            x0 = torch.argmax(logits.exp(), dim=-1)  # temperature 0: the official "noise" is exp(logits)
            p = F.softmax(logits, dim=-1)
            conf = torch.gather(p, -1, x0[..., None]).squeeze(-1)
            conf[:, (b + 1) * block_length:] = float("-inf")
            conf = torch.where(masked, conf, torch.tensor(float("-inf")))
            sel = torch.topk(conf[0], k=counts[i]).indices
            x[0, P + sel] = x0[0, sel]
    return x[0], {"nfe": n, **count}


def _dllm_dream_row(model, ids, gen_length, steps, prompt_interval, gen_interval, ratio, k_cols, alg, eps):
    """Dream's ``diffusion_generate`` loop (greedy; ``alg`` in maskgit_plus / topk_margin / entropy) on dLLM-Cache's
    hooked Dream model, for one prompt: ``steps`` forwards over the whole response, logits shifted by one, the
    ``int(n_mask * (1 - s/t))`` most confident masked positions committed (all of them at the last step)."""
    mask_id = model.spec.mask_id
    P = ids.shape[0]
    x = torch.full((1, P + gen_length), mask_id, dtype=torch.long)
    x[0, :P] = ids
    cache = [{} for _ in range(model.spec.n_layers)]
    count = {"rows": 0, "probe_rows": 0}
    timesteps = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        masked = x == mask_id
        logits = _dllm_forward(model, x, P, i + 1, cache, prompt_interval, gen_interval, ratio, k_cols, count)
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        probs = torch.softmax(logits[masked], dim=-1)
        conf, x0 = probs.max(dim=-1)
        if alg == "topk_margin":
            top = torch.sort(probs, dim=-1, descending=True).values
            conf = top[:, 0] - top[:, 1]
        elif alg == "entropy":
            conf = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
        elif alg != "maskgit_plus":
            raise ValueError(f"unsupported alg {alg!r}")
        t, s = timesteps[i], timesteps[i + 1]
        n_mask = masked.sum() / masked.shape[0]
        k = int(n_mask * (1 - s / t)) if i < steps - 1 else int(n_mask)
        full = torch.full(x.shape, float("-inf"), dtype=logits.dtype)
        full[masked] = conf
        if k > 0:
            sel = torch.topk(full, k).indices[0]
            x_ = torch.full_like(x, mask_id)
            x_[masked] = x0
            x[0, sel] = x_[0, sel]
    return x[0], {"nfe": steps, **count}


def dllm_cache_generate(model, prompt, attention_mask=None, gen_length=64, steps=64, block_length=16,
                        prompt_interval=50, gen_interval=7, ratio=0.25, alg="entropy", eps=1e-3,
                        dream_k_cols="official", loop=None):
    """dLLM-Cache (maomaocun/dLLM-cache) as its official code runs, one batch row at a time.

    ``prompt [B, P]`` (left padding marked 0 in ``attention_mask [B, P]``, each row decoded as if alone).
    LLaDA: the repository's LLaDA loop (``steps`` forwards in blocks of ``block_length``, low-confidence
    remasking).  Dream: Dream's own ``diffusion_generate`` loop with ``alg`` (dLLM-Cache's Dream scripts use
    ``entropy``) over ``steps`` forwards.  ``dream_k_cols``: the Dream hook writes the picked rows' fresh keys into
    only the first ``d_model // 7`` key columns (right for Dream-7B's 512-wide K, short on other widths);
    ``"official"`` reproduces that, ``None`` writes whole rows.  ``loop="llada"``: the LLaDA loop on either family
    (on Dream not a released configuration; it checks the hooked forward inside LLaDA's schedule).  Returns
    ``(x, stats)`` (see above)."""
    spec = model.spec
    k_cols = None
    if spec.family == "dream" and dream_k_cols == "official":
        k_cols = spec.d_model // 7
    outs, stats = [], []
    for ids in _prompt_rows(prompt, attention_mask):
        if spec.family == "llada" or loop == "llada":
            seq, st = _dllm_llada_row(model, ids, gen_length, steps, block_length, prompt_interval, gen_interval,
                                      ratio, k_cols)
        else:
            seq, st = _dllm_dream_row(model, ids, gen_length, steps, prompt_interval, gen_interval, ratio, k_cols,
                                      alg, eps)
        st["rows_per_token"] = st["rows"] / gen_length
        outs.append(seq)
        stats.append(st)
    return _right_align(outs, spec.pad_id), stats


# -- Elastic-Cache --------------------------------------------------------------------------------------------------


def _elastic_row(model, ids, gen_length, window_length, threshold, tokens_per_iter, gamma, track_num, eos_id,
                 block_caching):
    """Elastic-Cache's ``generate_with_elastic_cache`` (LLaDA) / ``_sample`` (Dream) for one prompt."""
    spec = model.spec
    dream = spec.family == "dream"
    L, H, Hkv, hd, d = spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.d_model
    P = ids.shape[0]
    T = P + gen_length
    x = torch.full((1, T), spec.mask_id, dtype=torch.long)
    x[0, :P] = ids
    every = torch.arange(T)
    track = every[:0]
    new = every[:P]
    masked = every[P:]
    cache = [{} for _ in range(L)]
    st = {"nfe": 0, "rows": 0, "probe_rows": 0, "triggers": 0, "similarity": []}
    decoded_eos = False
    i = 0
    while True:
        window = masked[:window_length] if block_caching else masked
        if dream:
            window = window - 1  # Dream's logits at i-1 predict token i
        if i == 0:
            qpos, start = every, -1
        else:
            qpos, start = torch.cat([track, new, window]), L
        h = model.embed(x[:, qpos])
        for layer in range(L):
            p = model.layer_parts(layer)
            c = cache[layer]
            if layer > start:
                c["x"] = h
            else:
                c["x"][:, qpos] = h
                if layer == start:
                    h = c["x"]
            N = h.shape[1]
            xn = p.attn_norm(h)
            q = p.q(xn).view(1, N, H, hd).transpose(1, 2)
            k = p.k(xn).view(1, N, Hkv, hd).transpose(1, 2)
            v = p.v(xn).view(1, N, Hkv, hd).transpose(1, 2)
            # the official picks the RoPE table by row count: LLaDA "as many rows as queried", Dream "not all rows"
            use_q = (N != T) if dream else (N == qpos.shape[0])
            rpos = qpos if use_q else every
            q, k = _rot(model, q, rpos), _rot(model, k, rpos)
            if dream and Hkv != H:  # Dream caches the repeated heads
                k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
            checked = layer < start
            if not checked:
                c["q"], c["k"], c["v"] = q, k, v
            else:
                past_k = c["k"].clone()
                c["k"][:, :, qpos] = k
                c["v"][:, :, qpos] = v
                past_q = c["q"][:, :, track].clone()
                c["q"][:, :, qpos] = q
                k, v = c["k"], c["v"]
            if not dream and Hkv != H:
                k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
            if dream:
                w = torch.softmax(torch.matmul(q, k.transpose(2, 3)) / math.sqrt(hd), dim=-1, dtype=torch.float32)
            else:
                w = torch.softmax(q @ k.transpose(-2, -1) * (1 / math.sqrt(hd)), dim=-1)
            att = p.o((w @ v).transpose(1, 2).reshape(1, N, d))
            if not checked:
                focus = w[:, :, window]
            else:
                focus = w[:, :, -window.shape[0]:]
                old = torch.softmax(past_q @ past_k.transpose(-2, -1) * (1 / math.sqrt(hd)), dim=-1)
                sim = F.cosine_similarity(old, w[:, :, :track.shape[0]], dim=1).mean()
                st["probe_rows"] += track.shape[0]
                st["similarity"].append((i, layer, float(sim.detach())))
                if sim < gamma:
                    start = layer + 1
                    st["triggers"] += start < L  # a trigger at the last layer changes nothing
            focus = focus.sum(dim=(0, 1, 2))
            focus[masked] = 0.0
            c["track"] = focus.topk(k=track_num, dim=0, largest=True)[1]
            h = h + att
            h = h + _mlp(p, h)
            st["rows"] += N
        logits = model.head(model.final_norm(h))
        logits = logits[:, window] if logits.shape[1] == T else logits[:, -window.shape[0]:]
        if not block_caching:
            window = window[:window_length]
            logits = logits[:, :window_length]
        track = torch.cat([c["track"] for c in cache]).unique(sorted=False)
        where = window + 1 if dream else window
        if dream:
            conf, x0 = torch.softmax(logits, dim=-1).max(dim=-1)
        else:
            conf, x0 = torch.max(F.softmax(logits.to(torch.float64), dim=-1), dim=-1)
        if threshold is not None:
            keep = conf[0] >= min(threshold, conf.max())
        else:
            keep = torch.topk(conf[0], k=min(tokens_per_iter, x0.shape[1]), largest=True).indices
        new = where[keep]
        x0 = x0[:, keep]
        x[:, new] = x0
        masked = masked[~torch.isin(masked, new)]
        st["nfe"] += 1
        if eos_id is not None and not decoded_eos:
            eos = new[x0.eq(eos_id)[0]]
            if eos.shape[0] > 0:
                decoded_eos = True
                masked = masked[masked <= eos.min().item()]
        if masked.shape[0] == 0:
            break
        i += 1
    return x[0], st


def elastic_cache_generate(model, prompt, attention_mask=None, gen_length=64, window_length=16, threshold=0.9,
                           gamma=0.9, track_num=1, eos_id=None, tokens_per_iter=1, block_caching=True):
    """Elastic-Cache (VILA-Lab/Elastic-Cache; public copy yxu-dev/Elastic-Cache) as its official code runs, one batch
    row at a time (``prompt [B, P]``, left padding marked 0 in ``attention_mask``).

    Commits from a sliding window (the first ``window_length`` still-masked positions, crossing block boundaries;
    far masks keep their cached state); the first forward is full, later ones recompute the tracked tokens, the
    previous step's new tokens and the window, and a layer whose tracked tokens' attention moved (mean cosine over
    heads below ``gamma``) makes every later layer recompute all rows from cached inputs.  ``threshold`` commits every
    window position at or above it (at least the most confident); ``threshold=None``: the ``tokens_per_iter`` most
    confident (LLaDA only).  ``eos_id``: after the first committed EOS, positions right of it are never decoded (they
    stay masks); the official LLaDA default 126081 is LLaDA-8B's ``<|endoftext|>``, Elastic's Dream eval passes the
    tokenizer's EOS; None: no EOS stop.  Returns ``(x, stats)`` (see above)."""
    spec = model.spec
    outs, stats = [], []
    for ids in _prompt_rows(prompt, attention_mask):
        seq, st = _elastic_row(model, ids, gen_length, window_length, threshold, tokens_per_iter, gamma, track_num,
                               eos_id, block_caching)
        st["rows_per_token"] = st["rows"] / gen_length
        outs.append(seq)
        stats.append(st)
    return _right_align(outs, spec.pad_id), stats
