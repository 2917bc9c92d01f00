"""LLaDA's Monte-Carlo masked-token bound against exact enumeration, and the greedy check."""

import math

import pytest
import torch

from polestar.evaluation.loglikelihood import greedy_matches, masked_bound, masked_bound_exact, sample_masks
from tests.conftest import make_model


@pytest.fixture(scope="module")
def llada():
    return make_model("llada", seed=3).eval()


@torch.no_grad()
def _nll_masked(model, ids, positions):
    """-log p of the tokens at ``positions`` with all of them masked (one forward, by hand)."""
    x = torch.tensor([ids])
    x[0, positions] = model.spec.mask_id
    logp = torch.log_softmax(model(x)[0].float(), dim=-1)
    return -sum(float(logp[p, ids[p]]) for p in positions)


def test_exact_bound_matches_hand_computation(llada):
    prefix, target = [5, 6, 7], [8, 9]
    ids = prefix + target
    both = _nll_masked(llada, ids, [3, 4])
    first, second = _nll_masked(llada, ids, [3]), _nll_masked(llada, ids, [4])
    # k=1 (prob 1/2): one of the two masked, weight T/k = 2; k=2 (prob 1/2): both masked, weight 1
    hand = -(0.5 * 0.5 * (2 * first + 2 * second) + 0.5 * both)
    assert masked_bound_exact(llada, prefix, target) == pytest.approx(hand, rel=1e-5)


def test_single_token_estimate_is_exact(llada):
    prefix, target = [4, 11, 12, 3], [20]
    exact = masked_bound_exact(llada, prefix, target)
    assert exact == pytest.approx(-_nll_masked(llada, prefix + target, [4]), rel=1e-6)
    for mc_num, batch in [(4, 4), (8, 2)]:
        assert masked_bound(llada, prefix, target, mc_num, batch) == pytest.approx(exact, rel=1e-5)


def test_estimate_converges_to_exact_bound(llada):
    prefix, target = [4, 11, 12], [20, 21, 22]
    exact = masked_bound_exact(llada, prefix, target)
    gen = torch.Generator().manual_seed(1)
    draws = [masked_bound(llada, prefix, target, 32, 32, generator=gen) for _ in range(24)]
    mean = sum(draws) / len(draws)
    sd = math.sqrt(sum((d - mean) ** 2 for d in draws) / (len(draws) - 1))
    assert abs(mean - exact) < 4 * sd / math.sqrt(len(draws)) + 1e-4


def test_sample_masks_stratified_counts():
    gen = torch.Generator().manual_seed(0)
    for T, batch in [(5, 5), (7, 3), (1, 4), (4, 8)]:
        masks = sample_masks(T, batch, gen)
        assert masks.shape == (batch, T) and masks.dtype == torch.bool
        counts = masks.sum(1)
        assert counts.min() >= 1 and counts.max() <= T
        if batch == T:  # one row per mask count
            assert sorted(counts.tolist()) == list(range(1, T + 1))


def test_bad_arguments_raise(llada):
    with pytest.raises(ValueError, match="continuation is empty"):
        masked_bound(llada, [1, 2], [], 4, 4)
    with pytest.raises(ValueError, match="multiple of batch_size"):
        masked_bound(llada, [1, 2], [3], 6, 4)


def test_greedy_check_single_token(llada):
    prefix = [4, 11, 12, 3]
    logits = llada(torch.tensor([prefix + [llada.spec.mask_id]]))[0, -1].float()
    logits[llada.spec.mask_id] = -math.inf
    best = int(logits.argmax())
    other = (best + 1) % llada.spec.vocab_size
    other = other if other != llada.spec.mask_id else (other + 1) % llada.spec.vocab_size
    assert greedy_matches(llada, prefix, [best])
    assert not greedy_matches(llada, prefix, [other])
