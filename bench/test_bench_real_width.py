"""Step cost at real width under pytest-benchmark (see :mod:`polestar.bench.real_width` for the rows, the forced
commit schedule and the ``POLESTAR_RW_*`` size variables).

``pytest bench/test_bench_real_width.py --benchmark-only`` runs the grid; ``-k "fp32 and b1 and L2"`` one cell
(its four rows). Each benchmark round is one whole generation, ``POLESTAR_RW_ROUNDS`` (3) rounds per row, so every
figure has a spread; ``extra_info`` holds ms per step (the rounds' mean and standard deviation per step, and the
fastest step), weight and K/V bytes per step, rows and proxy rows per step and layer, and each one's ratio to
fast-dllm measured earlier in the same run (rows run fast-dllm first), the step time ratio with its propagated
standard deviation (``ms_per_step_mean_ratio_std``). Each model is built once per (layers, dtype) and freed before
the next.
"""

from __future__ import annotations

import pytest

from polestar.bench import real_width as rw

SETTINGS = rw.settings_from_env()
MODELS = [(layers, dtype) for layers in SETTINGS.layers for dtype in SETTINGS.dtypes]
#: fast-dllm first, so each cell's other rows find their reference
ROW_KEYS = sorted(SETTINGS.rows, key=lambda key: key != rw.REFERENCE)
#: results of this run by (layers, dtype, batch, row), for the ratios to fast-dllm
MEASURED: dict[tuple, dict] = {}


@pytest.fixture(scope="module", params=MODELS, ids=[rw.model_id(*m) for m in MODELS])
def real_width_model(request):
    """One model per (layers, dtype), freed when the tests of the next one start."""
    built = rw.build(SETTINGS, *request.param)
    yield built
    del built
    rw.free(SETTINGS.device)


def _per_step_stats(benchmark, nfe: int) -> dict[str, float]:
    """pytest-benchmark's mean, standard deviation and least round time (one round = one generation) per step,
    the mean and deviation also as the row's ``ms_per_step_mean`` / ``ms_per_step_std``; empty when the benchmark
    is disabled."""
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)
    if stats is None or not nfe:
        return {}
    std = stats.stddev if stats.rounds > 1 else 0.0
    return {"bench_ms_per_step_mean": 1e3 * stats.mean / nfe, "bench_ms_per_step_min": 1e3 * stats.min / nfe,
            "ms_per_step_mean": 1e3 * stats.mean / nfe, "ms_per_step_std": 1e3 * std / nfe, "rounds": stats.rounds}


def _ratios(result: dict) -> dict:
    """``<metric>_ratio`` to fast-dllm's result of the same cell in this run (absent when it did not run)."""
    ref = MEASURED.get((*rw.cell_of(result), rw.REFERENCE))
    if ref is None:
        return {}
    return {**{f"{key}_ratio": rw.ratio(result[key], ref[key]) for key, _, _ in rw.METRICS},
            "ms_per_step_mean_ratio_std": rw.ratio_std(result, ref)}


@pytest.mark.parametrize("row", ROW_KEYS)
@pytest.mark.parametrize("batch", SETTINGS.batches, ids=[f"b{b}" for b in SETTINGS.batches])
def test_step_cost(benchmark, real_width_model, batch, row):
    ids = rw.prompts(SETTINGS, batch)
    benchmark.group = f"real-width/{rw.model_id(real_width_model.layers, real_width_model.dtype)}/b{batch}"
    result: dict = {}

    def run():
        result.update(rw.run_row(real_width_model, ids, SETTINGS, row))

    benchmark.pedantic(run, rounds=max(SETTINGS.rounds, 1), iterations=1, warmup_rounds=SETTINGS.warmup)
    result.update(_per_step_stats(benchmark, result["nfe"]))
    MEASURED[(*rw.cell_of(result), row)] = result
    benchmark.extra_info.update({**result, **_ratios(result)})
    if rw.ROWS[row].forced:  # one token per step: every forced row takes the same steps
        assert result["nfe"] == SETTINGS.gen
