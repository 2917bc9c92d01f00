"""Built-in stages (one module per stage family) and the named policies composed from them."""

from polestar.policy import PolicySpec, register_policy

from . import (  # noqa: F401  (registration side effects)
    cluster,
    commit_adaptive,
    commit_basic,
    commit_calibrated,
    commit_wino,
    drift,
    offload,
    quant,
    refresh_basic,
    refresh_d2cache,
    refresh_dllm,
    refresh_elastic,
    refresh_polestar,
)

# name, refresh, commit, description (the composed stages a refresh or commit stage requires are added by
# `polestar.assemble`, each kind's default)
_POLICIES = [
    ("baseline", "full", "topk", "LLaDA: no cache, a fixed number of tokens per step (steps spread over blocks)"),
    ("parallel", "full", "threshold",
     "No cache, Fast-dLLM threshold commit (confidence >= threshold, at least the most confident)"),
    ("fast-dllm-prefix", "prefix", "threshold",
     "Fast-dLLM prefix cache (refreshed at each block start) + threshold commit"),
    ("fast-dllm", "dual", "threshold",
     "Fast-dLLM dual cache (prefix and suffix K/V reused inside a block) + threshold commit"),
    ("polestar-cache", "polestar", "threshold",
     "Polestar-Cache: dual cache + drift-aware sparse updates of the local window, threshold commit"),
    ("elastic-cache", "elastic", "threshold",
     "Elastic-Cache: sliding-window commits with far-mask caching; the tracked tokens, previous commits and window "
     "are recomputed, every position from the layer above the one where tracked attention drifts past gamma"),
    ("polestar", "polestar", "polestar",
     "Polestar: drift-aware sparse cache updates + drift-delta early commit + suffix-block commit"),
    ("polestar-commit", "dual", "polestar",
     "Polestar-Commit alone: dual cache + drift-delta early commit (no update packets, no suffix commit)"),
    ("eb", "dual", "entropy-bound", "EB-sampler: dual cache + entropy-bounded commit"),
    ("klass", "dual", "klass", "KLASS: dual cache + KL-stability commit"),
    ("wino", "full", "wino",
     "WINO: no cache, revokable commits (wide-in drafts above a threshold, a shadow block re-masks weak drafts)"),
]

for _name, _refresh, _commit, _description in _POLICIES:
    register_policy(PolicySpec(_name, {"refresh": _refresh, "commit": _commit}, description=_description))

# the released loops of dLLM-Cache, d2Cache (Research dLLM's vanilla decoding) and the calibrated scores of d2Cache's
# certainty prior and PC-Sampler (d2Cache's release settings; the papers' settings are the presets of the same
# names): LLaDA's fixed steps per block, tokens ranked by the softmax over the whole vocabulary (``commit=threshold``
# swaps in a confidence threshold)
_RELEASED_LOOPS = [
    ("dllm-cache", "dllm-cache", "topk",
     "dLLM-Cache: per-layer attention/MLP feature cache, interval prompt/response refresh, the ratio of response rows "
     "whose values moved most recomputed in between; LLaDA's fixed steps per block"),
    ("d2cache", "d2cache", "topk",
     "d2Cache: after the first forward only chosen rows are recomputed: the current_k masked positions of highest "
     "confidence x certainty density, the positions just committed and the attention-rollout nucleus rollout_p; "
     "LLaDA's fixed steps per block"),
    ("certainty-prior", "full", "certainty-prior",
     "d2Cache's certainty prior: no cache, confidence x Gaussian density (sigma 10) of the decoded positions; LLaDA's "
     "fixed steps per block"),
    ("pc-sampler", "full", "pc-sampler",
     "PC-Sampler: no cache, confidence debiased by the token's corpus frequency (-p log f, clipped at 10; needs the "
     "checkpoint's token_frequency.json); LLaDA's fixed steps per block"),
]

for _name, _refresh, _commit, _description in _RELEASED_LOOPS:
    register_policy(PolicySpec(_name, {"refresh": _refresh, "commit": _commit}, {"commit": {"mask_in_softmax": True}},
                               description=_description))
