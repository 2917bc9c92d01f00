"""torch.compile of the decoding step: same tokens as eager, no graph breaks, a bounded number of graphs."""

import pytest
import torch
from torch._dynamo.utils import counters

import polestar
from polestar.bench.harness import load_problems
from polestar.tasks import get_task
from tests.conftest import make_model

PROMPTS = [[5, 7, 1, 3, 9, 2, 4], [3, 4]]


@pytest.fixture(scope="module")
def small_model():
    torch._dynamo.reset()
    return make_model("llada", seed=11, n_layers=2, d_model=32)


def test_compiled_generation_matches_eager_without_graph_breaks(small_model):
    torch._dynamo.reset()
    counters.clear()
    kw = dict(gen_length=24, block_length=8, threshold=0.3, stop_at_eos=False)
    # inductor compiles Polestar's layer regions here (one per shape its phases meet); every policy's regions are
    # checked at dynamo's and AOT autograd's level in tests/test_step_capture.py
    eager = polestar.generate(small_model, PROMPTS, policy="polestar", **kw)
    compiled = polestar.generate(small_model, PROMPTS, policy="polestar", compile=True, **kw)
    assert compiled.tokens.tolist() == eager.tokens.tolist()
    # the cost counters are eager decoding's: the step's glue and stages run as Python either way
    counted = ("token_layer_evals", "proxy_query_evals", "weight_bytes", "kv_bytes")
    assert [getattr(compiled.stats, c) for c in counted] == [getattr(eager.stats, c) for c in counted]
    assert [s.nfe for s in compiled.stats.sequences] == [s.nfe for s in eager.stats.sequences]
    own = [(s.token_layer_evals, e.token_layer_evals) for s, e in zip(compiled.stats.sequences,
                                                                   eager.stats.sequences)]
    assert all(c == e for c, e in own), own
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] > 0
    # a second generation reuses the regions
    before = counters["stats"]["unique_graphs"]
    polestar.generate(small_model, PROMPTS, policy="polestar", compile=True, **kw)
    assert counters["stats"]["unique_graphs"] == before


@pytest.fixture(scope="module")
def finishing_rows():
    """The shipped tiny-llada and two arith prompts whose rows finish (EOS) in different blocks of 8."""
    model = polestar.load("tiny-llada")
    task = get_task("arith")
    prompts = [task.format_prompt(p.input) for p in load_problems("arith", 2)]
    return model, prompts


def test_compiled_batch_with_rows_finishing_in_different_blocks_compiles_once_and_equals_eager(finishing_rows):
    model, prompts = finishing_rows
    kw = dict(policy="parallel", gen_length=48, block_length=8, stop_at_eos=True)
    records = []
    eager = polestar.generate(model, prompts, on_step=records.append, **kw)
    last_block = [max(r.block_index for r in records if r.active[i]) for i in range(len(prompts))]
    assert len(set(last_block)) == len(prompts) and max(last_block) < 5  # rows stop early, in different blocks
    torch._dynamo.reset()
    counters.clear()
    compiled = polestar.generate(model, prompts, compile=True, **kw)
    assert compiled.tokens.tolist() == eager.tokens.tolist()
    assert compiled.stats.sequences == eager.stats.sequences
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 2  # one plan shape: q/k/v and attention-MLP, no recompile as rows finish
    assert dict(counters["graph_break"]) == {}
    swapped = polestar.generate(model, prompts[::-1], compile=True, **kw)  # the rows finish in swapped order
    assert swapped.tokens.tolist() == eager.tokens.flip(0).tolist()
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("compile, backend", [(False, None), (True, "inductor"), ("layers", "inductor"),
                                              ("aot_eager", "aot_eager")])
def test_compile_names_the_backend_of_the_layer_regions_made_once_per_backend(compile, backend):
    """``compile`` picks one thing: the backend the layer regions are compiled with (one route on every device). On
    a CPU inductor runs without its extern-kernel asserts; the compiled regions are made once per process and
    backend, lazily (nothing compiles here)."""
    from polestar.models import layer_regions
    from polestar.policy import assemble
    from polestar.step import StepRunner, region_backend

    assert region_backend(compile) == backend
    runner = StepRunner(compile, "cpu", assemble("fast-dllm"))
    again = StepRunner(compile, "cpu", assemble("fast-dllm", {"threshold?": 0.42}))
    if backend is None:
        assert runner.regions is None and again.regions is None
        return
    assert runner.regions is again.regions and runner.regions.compile is not None
    cpu_options = layer_regions.compiled(backend, options={"emulate_precision_casts": True, "size_asserts": False,
                                                           "scalar_asserts": False, "alignment_asserts": False})
    assert (runner.regions is cpu_options) == (backend == "inductor")


def test_a_compile_argument_that_is_no_backend_is_one_clear_error():
    from polestar.step import region_backend

    with pytest.raises(TypeError, match="compile must be a bool, a torch.compile backend name or a backend callable"):
        region_backend(3)
    with pytest.raises(ValueError, match="compile='inductr' is not a torch.compile backend; use compile=True"):
        region_backend("inductr")
