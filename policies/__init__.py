"""Built-in stages (one module per stage family) and the named policies composed from them."""

from polestar.policy import PolicySpec, register_policy

from . import (  # noqa: F401  (registration)
    cluster,
    commit_adaptive,
    commit_basic,
    drift,
    offload,
    quant,
    refresh_adaptive,
    refresh_basic,
    refresh_polestar,
)

register_policy(PolicySpec(
    "baseline", {"refresh": "full", "commit": "topk"},
    description="LLaDA: no cache, a fixed number of tokens per step (steps spread over blocks)",
))
register_policy(PolicySpec(
    "parallel", {"refresh": "full", "commit": "threshold"},
    description="No cache, Fast-dLLM threshold commit (confidence >= threshold, at least the most confident)",
))
register_policy(PolicySpec(
    "fast-dllm-prefix", {"refresh": "prefix", "commit": "threshold"},
    description="Fast-dLLM prefix cache (refreshed at each block start) + threshold commit",
))
register_policy(PolicySpec(
    "fast-dllm", {"refresh": "dual", "commit": "threshold"},
    description="Fast-dLLM dual cache (prefix and suffix K/V reused inside a block) + threshold commit",
))

_DRIFT_STAGES = {"drift": "kl", "cluster": "kmeans", "quant": "nvfp4", "offload": "none"}
register_policy(PolicySpec(
    "polestar-cache", {"refresh": "polestar", "commit": "threshold", **_DRIFT_STAGES},
    description="Polestar-Cache: dual cache + drift-aware sparse updates of the local window, threshold commit",
))
register_policy(PolicySpec(
    "elastic-cache", {"refresh": "elastic", "commit": "threshold"},
    description="Elastic-Cache: dual cache, recompute from the layer where tracked attention drifts past gamma",
))
register_policy(PolicySpec(
    "dllm-cache", {"refresh": "dllm-cache", "commit": "threshold"},
    description="dLLM-Cache: interval prompt/response refresh + value-change-driven partial updates",
))
register_policy(PolicySpec(
    "polestar", {"refresh": "polestar", "commit": "polestar", **_DRIFT_STAGES},
    description="Polestar: drift-aware sparse cache updates + drift-delta early commit + suffix-block commit",
))
register_policy(PolicySpec(
    "polestar-commit", {"refresh": "dual", "commit": "polestar"},
    description="Polestar-Commit alone: dual cache + drift-delta early commit (no update packets, no suffix commit)",
))
register_policy(PolicySpec(
    "eb", {"refresh": "dual", "commit": "entropy-bound"},
    description="EB-sampler: dual cache + entropy-bounded commit",
))
register_policy(PolicySpec(
    "klass", {"refresh": "dual", "commit": "klass"},
    description="KLASS: dual cache + KL-stability commit",
))
