"""Polestar: drift-aware cache calibration and token commitment for diffusion language models."""

from .api import GenerationOutput, encode_prompts, generate, load
from .config import GenerationConfig
from .policy import assemble, get_policy, policy_names
from .registry import UnknownNameError

__all__ = [
    "GenerationConfig",
    "GenerationOutput",
    "UnknownNameError",
    "assemble",
    "encode_prompts",
    "generate",
    "get_policy",
    "load",
    "policy_names",
]
__version__ = "0.1.0"
