"""Polestar: drift-aware cache calibration and token commitment for diffusion language models."""

# The façade is the composition root: importing the built-in stages registers them (and the named policies
# composed from them). Core modules never import a policy; every ``polestar.*`` import runs this file first.
from . import policies as _builtin_policies  # noqa: F401  (registration side effect)
from .api import GenerationOutput, encode_prompts, generate, load
from .config import GenerationConfig
from .plugins import load_entry_points as _load_entry_points
from .plugins import load_plugin
from .policy import PolicySpec, assemble, get_policy, policy_names, register_policy
from .registry import UnknownNameError, register
from .tracing.run import Trace, trace

__all__ = [
    "GenerationConfig",
    "GenerationOutput",
    "PolicySpec",
    "Trace",
    "UnknownNameError",
    "assemble",
    "encode_prompts",
    "generate",
    "get_policy",
    "load",
    "load_plugin",
    "policy_names",
    "register",
    "register_policy",
    "trace",
]
__version__ = "0.1.0"

# installed plugins (entry point group ``polestar.plugins``) register last, once the façade above is complete
_load_entry_points()
