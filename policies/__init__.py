"""Built-in stages (one module per stage family) and the named policies composed from them."""

from polestar.policy import PolicySpec, register_policy

from . import (  # noqa: F401  (registration side effects)
    cluster,
    commit_adaptive,
    commit_basic,
    drift,
    offload,
    quant,
    refresh_basic,
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
]

for _name, _refresh, _commit, _description in _POLICIES:
    register_policy(PolicySpec(_name, {"refresh": _refresh, "commit": _commit}, description=_description))

# dLLM-Cache's released loop: LLaDA's fixed steps per block, low-confidence remasking ranked by the softmax over the
# whole vocabulary (``commit=threshold`` swaps in a confidence threshold)
register_policy(PolicySpec(
    "dllm-cache", {"refresh": "dllm-cache", "commit": "topk"}, {"commit": {"mask_in_softmax": True}},
    description="dLLM-Cache: per-layer attention/MLP feature cache, interval prompt/response refresh, the ratio of "
                "response rows whose values moved most recomputed in between; LLaDA's fixed steps per block"))
