"""``elastic-cache`` against the naive restatement of Elastic-Cache's released code
(``tests/reference.py::elastic_cache_generate``) on the shipped checkpoints: tokens and forwards per sequence, in a
mixed-length batch and one prompt at a time, the trigger's similarities and decisions, the EOS rule, and the rows
the policy computes against the rows the method computes.

Generation 32 with windows of 8 (and one window over the whole generation) keeps the file to about a minute; the
side-by-side with the released code itself (100 arith problems per setting) is in docs/results.md.
"""

import attrs
import pytest
import torch

import polestar
from tests.reference import elastic_cache_generate

GEN, WINDOW = 32, 8
CHECKPOINTS = ("tiny-llada", "tiny-dream", "tiny-llada-noisy", "tiny-dream-noisy")
PROMPTS = ("arith:7-7-7-5*5*0=", "arith:4+6=", "arith:3+4*2-5=")
#: policy options and the reference's keywords of the same setting
SETTINGS = {
    "defaults": ({}, {}),
    "gamma-0": ({"gamma": 0.0}, {"gamma": 0.0}),
    "gamma-1": ({"gamma": 1.0}, {"gamma": 1.0}),
    "whole-window": ({"window_length": GEN}, {"window_length": GEN}),
}
#: the released code's EOS (LLaDA-8B's <|endoftext|>, no token of the tiny vocabulary): it never stops
OFFICIAL_EOS = 126081

_MODELS: dict = {}


def _model(name):
    if name not in _MODELS:
        _MODELS[name] = polestar.load(name, dtype=torch.float32)
    return _MODELS[name]


def run_policy(model, prompts, on_step=None, stop_at_eos=False, **options):
    options = {"window_length": WINDOW, **options}
    return polestar.generate(model, list(prompts), policy="elastic-cache", gen_length=GEN, block_length=GEN,
                             threshold=0.9, stop_at_eos=stop_at_eos, on_step=on_step, **options)


def run_reference(model, prompts, **kw):
    ids, mask = polestar.api.encode_prompts(model, list(prompts))
    kw = {"window_length": WINDOW, **kw}
    return elastic_cache_generate(model, ids, mask, gen_length=GEN, threshold=0.9, **kw)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_a_mixed_length_batch_is_the_released_code_row_by_row(name, setting):
    """Every sequence of a batch of three prompt lengths gets the reference's tokens (which decodes each alone) and
    its number of forwards; the rows the policy computes for it are at most 1.15 times the method's."""
    model = _model(name)
    options, kw = SETTINGS[setting]
    out = run_policy(model, PROMPTS, eos_id=OFFICIAL_EOS, **options)
    want, stats = run_reference(model, PROMPTS, **kw)
    P = out.prompt_len
    assert out.tokens[:, P:].tolist() == want[:, P:].tolist()
    assert [s.nfe for s in out.stats.sequences] == [s["nfe"] for s in stats]
    assert sum(s.token_layer_evals for s in out.stats.sequences) <= 1.15 * sum(s["rows"] for s in stats)


@pytest.mark.parametrize("name", ("tiny-llada", "tiny-dream"))
def test_a_prompt_longer_than_the_generation_is_the_released_code(name):
    """The tracked tokens are picked among the prompt and the decoded positions of a sequence whose prompt is
    longer than its generation (8 tokens after a 15-character prompt)."""
    model, prompt = _model(name), ["arith:3+4*2-5+1="]
    out = polestar.generate(model, prompt, policy="elastic-cache", gen_length=8, block_length=8, threshold=0.9,
                            stop_at_eos=False, window_length=4, eos_id=OFFICIAL_EOS)
    ids, mask = polestar.api.encode_prompts(model, prompt)
    want, _ = elastic_cache_generate(model, ids, mask, gen_length=8, window_length=4, threshold=0.9)
    assert out.prompt_len > 8
    assert out.tokens[:, out.prompt_len:].tolist() == want[:, out.prompt_len:].tolist()


@pytest.mark.parametrize("name", ("tiny-llada", "tiny-dream"))
def test_a_recomputation_from_layer_1_computes_layer_0_in_the_query_rows_slots(name):
    """At gamma 1 nearly every forward triggers at layer 0 (decided ahead) and recomputes from layer 1: layer 0
    computes the query rows in the cached step's slots, not a plan as wide as the sequence, so the rows the step
    executes (padding slots included) exceed the sequence's own by the rounding of the query rows alone (a plan as
    wide as the sequence at layer 0 gave 1.20x and 1.22x here)."""
    out = run_policy(_model(name), PROMPTS[2:], gamma=1.0, eos_id=OFFICIAL_EOS)
    own = sum(s.token_layer_evals for s in out.stats.sequences)
    assert out.stats.token_layer_evals <= 1.05 * own


@pytest.mark.parametrize("name", ("tiny-llada-noisy", "tiny-dream"))
def test_one_prompt_at_a_time_equals_the_batch(name):
    model = _model(name)
    batch = run_policy(model, PROMPTS, gamma=1.0)
    for b, prompt in enumerate(PROMPTS):
        alone = run_policy(model, [prompt], gamma=1.0)
        assert alone.tokens[0, alone.prompt_len:].tolist() == batch.tokens[b, batch.prompt_len:].tolist()
        assert alone.stats.sequences[0] == batch.stats.sequences[b]


@pytest.mark.parametrize("name", ("tiny-llada-noisy", "tiny-dream-noisy"))
def test_the_trigger_fires_exactly_where_the_tracked_tokens_attention_moved_past_gamma(name):
    """At every checked layer of every later forward the policy's similarity (the tracked tokens' attention as it was
    and as it is, cosine over heads, averaged) is the reference's, and a row is recomputed from the layer above the
    first layer where it is below gamma: exactly there, never elsewhere."""
    model = _model(name)
    L, gamma = model.spec.n_layers, 0.9
    records = []
    run_policy(model, PROMPTS[:1], on_step=records.append, eos_id=OFFICIAL_EOS, gamma=gamma)
    _, stats = run_reference(model, PROMPTS[:1], gamma=gamma)
    checked = [r for r in records if r.detail.stages.get("trigger")]  # the forwards after the first, in order
    want: dict = {}
    for forward, layer, sim in stats[0]["similarity"]:
        want.setdefault(forward, {})[layer] = sim
    assert len(checked) == len(want) == stats[0]["nfe"] - 1
    fired_forwards = 0
    for record, forward in zip(checked, sorted(want)):
        sims = [float(record.detail.stages["trigger"][layer][0][0]) for layer in range(L)]
        triggered = [bool(record.detail.stages["trigger"][layer][1][0]) for layer in range(L)]
        first = next((layer for layer in range(L) if sims[layer] < gamma), L)
        assert triggered == [layer >= first for layer in range(L)]
        # the reference checks the layers up to its first trigger (later layers are recomputed, not checked)
        assert sorted(want[forward]) == list(range(min(first, L - 1) + 1))
        assert sims[: first + 1] == pytest.approx([want[forward][layer] for layer in range(min(first, L - 1) + 1)],
                                                  abs=1e-5)
        fired_forwards += first < L - 1
    assert fired_forwards == stats[0]["triggers"] > 0


def test_gamma_zero_never_recomputes_and_the_first_forward_is_the_only_full_one():
    model = _model("tiny-llada-noisy")
    records = []
    out = run_policy(model, PROMPTS[:1], on_step=records.append, eos_id=OFFICIAL_EOS, gamma=0.0)
    T, L = out.tokens.shape[1], model.spec.n_layers
    assert [r.plan.first_layer for r in records] == [0] * len(records)
    assert records[0].cost.layer_rows == T * L
    assert all(r.cost.layer_rows < T * L for r in records[1:])
    assert out.stats.nfe == out.stats.sequences[0].nfe == len(records)


@pytest.mark.parametrize("name", ("tiny-llada", "tiny-dream"))
def test_the_window_stops_at_the_models_eos_by_default(name):
    """The released code bounds the window at the first committed ``eos_id``, hard-coded to LLaDA-8B's id. The
    policy bounds it at the model's EOS when decoding stops at EOS (the default; the positions right of it are then
    filled with EOS), and ``eos_id`` sets one id as the released code does."""
    model = _model(name)
    eos = model.spec.eos_id
    bounded = run_policy(model, PROMPTS, eos_id=eos)
    want, stats = run_reference(model, PROMPTS, eos_id=eos)
    P = bounded.prompt_len
    assert bounded.tokens[:, P:].tolist() == want[:, P:].tolist()
    assert [s.nfe for s in bounded.stats.sequences] == [s["nfe"] for s in stats]
    assert any(eos in row and model.spec.mask_id in row for row in want[:, P:].tolist())  # the rule mattered
    # by default: the same text, at most as many forwards (a row is done once everything left of its first EOS is)
    default = run_policy(model, PROMPTS, stop_at_eos=True)
    assert default.texts == bounded.texts
    assert all(a.nfe <= b.nfe for a, b in zip(default.stats.sequences, bounded.stats.sequences))
    assert model.spec.mask_id not in default.tokens[:, P:].tolist()
    # not stopping at EOS and no id: nothing bounds the window
    free, _ = run_reference(model, PROMPTS)
    assert run_policy(model, PROMPTS).tokens[:, P:].tolist() == free[:, P:].tolist()


def _window_state(rows, P=2, R=3, eos=0, mask=9):
    """A decode state over generation rows ``rows`` (lists of ids, ``mask`` masked) after a prompt of ``P``."""
    from polestar.config import GenerationConfig
    from polestar.region import WindowRegion
    from polestar.state import DecodeState, StepClock

    G = len(rows[0])
    x = torch.tensor([[5] * P + r for r in rows])
    state = DecodeState(x=x, active=torch.ones(len(rows), dtype=torch.bool), config=GenerationConfig(G, G),
                        mask_id=mask, eos_id=eos, prompt_len=P, logit_shift=0, n_layers=1,
                        generator=torch.Generator().manual_seed(0), clock=StepClock.at(P, "cpu"),
                        schedule=WindowRegion(R))
    state.schedule.begin_block(state)
    return state


def test_the_window_is_each_rows_first_masked_positions_and_stops_at_the_first_eos_step():
    state = _window_state([[9, 3, 9, 9, 4, 9], [3, 4, 9, 3, 3, 3]])
    # the first three masked columns in order; a row with fewer gets distinct committed columns, marked invalid
    assert state.region.tolist() == [[2, 4, 5], [4, 2, 3]]
    assert state.region_valid.tolist() == [[True, True, True], [True, False, False]]
    assert state.block_masked().tolist() == [[True, True, True], [True, False, False]]
    # row 0 commits an EOS at column 5 and a token at 2; the window then never passes column 5
    committed = torch.tensor([[True, False, True], [False, False, False]])
    tokens = torch.tensor([[7, 0, 0], [0, 0, 0]])
    state.x[0, 2], state.x[0, 5] = 7, 0
    state.schedule.advance(state, committed, tokens, torch.tensor([0]))
    assert state.horizon.tolist() == [5, state.length]
    assert state.region[0].tolist()[:1] == [4] and state.region_valid[0].tolist() == [True, False, False]
    # a later EOS further left does not move the bound; once nothing is left the row has no work
    state.x[0, 4] = 0
    state.schedule.advance(state, torch.tensor([[True, False, False], [False] * 3]), torch.tensor([[0, 0, 0], [0] * 3]),
                           torch.tensor([0]))
    assert state.horizon.tolist() == [5, state.length] and not state.region_valid[0].any()
    state.x[1, 4] = 3
    state.schedule.advance(state, torch.zeros(2, 3, dtype=torch.bool), torch.zeros(2, 3, dtype=torch.long),
                           torch.tensor([0]))
    assert state.schedule.work(state, torch.zeros(2, dtype=torch.bool)).tolist() == [False]


@pytest.mark.slow
def test_a_whole_step_compile_runs_each_layer_as_one_region_and_equals_eager_in_every_step_kind():
    """In a whole-step graph each Elastic-Cache layer is one region (``_tracked_layer``, or ``_checked_layer`` with
    the trigger test; the buffers it rewrote copied back): on the noisy checkpoint's four layers three arith prompts
    meet a batch start, cached steps, a fire at layer 0 and a rerun from a layer above, and the tokens and counters
    equal eager decoding."""
    model = polestar.load("tiny-llada-noisy", dtype=torch.float32)
    arith = ["arith:7-7-7-5*5*0=", "arith:4+6=", "arith:3+4*2-5="]
    kw = dict(policy="elastic-cache", gen_length=32, block_length=8, gamma=0.95, threshold=0.9, window_length=8)
    outs = []
    for compile in (False, "eager"):
        torch._dynamo.reset()
        outs.append(polestar.generate(model, arith, compile=compile, **kw))
    eager, compiled = outs
    assert compiled.stats.compiled_steps > 0
    assert torch.equal(eager.tokens, compiled.tokens)
    untimed = dict(wall_s=0.0, compile_s=0.0, compiled_steps=0)
    assert attrs.evolve(eager.stats, **untimed) == attrs.evolve(compiled.stats, **untimed)
