"""Stage lifecycle: stages keep no per-generation state, so one assembled pipeline serves concurrent generations."""

import threading

import pytest

import polestar
from tests.conftest import make_model

BATCH_A = [[5, 7, 1, 3, 9, 2, 4], [3, 4, 6]]
BATCH_B = [[11, 12, 13], [20, 21, 22, 23, 24], [2, 9]]
KW = dict(gen_length=16, block_length=8, stop_at_eos=False)


@pytest.fixture(scope="module")
def model():
    return make_model("dream", seed=21)


def _snapshot(stage) -> dict:
    """Each instance attribute's object, plus a shallow copy of mutable containers (to see in-place changes)."""
    return {key: (value, list(value) if isinstance(value, list) else dict(value) if isinstance(value, dict) else None)
            for key, value in vars(stage).items()}


@pytest.mark.parametrize("policy", polestar.policy_names())
def test_no_stage_attribute_changes_during_decoding(model, policy):
    pipeline = polestar.assemble(policy, {"threshold?": 0.3})
    before = {kind: _snapshot(stage) for kind, stage in pipeline.stages.items()}
    polestar.generate(model, BATCH_A, policy=pipeline, **KW)
    polestar.generate(model, BATCH_B, policy=pipeline, **KW)
    for kind, stage in pipeline.stages.items():
        after = vars(stage)
        assert set(after) == set(before[kind]), (kind, sorted(set(after) ^ set(before[kind])))
        for key, (value, contents) in before[kind].items():
            assert after[key] is value, (kind, key)
            if contents is not None:
                assert contents == value, (kind, key)


@pytest.mark.parametrize("policy", polestar.policy_names())
def test_one_pipeline_decodes_two_batches_in_two_threads_as_alone(model, policy):
    pipeline = polestar.assemble(policy, {"threshold?": 0.3})
    alone = [polestar.generate(model, batch, policy=pipeline, **KW).tokens.tolist() for batch in (BATCH_A, BATCH_B)]
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def run(i: int, batch) -> None:
        try:
            start.wait()
            for _ in range(2):  # twice, so the two generations overlap in several stages
                results.setdefault(i, []).append(polestar.generate(model, batch, policy=pipeline, **KW).tokens.tolist())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, batch)) for i, batch in enumerate((BATCH_A, BATCH_B))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results[0] == [alone[0]] * 2
    assert results[1] == [alone[1]] * 2


@pytest.mark.parametrize("compile", [False, "eager"])
def test_a_model_cast_between_two_generations_decodes_as_one_built_in_that_dtype(compile):
    """The pooled buffers of a float32 generation are not handed to the same model cast to bfloat16 (its cache's
    dtype changed: the scatter of bfloat16 keys into float32 buffers used to fail), compiled or not."""
    import torch

    cast = make_model("llada", seed=4, n_layers=2)
    polestar.generate(cast, BATCH_A, policy="fast-dllm", compile=compile, **KW)
    cast.to(torch.bfloat16)
    after = polestar.generate(cast, BATCH_A, policy="fast-dllm", compile=compile, **KW)
    built = polestar.generate(make_model("llada", seed=4, n_layers=2).to(torch.bfloat16), BATCH_A, policy="fast-dllm",
                              **KW)
    assert after.tokens.tolist() == built.tokens.tolist()
    assert after.stats.sequences == built.stats.sequences
