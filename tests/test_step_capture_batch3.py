"""The LLaDA batch-3 cases of ``tests/test_step_capture.py`` (one policy per registered stage, mixed prompt lengths,
stop at EOS), in a file of their own so that the capture work runs on two workers under ``pytest -n 2 --dist
loadfile``, compiled with the ``trace`` and ``anatomy`` observers attached: they keep what each step showed them while
later steps overwrite every tensor a step returned (:class:`polestar.graph_rules.GraphProbe` with ``poison=True``, as
the next replay of a CUDA graph would), and their records equal eager decoding's.

An observer puts a :class:`~polestar.state.StepDetail` in the step's state, so a policy compiles other graphs with
observers than without; what a record holds comes from the stages, hence one policy per registered stage (from the
registry). Their graphs without observers are captured at batch 3 on the Dream shape and at batch 1 on LLaDA's. The
model has one LLaDA layer: what a second layer adds to a graph (the packet handed from one layer to the next) is
captured at batch 1 in ``tests/test_step_capture.py``; a layer less takes a third off the tracing time.
"""

import pytest
import torch

from polestar.bench.anatomy import CommitRecorder
from polestar.tracing.record import TraceRecorder
from tests.test_step_capture import _check_against_eager, _model, _one_policy_per_stage

#: the policies compiled at batch 3 with the observers attached: one per registered stage
OBSERVED = _one_policy_per_stage()


@pytest.mark.parametrize("policy", OBSERVED)
def test_observed_steps_are_replayable_graphs_and_observers_get_copies_that_outlive_the_next_step(policy):
    """With the ``trace`` and ``anatomy`` observers attached, every step is a replayable graph as without them (the
    observers' graphs hold the same stage code and copy what the step shows them), and the observers keep what each
    step showed them while later steps overwrite every tensor a step returned: their records equal eager decoding's.
    These policies' graphs without observers are captured at batch 3 on the Dream shape and at batch 1 on LLaDA's
    (``tests/test_step_capture.py``)."""
    model = _model("llada", n_layers=1)

    def observer():
        """Keeps every record to the end of the run (a record read during the run would add host reads to the
        step's count); the ``trace`` and ``anatomy`` recorders read them then."""
        records = []

        def outcome():
            trace, anatomy = TraceRecorder(threshold=0.3, n_layers=model.spec.n_layers), CommitRecorder()
            for record in records:
                trace(record)
                anatomy(record)
            return trace.steps, dict(anatomy.counts), [_plain(r) for r in records]

        return records.append, outcome

    _check_against_eager(model, policy, 3, observer=observer)


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
