"""Overrides: the typed value of stage swaps and options, read once from the string form and merged with presets."""

from __future__ import annotations

import pytest

import polestar
from polestar.overrides import Overrides
from polestar.presets import PAPER_OPTIONS


def test_parse_sorts_keys_into_swaps_scoped_and_generic_options():
    got = Overrides.parse({"refresh": "prefix", "quant?": "none", "commit.threshold": 0.8, "threshold?": 0.9,
                           "refresh.topk?": 4})
    assert got == Overrides(swaps={"refresh": "prefix", "quant": "none"},
                            scoped={("commit", "threshold"): 0.8, ("refresh", "topk"): 4},
                            generic={"threshold": 0.9}, optional={"quant", "threshold", "refresh.topk"})
    assert got.swapped(optional=False) == {"refresh": "prefix"} and got.swapped(optional=True) == {"quant": "none"}


@pytest.mark.parametrize("mapping", [{}, {"threshold": 0.5}, {"commit": "factor", "factor": 2.0},
                                     PAPER_OPTIONS, {"quant?": "none", "offload": "cpu", "refresh.topk": 2}])
def test_string_form_round_trips(mapping):
    parsed = Overrides.parse(mapping)
    assert parsed.as_dict() == dict(mapping)
    assert Overrides.parse(parsed.as_dict()) == parsed
    assert Overrides.parse(parsed) is parsed


def test_a_later_spelling_of_the_same_setting_wins():
    assert Overrides.parse({"threshold": 0.5, "threshold?": 0.8}).as_dict() == {"threshold?": 0.8}
    assert Overrides.parse({"quant?": "none", "quant": "nvfp4"}).as_dict() == {"quant": "nvfp4"}


def test_merge_replaces_a_setting_whatever_its_optionality():
    preset = Overrides.parse({"threshold?": 0.9, "refresh.topk?": 4, "commit.window?": 5})
    mine = Overrides.parse({"refresh.topk": 2, "commit": "factor"})
    assert preset.merge(mine).as_dict() == {"commit": "factor", "threshold?": 0.9, "commit.window?": 5,
                                            "refresh.topk": 2}
    assert preset.merge({}) == preset and Overrides().merge(preset) == preset


def test_as_optional_and_swaps_only():
    given = Overrides.parse({"quant": "none", "threshold": 0.5, "refresh.topk?": 2})
    assert given.as_optional().as_dict() == {"quant?": "none", "threshold?": 0.5, "refresh.topk?": 2}
    assert given.swaps_only().as_dict() == {"quant": "none"}
    assert given.as_optional().swaps_only().as_dict() == {"quant?": "none"}


def test_unconsumed_names_the_strict_options_no_chosen_stage_takes():
    fields = {"refresh": {"topk": 4}, "commit": {"threshold": 0.9, "window": 5}}
    given = Overrides.parse({"threshold": 0.5, "topk": 3, "refresh.window": 2, "commit.window": 3, "alpha?": 1.0,
                             "cluster.n?": 2, "nothing": 1})
    assert given.unconsumed(fields) == ["nothing", "refresh.window"]
    assert given.as_optional().unconsumed(fields) == []


def test_stage_options_put_scoped_over_generic():
    fields = {"refresh": {"threshold": 0.1}, "commit": {"threshold": 0.9}}
    given = Overrides.parse({"commit.threshold": 0.5, "threshold": 0.7, "drift.threshold?": 0.2})
    assert given.stage_options(fields) == {"refresh": {"threshold": 0.7}, "commit": {"threshold": 0.5}}


def test_optional_names_must_be_settings():
    with pytest.raises(ValueError, match="optional settings"):
        Overrides(generic={"threshold": 0.5}, optional={"topk"})


@pytest.mark.parametrize("mapping", [{"threshold?": 0.3}, {"quant?": "none", "refresh.topk?": 8, "threshold?": 0.8},
                                     {"commit": "factor", "factor": 2.0}, {"refresh": "prefix"}])
def test_assemble_takes_the_value_or_its_string_form_alike(mapping):
    policy = "fast-dllm"
    assert (polestar.assemble(policy, Overrides.parse(mapping)).describe()
            == polestar.assemble(policy, mapping).describe())


def test_assemble_names_the_first_unconsumed_option():
    with pytest.raises(ValueError, match="unknown option 'refresh.topk' for this policy"):
        polestar.assemble("fast-dllm", Overrides(scoped={("refresh", "topk"): 8}))
    assert polestar.assemble("fast-dllm", Overrides(scoped={("refresh", "topk"): 8}, optional={"refresh.topk"}))
