import pytest
import torch

from polestar.models.loading import build_model

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
