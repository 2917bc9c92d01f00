"""Block-start spherical k-means at the decoder's sizes (``pytest bench -k kmeans --benchmark-only``).

One thread, 5 iterations, ``x [G, N, 128]``: the window's prefix part (k = 5), its suffix part (k = 3), and
both parts stacked in one call (groups padded to ``N``, ``k_valid`` disabling clusters 3 and 4 of the suffix
groups).  ``compiled`` runs ``torch.compile(fullgraph=True, dynamic=False)`` (CPU inductor); the compile
seconds go to ``extra_info``.
"""

import time

import pytest
import torch

from polestar.kernels.kmeans import reference_spherical_kmeans

# name -> (G, N, k, number of suffix groups among the G, valid suffix length)
CASES = {"prefix-k5": (2, 32, 5, 0, 0), "suffix-k3": (2, 16, 3, 0, 0), "stacked-k5+k3": (4, 32, 5, 2, 16)}


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _inputs(g: int, n: int, k: int, n_suffix: int, suffix_len: int):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(g, n, 128, generator=gen)
    keys = torch.rand(g, n, generator=gen)
    valid = torch.ones(g, n, dtype=torch.bool)
    k_valid = torch.ones(g, k, dtype=torch.bool)
    if n_suffix:
        valid[g - n_suffix :, suffix_len:] = False
        k_valid[g - n_suffix :, 3:] = False
    return x, k, valid, keys, k_valid


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", list(CASES))
def test_kmeans_speed(benchmark, one_thread, case, compiled):
    x, k, valid, keys, k_valid = _inputs(*CASES[case])
    fn = reference_spherical_kmeans
    if compiled:
        fn = torch.compile(fn, fullgraph=True, dynamic=False)
    start = time.perf_counter()
    fn(x, k, 5, valid=valid, keys=keys, k_valid=k_valid)  # warm-up (compiles)
    benchmark.extra_info["first_call_s"] = time.perf_counter() - start
    benchmark.group = f"kmeans/{case}"
    out = benchmark.pedantic(
        lambda: fn(x, k, 5, valid=valid, keys=keys, k_valid=k_valid), rounds=200, iterations=1
    )
    assert (out.counts[k_valid] > 0).all()
