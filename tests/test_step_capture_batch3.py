"""The LLaDA batch-3 cases of ``tests/test_step_capture.py`` (every registered policy, mixed prompt lengths, stop at
EOS), in a file of their own so that the capture work runs on two workers under ``pytest -n 2 --dist loadfile``;
and the ``trace`` and ``anatomy`` observers under a compiled step: they keep what each step showed them while later
steps overwrite every tensor a step returned (:class:`polestar.graph_rules.GraphProbe` with ``poison=True``, as the
next replay of a CUDA graph would), and their records equal eager decoding's.

Both run LLaDA with one layer: what a second layer adds to a graph (the packet handed from one layer to the next) is
captured at batch 1 in ``tests/test_step_capture.py``; a layer less takes a third off the tracing time.

An observer puts a :class:`~polestar.state.StepDetail` in the step's state, so each policy compiles graphs of its
own here (``tests/test_step_capture.py`` compiles the graphs without observers). What a record holds comes from the
stages, so one policy per registered stage (from the registry, as the Dream shape of ``test_step_capture.py``)
covers every stage's records.
"""

import pytest
import torch

from polestar.bench.anatomy import CommitRecorder
from polestar.graph_rules import GraphProbe
from polestar.tracing.record import TraceRecorder
from tests.test_step_capture import (
    BATCH3,
    _check_against_eager,
    _decode,
    _model,
    _one_policy_per_stage,
    case_ids,
)


@pytest.mark.parametrize("family, policy, batch, overrides", BATCH3, ids=case_ids(BATCH3))
def test_every_step_is_a_replayable_graph_with_one_host_read(family, policy, batch, overrides):
    _check_against_eager(_model(family, n_layers=1), policy, batch, overrides)


@pytest.mark.parametrize("policy", _one_policy_per_stage())
def test_observers_get_copies_that_outlive_the_next_step(policy):
    """The ``trace`` and ``anatomy`` observers keep what each step showed them while later steps overwrite every
    tensor a step returned: their records equal eager decoding's."""
    model = _model("llada", n_layers=1)

    def observe(compile):
        trace, anatomy = TraceRecorder(threshold=0.3, n_layers=model.spec.n_layers), CommitRecorder()
        records = []  # the raw records, kept to the end of the run

        def all_three(record):
            trace(record)
            anatomy(record)
            records.append(record)

        tokens, stats, runner, _ = _decode(model, policy, 3, compile, on_step=all_three)
        return tokens, trace.steps, dict(anatomy.counts), [_plain(r) for r in records], runner

    probe = GraphProbe(poison=True)
    tokens, traces, counts, records, runner = observe(probe)
    eager_tokens, eager_traces, eager_counts, eager_records, _ = observe(False)
    assert runner.compiled_steps > 0 and probe.problems() == []
    assert tokens.tolist() == eager_tokens.tolist()
    assert traces == eager_traces
    assert counts == eager_counts
    assert records == eager_records


def _plain(obj):
    """A record's tensors (NamedTuples, tuples, dicts, attrs classes) as nested lists, read at the end of a run."""
    import attrs

    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, (tuple, list)):
        return [_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if attrs.has(type(obj)):
        return {f.name: _plain(getattr(obj, f.name)) for f in attrs.fields(type(obj))}
    return obj
