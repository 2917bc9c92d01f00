"""Polestar: drift-aware cache calibration and token commitment for diffusion language models."""

# The façade is the composition root: importing the built-in stages registers them (and the named policies
# composed from them). Core modules never import a policy; every ``polestar.*`` import runs this file first.
from . import policies as _builtin_policies  # noqa: F401  (registration side effect)
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
