"""Every step phase of every registered policy at the published LLaDA-8B / Dream-7B shapes (all layers, full width,
bf16), run on the meta device: the step's shapes hold at full size, it reads nothing back to the host (a meta tensor
has no value to read), and its peak memory (weights + the generation's buffers + the step's temporaries,
:class:`polestar.meta_run.LiveBytes`) is printed and bounded at batch 1 and 32."""

import pytest
import torch

from polestar.config import GenerationConfig
from polestar.meta_run import meta_model, meta_step_phases
from polestar.policy import policy_names
from polestar.presets import PAPER_DECODING
from tests.host_reads import count_host_reads

GiB = 2**30
PROMPT = 256
CONFIG = GenerationConfig(gen_length=PAPER_DECODING["gen_length"], block_length=PAPER_DECODING["block_length"])
#: bound of a step's temporaries (peak minus weights and buffers) per sequence of the batch, plus a fixed part:
#: a full-length forward's activations of one layer and the logits of the block
TRANSIENT_PER_ROW, TRANSIENT_FIXED = 0.1 * GiB, 0.25 * GiB

_MODELS: dict = {}
#: runs by (family, policy, batch): the peak-memory test takes the batch-1 ``polestar`` run of the every-policy test
_RUNS: dict = {}


def _model(family: str):
    if family not in _MODELS:
        _MODELS[family] = meta_model(family)
    return _MODELS[family]


def _run(family: str, policy: str, batch: int):
    if (family, policy, batch) not in _RUNS:
        _RUNS[family, policy, batch] = _checked_run(family, policy, batch)
    return _RUNS[family, policy, batch]


def _checked_run(family: str, policy: str, batch: int):
    model = _model(family)
    with count_host_reads() as reads:
        run = meta_step_phases(model, policy, batch, PROMPT, CONFIG)
    assert reads == []
    transient = run.peak_bytes - run.weight_bytes - run.buffer_bytes
    assert 0 <= transient <= TRANSIENT_PER_ROW * batch + TRANSIENT_FIXED, (transient / GiB, batch)
    return run


@pytest.mark.slow
@pytest.mark.parametrize("policy", policy_names())
def test_every_phase_of_every_policy_runs_at_the_published_llada_shape(policy):
    run = _run("llada", policy, 1)
    assert len(run.phases) >= 1
    assert 14 * GiB < run.weight_bytes < 16 * GiB  # LLaDA-8B's bf16 weights: the full model was built


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_polestar_peak_memory_at_batch_1_and_32(family, capsys):
    runs = {batch: _run(family, "polestar", batch) for batch in (1, 32)}
    with capsys.disabled():
        for batch, run in runs.items():
            print(f"\n{family} polestar batch {batch}: weights {run.weight_bytes / GiB:.2f} GiB, buffers "
                  f"{run.buffer_bytes / GiB:.2f} GiB, peak {run.peak_bytes / GiB:.2f} GiB ({len(run.phases)} phases, "
                  f"prompt {PROMPT}, generation {CONFIG.gen_length})")
    # the generation's buffers grow with the batch (the cache and the stores are per sequence), the weights do not
    assert runs[32].buffer_bytes > 16 * runs[1].buffer_bytes
    assert runs[32].peak_bytes < 80 * GiB  # batch 32 fits an 80 GB device
    assert {r.phases for r in runs.values()} == {runs[1].phases}  # the same step phases at every batch size
    assert torch.device("meta") == next(_model(family).parameters()).device
