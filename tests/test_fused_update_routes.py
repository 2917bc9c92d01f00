"""Polestar's fused update operations against the general route they replace, on whole decodes.

A plain row store (a quantizer declaring ``plain``, an offloader declaring ``resident``: the ``none`` defaults) lets
an update layer write its packet with the centroid shift (``packet_write``) and gather its members' rows behind the
block's (``member_rows``) in one operation each; a built-in divergence scores and keeps the due rows in one
(``drift_keep``). A store or a metric without those declarations takes the general route (encode / decode, the
default ``score_keep``). Both routes decode the same tokens and counters, and each takes the operations it should.
"""

import collections

import attrs
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import polestar
from polestar.policies.drift import DriftMetric, KLDrift, drift_examples, drift_laws
from polestar.policies.offload import CPUOffload, offload_examples, offload_laws
from polestar.policies.quant import FP8Quant, NoQuant, quant_examples, quant_laws
from polestar.registry import register
from polestar.testing import tiny_model

PROMPTS = [[5, 17, 3, 8, 9, 1, 2], [9, 1, 22, 30, 4, 11, 2, 7]]
OPTIONS = dict(policy="polestar", gen_length=48, block_length=16, stop_at_eos=False)
FUSED = ("packet_write", "member_rows", "drift_keep")


class FusedCalls(TorchDispatchMode):
    """Counts the calls of :data:`FUSED` operations while on."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in FUSED:
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def general(isolated_registry):
    """A quantizer and a drift metric computing what ``none`` and ``kl`` compute, without their declarations."""

    @register("quant", "none-general")
    class GeneralQuant(NoQuant):
        """``none`` without ``plain``: the store's rows go through encode, decode and the offloader."""

        plain = False

    @register("drift", "kl-general")
    class GeneralKL(KLDrift):
        """``kl`` with the general ``score_keep``: the score, then the due rows kept with ``torch.where``."""

        score_keep = DriftMetric.score_keep

    return {"quant": "none-general", "drift": "kl-general"}


def decode(model, **options):
    with FusedCalls() as seen:
        out = polestar.generate(model, PROMPTS, **OPTIONS, **options)
    return out, seen.calls


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_the_fused_route_decodes_what_the_general_route_decodes(family, general):
    model = tiny_model(family, seed=1, n_layers=4)
    fused, fused_calls = decode(model)
    plain, plain_calls = decode(model, **general)
    assert torch.equal(fused.tokens, plain.tokens)
    assert attrs.evolve(fused.stats, wall_s=0.0) == attrs.evolve(plain.stats, wall_s=0.0)
    # the fused route takes every fused operation at the update layers; the general one none of them
    assert all(fused_calls[name] > 0 for name in FUSED), fused_calls
    assert not plain_calls, plain_calls


def test_each_fused_operation_alone_keeps_the_decode(general):
    """A general store with the fused drift, and a plain store with the general drift: the same decode."""
    model = tiny_model("llada", seed=2, n_layers=3)
    reference, _ = decode(model)
    for options, absent in (({"quant": general["quant"]}, {"packet_write", "member_rows"}),
                            ({"drift": general["drift"]}, {"drift_keep"})):
        out, calls = decode(model, **options)
        assert torch.equal(out.tokens, reference.tokens), options
        assert absent.isdisjoint(calls) and set(FUSED) - absent <= set(calls), (options, calls)


def test_the_laws_hold_a_stage_to_its_declarations():
    """A quantizer declared plain whose leaves are not the values, an offloader declared resident whose storage is
    not the tensors written, a metric whose score_keep does not keep: each breaks its kind's laws."""
    gen = torch.Generator().manual_seed(0)

    class NotPlain(FP8Quant):
        plain = True

    class NotResident(CPUOffload):
        resident = True

    class NotKept(KLDrift):
        def score_keep(self, cur, prev, due):
            return self.score(cur, prev)

    with pytest.raises(AssertionError, match="declared plain"):
        quant_laws(NotPlain(NotPlain.Config()), *next(quant_examples(gen, 1)))
    with pytest.raises(AssertionError, match="declared resident"):
        offload_laws(NotResident(NotResident.Config()), *next(offload_examples(gen, 1)))
    cur, prev = next(drift_examples(gen, 1))
    cur, prev = torch.cat([cur, cur]), torch.cat([prev, prev])  # two rows: one due, one not
    with pytest.raises(AssertionError, match="score_keep"):
        drift_laws(NotKept(NotKept.Config()), cur, prev)
    # the built-ins keep their declarations
    quant_laws(NoQuant(NoQuant.Config()), *next(quant_examples(gen, 1)))
    drift_laws(KLDrift(KLDrift.Config()), cur, prev)
