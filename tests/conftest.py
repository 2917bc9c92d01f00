import os

import pytest
import torch

import polestar
from polestar.models.loading import build_model, shipped_checkpoints

# One intra-op thread unless OMP_NUM_THREADS says otherwise. The suite runs on a 2-core machine that other jobs
# share; there torch's default pool (one thread per core) spins on the core it does not get, and the same decode
# took 40-92 s with 2 threads against 6.5 s with 1 (tiny-dream, 16 arith problems, load 11). The models are tiny,
# so one thread loses little on an idle machine and keeps test times stable.
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)

TINY = dict(
    n_layers=2, d_model=32, n_heads=4, n_kv_heads=4, mlp_hidden=64, vocab_size=40, embedding_size=40,
    rope_theta=10000.0, norm_eps=1e-5, max_seq_len=256, mask_id=39, eos_id=38, pad_id=38,
)


def make_model(family: str, seed: int = 0, **over):
    kw = dict(TINY)
    if family == "dream":
        kw.update(n_kv_heads=2, rope_theta=1e6, qkv_bias=True)
    kw.update(over)
    torch.manual_seed(seed)
    return build_model(family, kw, seed=seed)


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
