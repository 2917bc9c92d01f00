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


#: Long tests of files that carry no ``slow`` marker of their own yet (file -> test function names): marked here,
#: so that ``-m "not slow"`` leaves them out of the fast loop like the marked ones; the full suite runs them all.
#: Moving the marker into the file itself makes its entry here unnecessary.
SLOW_ELSEWHERE = {
    "tests/test_compile.py": ("test_compiled_generation_matches_eager_without_graph_breaks",
                              "test_compiled_batch_with_rows_finishing_in_different_blocks_compiles_once_and_equals_eager"),
    "tests/test_step_capture.py": ("test_every_step_is_a_replayable_graph_with_one_host_read",),
    "tests/test_step_capture_batch3.py": (
        "test_observed_steps_are_replayable_graphs_and_observers_get_copies_that_outlive_the_next_step",),
    "tests/test_gpu_check.py": ("test_check_sh_installs_offline_and_runs_every_step",
                                "test_check_sh_runs_from_the_source_tree_when_nothing_is_installed"),
    "tests/test_step_cost.py": ("test_profile_shares_cover_the_step_and_see_polestar_stages",),
    "tests/kernels/test_kernel_kmeans.py": ("test_compiled_kmeans_equals_eager",),
    "tests/kernels/test_kernel_attention.py": ("test_triton_default_blocks_long_keys_and_strided_inputs",),
}


#: The files that take longest in the full suite (CPU seconds per file: docs/log.md), longest first. Under
#: ``-n 2 --dist loadfile`` xdist hands whole files to the workers in collection order (its own reordering, by the
#: number of tests in a file, is turned off in :func:`pytest_configure`): these start first and the short files fill
#: in around them, so the two workers end together instead of one starting a long file last.
LONGEST_FIRST = (
    "tests/test_compile.py", "tests/test_step_capture.py", "tests/test_real_width.py", "tests/test_meta_shapes.py",
    "tests/test_step_capture_batch3.py", "tests/test_gpu_check.py", "tests/test_shipped.py",
    "tests/test_distributed.py", "tests/test_bench_safety.py", "tests/test_plugins.py",
    "tests/kernels/test_kernel_aot.py", "tests/test_published_files.py", "tests/kernels/test_kernel_kmeans.py",
    "tests/test_lm_eval.py", "tests/test_elastic_cache.py", "tests/test_docs_examples.py", "tests/test_stage_checks.py",
    "tests/test_chat.py",
)


def pytest_configure(config):
    if getattr(config.option, "loadscopereorder", None):  # pytest-xdist's default: the files with most tests first
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        names = SLOW_ELSEWHERE.get(item.nodeid.split("::")[0], ())
        if getattr(item, "originalname", item.name) in names:
            item.add_marker(pytest.mark.slow)
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: a file's order is kept


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
    """Stage kinds, stages, policies and plugin modules (named ``hellinger*``, from docs/examples or from temporary
    files) a test registers are removed afterwards (other tests see the built-ins)."""
    stages = {kind: dict(table) for kind, table in registry._REGISTRY.items()}
    kinds = dict(registry.KINDS)
    policies, origins = dict(policy._POLICIES), dict(policy._ORIGINS)
    modules = set(sys.modules)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(stages)
    registry.KINDS.clear()
    registry.KINDS.update(kinds)
    policy._POLICIES.clear()
    policy._POLICIES.update(policies)
    policy._ORIGINS.clear()
    policy._ORIGINS.update(origins)
    for name in set(sys.modules) - modules:  # plugin modules of the tests (temporary files) and of docs/examples
        origin = str(getattr(sys.modules[name], "__file__", None) or "")
        if (name.startswith("hellinger") or f"docs{os.sep}examples" in origin
                or origin.startswith(tempfile.gettempdir())):
            del sys.modules[name]
