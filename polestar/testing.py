"""Checks a researcher points at a stage of their own, and the pytest plugin that runs them.

``check_stage("drift", "hellinger")`` runs, for the registered stage ``kind`` / ``name``:

* ``contract``: the example inputs of the kind's :class:`~polestar.stage_kinds.StageKind` record (seeded draws:
  sizes, sharp and flat distributions, magnitudes) through the stage with :mod:`polestar.contracts` checking every
  output, plus the record's laws (a drift is 0 on equal inputs, or on one-hot rows for a metric that ignores
  ``prev``; a lossless quantizer is exact; an offloader reads back the rows it wrote; clusterers label valid
  positions only);
* ``laws``: the kind's laws again on another seed's example draws (a drift is 0 on equal inputs and the same twice, a
  lossless quantizer exact, a clusterer the same for the same seed); ``pure`` is an older name of it;
* ``invariants``: decoding with the stage swapped into a policy that reads its kind (:func:`host_policy`) keeps the
  engine's invariants at every step (:func:`check_step`), with every stage output checked;
* ``determinism``: the same seed gives the same tokens (greedy and sampled);
* ``batch-invariance``: a prompt decodes to the same tokens alone and in a batch with a prompt of another length.

Each check raises AssertionError (or :class:`~polestar.contracts.StageContractError`) with one message naming the
stage. The models are the small random LLaDA and Dream of :func:`tiny_model` (no checkpoint needed).

The pytest plugin (``pytest -p polestar.testing``; installed as a ``pytest11`` entry point) adds
``--polestar-stage KIND:NAME`` (repeatable; one test per check), ``--polestar-plugin MODULE_OR_FILE`` (imported
before collection, as ``polestar --plugin``, with or without ``--polestar-stage``: the pytest-benchmark suite then
benchmarks the policies it registers) and ``--polestar-checks contract,laws`` (a subset of :data:`CHECKS`)::

    pytest -p polestar.testing --polestar-plugin mydrift.py --polestar-stage drift:hellinger

With ``--polestar-stage`` and no test path, only the stage checks run (not the tests of the folder it runs in); a
missing plugin file, an unknown stage or check is pytest's one-line usage error (exit code 4).

The project's own registry-parametrized tests call the same functions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from polestar import contracts, registry
from polestar.api import generate
from polestar.models.loading import build_model
from polestar.plugins import load_plugins
from polestar.policy import composition, policy_names
from polestar.stage_kinds import KINDS

#: the small random model's spec (token ids 38 / 39 are EOS / mask): fast enough for many decodes per test
TINY = dict(
    n_layers=2, d_model=32, n_heads=4, n_kv_heads=4, mlp_hidden=64, vocab_size=40, embedding_size=40,
    rope_theta=10000.0, norm_eps=1e-5, max_seq_len=256, mask_id=39, eos_id=38, pad_id=38,
)

#: prompts of different lengths (below the special ids), so that the batch-invariance check exercises left padding
PROMPTS = [[5, 17, 3], [9, 1, 22, 30, 4, 11, 2]]

CHECKS = ("contract", "laws", "invariants", "determinism", "batch-invariance")
#: older names of checks, still accepted
ALIASES = {"pure": "laws"}


def tiny_model(family: str = "llada", seed: int = 0, **over: Any):
    """A small random LLaDA (``family="llada"``) or Dream model (grouped K/V, QKV bias) with :data:`TINY`'s spec."""
    kw = dict(TINY)
    if family == "dream":
        kw.update(n_kv_heads=2, rope_theta=1e6, qkv_bias=True)
    kw.update(over)
    torch.manual_seed(seed)
    return build_model(family, kw, seed=seed)


@functools.cache
def _shared_model(family: str):
    return tiny_model(family, seed=31)


def host_policy(kind: str) -> str:
    """The policy a stage of ``kind`` is swapped into: ``fast-dllm`` when it has that kind, else the first
    registered policy that has one (a drift stage goes where a stage reads drift)."""
    if kind in composition("fast-dllm"):
        return "fast-dllm"
    return next(p for p in policy_names() if kind in composition(p))


# ----------------------------------------------------------------------------------------------- stage level


def attention_pair(gen: torch.Generator, b: int, h: int, r: int, t: int, sharp: float):
    """Two attention tensors ``[B, H, R, T]`` (softmax rows), ``sharp`` from near-uniform (0.1) to near-one-hot."""
    cur = (torch.randn(b, h, r, t, generator=gen) * sharp).softmax(-1)
    prev = (torch.randn(b, h, r, t, generator=gen) * sharp).softmax(-1)
    return cur, prev


def check_example(stage, *example: Any) -> None:
    """The laws of ``stage``'s kind (its :class:`~polestar.stage_kinds.StageKind` record) on one example input, on
    a fresh instance whose contract methods are checked."""
    laws = KINDS[stage.kind].laws
    if laws is None:
        raise ValueError(f"stage kind {stage.kind!r} has no example laws (its stages are checked in a decode)")
    laws(contracts.checked(_fresh(stage)), *example)


def check_drift_metric(metric, cur: torch.Tensor, prev: torch.Tensor) -> None:
    """A drift on one input pair: the contract (``[B, R]``, finite, ≥ 0), the same scores twice, and 0 on equal
    inputs — or, for a metric that ignores ``prev``, 0 on one-hot rows."""
    check_example(metric, cur, prev)


def check_quant_round_trip(stage, x: torch.Tensor) -> None:
    """``decode(encode(x))``: ``x``'s shape and dtype, exact for a lossless quantizer, the same twice, and
    ``from_leaves(to_leaves(...))`` decodes to the same values."""
    check_example(stage, x)


def check_clusterer(stage, x: torch.Tensor, k: int, valid: torch.Tensor, seed: int) -> None:
    """One clustering: the contract, counts that match the labels, and the same result for the same seed."""
    check_example(stage, x, k, valid, seed)


def check_offloader(stage, leaves: Sequence[torch.Tensor], rows: torch.Tensor, values: Sequence[torch.Tensor]) -> None:
    """``alloc(leaves)``, ``write_rows(rows, values)`` then ``read_rows(rows)`` gives the values back; unwritten
    rows keep ``leaves``' values."""
    check_example(stage, leaves, rows, values)


def _fresh(stage):
    """A new instance of ``stage``'s class with its config (an unchecked stage, whatever was wrapped)."""
    return type(stage)(stage.config)


def check_contract(kind: str, name: str, examples: int = 12, seed: int = 0) -> None:
    """The stage-level contract of ``kind`` / ``name`` on ``examples`` seeded inputs of its kind's record (the
    ``contract`` and ``laws`` checks: :func:`check_example` on each); for a kind without example inputs (refresh,
    commit: their input is a decoding state), one checked decode."""
    registry.lookup(kind, name)
    gen = torch.Generator().manual_seed(seed)
    record = KINDS[kind]
    if record.examples is not None:
        stage = registry.build(kind, name)
        for example in record.examples(gen, examples):
            check_example(stage, *example)
    else:
        generate(_shared_model("llada"), PROMPTS, policy=host_policy(kind), gen_length=16, block_length=8,
                          check_stages=True, **{kind: name})


# ----------------------------------------------------------------------------------------------- engine level


def check_step(record, mask_id: int, eos_id: int) -> None:
    """The engine's invariants of one step (a :class:`~polestar.state.StepRecord`): committed tokens never change,
    frozen rows not at all; every active row commits at least one token of its block; the typed origins account for
    every commit (else it is the EOS fill of a finished row); the plan names real positions of active rows only."""
    before, after, active = record.tokens_before, record.tokens_after, record.active
    T = before.shape[1]
    fixed = before != mask_id
    assert (after[fixed] == before[fixed]).all(), "a committed token changed"
    assert (after[~active] == before[~active]).all(), "a frozen row changed"
    region = record.region  # the step's commit region: its block, or a sliding window's columns
    if region is None:
        region = torch.arange(record.block_start, record.block_end)[None, :].expand(before.shape[0], -1)
    in_block = record.committed.gather(1, region)
    assert in_block[active].any(dim=1).all(), "an active row committed nothing in its block"
    origin = record.origins.block
    assert (in_block | ~origin).all(), "an origin names a position that was not committed"
    assert (after.gather(1, region)[in_block & ~origin] == eos_id).all(), (
        "a commit without an origin that is not the EOS fill")
    plan = record.plan
    layers = [plan.at(layer) for layer in range(len(plan.index))] if plan.per_layer else [plan.at(0)]
    running = active if record.held is None else active | record.held  # held rows compute, commit at the next step
    for index, valid in layers:
        assert ((index[valid] >= 0) & (index[valid] < T)).all(), "the plan names a position outside the sequence"
        assert not valid[~running].any(), "the plan recomputes a frozen row"


def check_decode_invariants(model, policy: str, prompts, swap: dict[str, Any] | None = None, gen_length: int = 16,
                            block_length: int = 8, **decoding: Any):
    """Decode ``prompts`` with every stage output checked and :func:`check_step` on every step; each sequence
    terminates within ``gen_length`` forward passes with every position decided. Returns the output."""
    records: list = []
    out = generate(model, prompts, policy=policy, gen_length=gen_length, block_length=block_length,
                            on_step=records.append, check_stages=True, **decoding, **(swap or {}))
    mask_id, eos_id = model.spec.mask_id, model.spec.eos_id
    for record in records:
        check_step(record, mask_id, eos_id)
    assert out.stats.nfe == len(records) <= gen_length, f"{policy}: {out.stats.nfe} steps for {gen_length} tokens"
    for i, seq in enumerate(out.stats.sequences):
        assert seq.nfe == sum(int(r.active[i]) for r in records) <= gen_length
        assert seq.error is None, f"{policy}: sequence {i} stopped early: {seq.error}"
    assert (out.generations != mask_id).all(), f"{policy}: a generated position was left masked"
    assert torch.equal(out.tokens, records[-1].tokens_after)
    return out


def check_determinism(model, policy: str, swap: dict[str, Any] | None = None, temperature: float = 0.0,
                      prompts=PROMPTS, gen_length: int = 16, block_length: int = 8) -> None:
    """The same seed gives the same tokens and step counts (sampled too, with ``temperature`` > 0)."""
    runs = [generate(model, prompts, policy=policy, temperature=temperature, seed=7, gen_length=gen_length,
                              block_length=block_length, **(swap or {})) for _ in range(2)]
    assert torch.equal(runs[0].tokens, runs[1].tokens), f"{policy} {swap or ''}: the same seed gave other tokens"
    assert [s.nfe for s in runs[0].stats.sequences] == [s.nfe for s in runs[1].stats.sequences]


def check_batch_invariance(model, policy: str, swap: dict[str, Any] | None = None, prompts=PROMPTS,
                           gen_length: int = 32, block_length: int = 16) -> None:
    """Each prompt decodes to the same tokens alone and in the batch (greedy, fp32; prompts of different lengths,
    so left padding is exercised)."""
    kw = dict(policy=policy, gen_length=gen_length, block_length=block_length, **(swap or {}))
    batch = generate(model, prompts, **kw).generations
    for i, prompt in enumerate(prompts):
        alone = generate(model, [prompt], **kw).generations[0]
        assert torch.equal(batch[i], alone), f"{policy} {swap or ''}: prompt {i} decodes differently alone and " \
            "in the batch"


def _invariants(kind: str, name: str) -> None:
    swap, policy = {kind: name}, host_policy(kind)
    gen = torch.Generator().manual_seed(0)
    for family in ("llada", "dream"):
        for block, n_blocks, stop in ((4, 3, True), (8, 2, False)):
            prompts = [torch.randint(0, TINY["mask_id"], (int(n),), generator=gen).tolist()
                       for n in torch.randint(1, 7, (2,), generator=gen)]
            check_decode_invariants(_shared_model(family), policy, prompts, swap, block * n_blocks, block,
                                    threshold=float(torch.rand(1, generator=gen)) * 0.9 + 0.05, stop_at_eos=stop)


def _determinism(kind: str, name: str) -> None:
    for temperature in (0.0, 1.0):
        check_determinism(_shared_model("llada"), host_policy(kind), {kind: name}, temperature)


def _batch_invariance(kind: str, name: str) -> None:
    for family in ("llada", "dream"):
        check_batch_invariance(_shared_model(family), host_policy(kind), {kind: name})


_CHECKS: dict[str, Callable[[str, str], None]] = {
    "contract": lambda kind, name: check_contract(kind, name),
    "laws": lambda kind, name: check_contract(kind, name, examples=3, seed=1),
    "invariants": _invariants,
    "determinism": _determinism,
    "batch-invariance": _batch_invariance,
}


def _known_checks(checks: Sequence[str], where: str = "") -> None:
    """ValueError naming the entries of ``checks`` that are not in :data:`CHECKS` (or :data:`ALIASES`)."""
    unknown = sorted(set(checks) - set(CHECKS) - set(ALIASES))
    if unknown:
        raise ValueError(f"{where}unknown checks {unknown}; checks: {', '.join(CHECKS)}")


def _lookup(kind: str, name: str) -> None:
    """The stage must be registered; an unknown name says how to register it (import the module that defines it)."""
    try:
        registry.lookup(kind, name)
    except registry.UnknownNameError as err:
        raise registry.UnknownNameError(f"{err}; import the module or file that registers it first, e.g. "
                                        'polestar.load_plugin("mydrift.py") (pytest: --polestar-plugin mydrift.py)'
                                        ) from None


def check_stage(kind: str, name: str, checks: Sequence[str] = CHECKS) -> None:
    """Run ``checks`` (default: all of :data:`CHECKS`) on the registered stage ``kind`` / ``name``; the first
    failure raises with a message naming the stage and the check, and a pass prints one line listing the checks.
    The stage must be registered first (import its module, or ``polestar.load_plugin("mydrift.py")``)."""
    _lookup(kind, name)
    _known_checks(checks)
    checks = [ALIASES.get(check, check) for check in checks]
    for check in checks:
        try:
            _CHECKS[check](kind, name)
        except AssertionError as err:
            raise AssertionError(f"{kind} stage {name!r} fails the {check} check: {err}") from err
    print(f"{kind} stage {name!r} passed: {', '.join(checks)}")


# ----------------------------------------------------------------------------------------------- pytest plugin


def pytest_addoption(parser) -> None:
    group = parser.getgroup("polestar", "checks of polestar stages")
    group.addoption("--polestar-stage", action="append", default=[], metavar="KIND:NAME",
                    help="run polestar.testing's checks on this registered stage (repeatable)")
    group.addoption("--polestar-plugin", action="append", default=[], metavar="MODULE_OR_FILE",
                    help="import this module or .py file first (it registers the stage)")
    group.addoption("--polestar-checks", default=",".join(CHECKS), metavar="CHECK,...",
                    help=f"the checks to run (default: all of {', '.join(CHECKS)})")


def _stage_item_class():
    import pytest

    class StageCheck(pytest.Item):
        """One check of :func:`check_stage` on one stage, as a pytest test."""

        def __init__(self, *, kind: str, stage: str, check: str, **kw: Any) -> None:
            super().__init__(**kw)
            self.kind, self.stage, self.check = kind, stage, check

        def runtest(self) -> None:
            check_stage(self.kind, self.stage, [self.check])

        def reportinfo(self):
            return "polestar.testing", None, self.name

    return StageCheck


def _stage_specs(config) -> list[tuple[str, str]]:
    """``--polestar-stage KIND:NAME`` values as ``(kind, name)``, checked."""
    specs = []
    for spec in config.getoption("--polestar-stage", default=[]) or []:
        kind, sep, name = spec.partition(":")
        if not sep or not name:
            raise ValueError(f"--polestar-stage {spec!r}: write KIND:NAME, e.g. drift:hellinger")
        specs.append((kind, name))
    return specs


def _stage_mode(config) -> bool:
    return bool(config.getoption("--polestar-stage", default=[]))


def pytest_configure(config) -> None:
    """Import ``--polestar-plugin`` before collecting (so tests parametrized from the registry, such as the
    pytest-benchmark suite's policies, include what it registers); with ``--polestar-stage`` also check every option.
    A bad one is pytest's one-line usage error (``ERROR: ...``, exit code 4), not an internal error."""
    import pytest

    if not _stage_mode(config):
        try:
            load_plugins(config.getoption("--polestar-plugin", default=[]) or [])
        except ValueError as err:
            raise pytest.UsageError(" ".join(str(err).split())) from None
        return

    try:
        load_plugins(config.getoption("--polestar-plugin", default=[]) or [])
        _known_checks([c for c in config.getoption("--polestar-checks").split(",") if c], "--polestar-checks: ")
        for kind, name in _stage_specs(config):
            _lookup(kind, name)
    except ValueError as err:
        raise pytest.UsageError(" ".join(str(err).split())) from None


def pytest_ignore_collect(collection_path, config):
    """With ``--polestar-stage`` and no test paths on the command line, only the stage checks run: the folder's own
    tests (its ``testpaths``, e.g. a whole project's suite) are not collected."""
    if _stage_mode(config) and not config.getoption("file_or_dir"):
        return True
    return None


def pytest_report_collectionfinish(config, items):
    """Under pytest's "collected N items" line (counted before the stage checks are added), the stage checks that
    will run."""
    if not _stage_mode(config) or config.getoption("collectonly"):  # --co lists the checks itself
        return None
    stage_items = [item.name for item in items if item.name.startswith("polestar-stage[")]
    return f"polestar stage checks: {len(stage_items)} ({', '.join(stage_items)})"


def pytest_collection_modifyitems(session, config, items) -> None:
    if not _stage_mode(config):
        return
    item_class = _stage_item_class()
    checks = [c for c in config.getoption("--polestar-checks").split(",") if c]
    for kind, name in _stage_specs(config):
        for check in checks:
            items.append(item_class.from_parent(session, name=f"polestar-stage[{kind}:{name}:{check}]", kind=kind,
                                                stage=name, check=check))
