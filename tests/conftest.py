import os
import sys
import tempfile

import pytest
import torch

import polestar
from polestar import policy, registry
from polestar import testing as _testing
from polestar.models.loading import shipped_checkpoints

# One intra-op thread unless OMP_NUM_THREADS says otherwise. The suite runs on a 2-core machine that other jobs
# share; there torch's default pool (one thread per core) spins on the core it does not get, and the same decode
# took 40-92 s with 2 threads against 6.5 s with 1 (tiny-dream, 16 arith problems, load 11). The models are tiny,
# so one thread loses little on an idle machine and keeps test times stable.
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)

# the small random models every engine test decodes with (polestar.testing builds them for outside stages too)
TINY = _testing.TINY
make_model = _testing.tiny_model


@pytest.fixture(params=["llada", "dream"])
def family(request):
    return request.param


@pytest.fixture
def model(family):
    return make_model(family)


@pytest.fixture(scope="session")
def shipped_models():
    """The checkpoints shipped in ``polestar/models/checkpoints``, loaded once per test session: name → model.

    Decoding never changes a model's weights, so every test that decodes with a shipped checkpoint shares these.
    """
    return {name: polestar.load(name) for name in shipped_checkpoints()}


@pytest.fixture
def isolated_registry():
    """Stages, policies and plugin modules (named ``hellinger*``, from docs/examples or from temporary files) a
    test registers are removed afterwards (other tests see the built-ins)."""
    stages = {kind: dict(table) for kind, table in registry._REGISTRY.items()}
    policies, origins = dict(policy._POLICIES), dict(policy._ORIGINS)
    modules = set(sys.modules)
    yield
    for kind, table in stages.items():
        registry._REGISTRY[kind].clear()
        registry._REGISTRY[kind].update(table)
    policy._POLICIES.clear()
    policy._POLICIES.update(policies)
    policy._ORIGINS.clear()
    policy._ORIGINS.update(origins)
    for name in set(sys.modules) - modules:  # plugin modules of the tests (temporary files) and of docs/examples
        origin = str(getattr(sys.modules[name], "__file__", None) or "")
        if (name.startswith("hellinger") or f"docs{os.sep}examples" in origin
                or origin.startswith(tempfile.gettempdir())):
            del sys.modules[name]
