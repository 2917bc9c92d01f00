"""Non-finite logits during decoding: the broken sequence stops with an error, the others are unaffected."""

import pytest
import torch

import polestar
from tests.conftest import make_model

POISON = 30  # a prompt token whose embedding row is made NaN
HEALTHY = [[5, 7, 1, 3], [3, 4, 6, 2], [8, 9, 1, 1]]
KW = dict(gen_length=16, block_length=8, threshold=0.3, stop_at_eos=False)


@pytest.fixture(scope="module", params=["llada", "dream"])
def poisoned(request):
    m = make_model(request.param, seed=41)
    with torch.no_grad():
        table = m.model.transformer["wte"].weight if request.param == "llada" else m.model.embed_tokens.weight
        table[POISON] = float("nan")
    return m


@pytest.mark.parametrize("policy", polestar.policy_names())
def test_nan_row_stops_with_an_error_and_other_rows_are_unchanged(poisoned, policy):
    broken = [[3, POISON, 6, 2]]
    out = polestar.generate(poisoned, HEALTHY[:1] + broken + HEALTHY[2:], policy=policy, **KW)
    ref = polestar.generate(poisoned, HEALTHY, policy=policy, **KW)
    assert out.errors[0] is None and out.errors[2] is None
    assert "non-finite logits" in out.errors[1] and "step 0" in out.errors[1]
    for i in (0, 2):
        assert out.generations[i].tolist() == ref.generations[i].tolist()
        assert out.stats.sequences[i] == ref.stats.sequences[i]
    # the broken row committed nothing and was computed once (the forward that found the NaN)
    assert (out.generations[1] == poisoned.spec.mask_id).all()
    assert out.stats.sequences[1].nfe == 1
    assert out.stats.as_dict()["per_sequence"][1]["error"] == out.errors[1]
