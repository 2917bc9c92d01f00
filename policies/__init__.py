"""Built-in stages (one module per stage family) and the named policies composed from them."""

from polestar.policy import PolicySpec, register_policy

from . import commit_basic, refresh_basic  # noqa: F401  (registration side effects)

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
