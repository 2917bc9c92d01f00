"""``polestar trace``: the figure data agree with the engine's records for every registered policy (commit steps,
origins, confidences, recomputed positions, Polestar-Cache's clusters, Elastic-Cache's trigger, per-step cost),
recording adds no host read to a step, the command writes its files (also with a plugin stage), and the page
loads in a real headless browser (Chrome or Chromium; skipped without one unless ``POLESTAR_REQUIRE_BROWSER`` is
set, as in CI) with no console message and a non-blank screenshot."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

import polestar
from polestar.cli import main
from polestar.config import GenerationConfig
from polestar.engine import decode
from polestar.policy import assemble, policy_names
from polestar.tasks import get_task
from polestar.tracing.figures import first_difference, policy_figures
from polestar.tracing.record import ORIGINS, TraceRecorder
from polestar.tracing.stage_figure import figures_of
from tests.conftest import make_model
from tests.host_reads import count_host_reads

PROMPT = [5, 7, 1, 3, 9, 2, 4]
DECODING = dict(gen_length=24, block_length=8, threshold=0.3)


@pytest.fixture(scope="module", params=["llada", "dream"])
def small_model(request):
    return make_model(request.param, seed=3, n_layers=2, d_model=32)


def _decode(model, name: str):
    """Decode ``PROMPT`` keeping both the raw records and the trace's figure data."""
    pipeline = assemble(name, {"threshold?": 0.3})
    threshold = getattr(pipeline.commit.config, "threshold", None)
    figures_here = figures_of(pipeline)
    recorder = TraceRecorder(threshold, model.spec.n_layers, figures_here)
    records = []

    def observe(record):
        records.append(record)
        recorder(record)

    out = polestar.generate(model, [PROMPT], policy=name, on_step=observe, **DECODING)
    final = out.tokens[0].tolist()
    figures = policy_figures(name, {}, recorder.steps, out.prompt_len, DECODING["block_length"], final,
                             [str(t) for t in final], "", model.spec.n_layers, figures_here)
    return out, records, figures, threshold


def _positions(index: torch.Tensor, valid: torch.Tensor) -> set[int]:
    return {int(p) for p, ok in zip(index.flatten(), valid.flatten()) if ok}


@pytest.mark.parametrize("name", policy_names())
def test_figures_agree_with_the_records(small_model, name):
    out, records, fig, tau = _decode(small_model, name)
    spec, P = small_model.spec, out.prompt_len
    cells = {c.position: c for c in fig.commit.cells}
    # commit steps: every position committed once, at the step whose record committed it
    expected_step = {int(p): r.step for r in records for p in range(P, r.committed.shape[1]) if r.committed[0, p]}
    assert {p: c.step for p, c in cells.items()} == expected_step
    assert all(c.token == out.tokens[0, c.position] for c in cells.values())
    assert fig.nfe == len(records) == out.stats.nfe
    for r in records:
        o = r.origins
        mine = {p: c for p, c in cells.items() if c.step == r.step}
        suffix = (set() if o.suffix is None
                  else {int(p) for p, ok in zip(o.suffix.positions[0], o.suffix.commit[0]) if ok})
        cols = r.region[0].tolist()
        block = {cols[j] for j in range(o.rule.shape[1]) if o.block[0, j]}
        assert {p for p, c in mine.items() if c.origin == "suffix"} == suffix
        assert {p for p, c in mine.items() if c.origin in ("early", "forced", "confident", "rule")} == block
        assert {p for p, c in mine.items() if c.origin == "eos"} == set(mine) - suffix - block
        assert all(int(out.tokens[0, p]) == spec.eos_id for p, c in mine.items() if c.origin == "eos")
        top = float(r.confidence[0].max()) if r.masked[0].any() else None
        for p, c in mine.items():
            if p in block:  # confidence at commit is the step's confidence of that block column
                assert c.confidence == pytest.approx(float(r.confidence[0, cols.index(p)]))
            if c.origin == "confident":
                assert tau is not None and c.confidence >= tau
            if c.origin == "forced":  # the row's most confident masked position, below τ unless the engine forced it
                assert c.confidence == pytest.approx(top)
                assert o.forced[0, cols.index(p)] or c.confidence < tau
            if c.origin == "early":
                assert o.early is not None and o.early[0, cols.index(p)]
            if c.origin == "rule":
                assert tau is None or c.confidence < tau
        assert sum(c.origin == "forced" for c in mine.values()) <= 1
    # positions still masked in the block at a step that did not commit them
    waiting = {(int(r.region[0, j]), r.step) for r in records for j in range(r.masked.shape[1])
               if r.masked[0, j] and not r.origins.block[0, j]}
    assert set(fig.commit.waiting) == waiting


@pytest.mark.parametrize("name", policy_names())
def test_recomputed_positions_agree_with_the_records_and_the_counters(small_model, name):
    out, records, fig, _ = _decode(small_model, name)
    n_layers = small_model.spec.n_layers
    grid = fig.refresh
    for r in records:
        for layer in range(n_layers):
            index, valid = r.detail.computed.get(layer, r.plan.at(layer))  # a feature cache computes some plan rows
            assert set(grid.computed[layer][r.step]) == _positions(index[0], valid[0])
            members = (set() if layer not in r.detail.refreshed
                       else _positions(*(t[0] for t in r.detail.refreshed[layer])))
            assert set(grid.refreshed[layer][r.step]) == members
    # every row through a layer's MLP, counted by the engine, is a plan column, a sparse update's member or a commit
    # rule's own row
    drawn = sum(len(cols) for layer in grid.computed for cols in layer) + \
        sum(len(cols) for layer in grid.refreshed for cols in layer) + \
        sum(len(cols) for layer in grid.verified for cols in layer)
    assert drawn == out.stats.sequences[0].token_layer_evals
    assert [c for c in fig.cost.layer_rows] == [r.cost.layer_rows for r in records]
    assert [c for c in fig.cost.proxy_rows] == [r.cost.probe_rows for r in records]
    assert sum(fig.cost.weight_bytes) == out.stats.weight_bytes
    refresh = assemble(name).refresh.name
    drift, trigger = fig.stage_figures.get("drift"), fig.stage_figures.get("trigger")
    assert (drift is not None) == (refresh == "polestar" and grid.has_updates)
    assert (trigger is not None) == (refresh == "elastic" and any(r.block_step > 0 for r in records))
    # the core draws what every policy has; a stage's own figures come only with that stage
    assert set(fig.stage_figures) <= {"drift", "trigger"}
    if drift is not None:  # Polestar-Cache recomputes members of its chosen (most drifting) clusters only
        steps = [s for s in records if s.detail.stages.get("clusters")]
        assert list(drift.steps) == [s.step for s in steps]
        # every layer scores its clusters, the last only for a commit rule that reads its packet
        wants_packet = assemble(name).refresh.packet_logits
        assert drift.layers == tuple(range(n_layers if wants_packet else n_layers - 1))
        for i, r in enumerate(steps):
            assert tuple(r.detail.stages["clusters"]) == drift.layers
            for j, layer in enumerate(drift.layers):
                c = r.detail.stages["clusters"][layer]
                assert list(drift.drift[j][i]) == pytest.approx(c.drift[0].tolist())
                chosen = {int(c.positions[w]) for w in range(c.labels.shape[1])
                          if c.labels[0, w] >= 0 and c.chosen[0, c.labels[0, w]]}
                assert set(grid.refreshed[layer][r.step]) <= chosen
        if not wants_packet:  # the last layer's members would feed nothing: none is recomputed
            assert not any(grid.refreshed[n_layers - 1])
    if trigger is not None:  # Elastic-Cache recomputes in its plan, from two layers above its trigger every
        # position, in the step that triggered (layer 0) or the next one; a trigger at the last two layers changes
        # no logit and recomputes nothing
        assert not any(any(layer) for layer in grid.refreshed)
        T = records[0].tokens_before.shape[1]
        for step, first in zip(trigger.steps, trigger.trigger):
            if first is None or first > n_layers - 3:
                continue
            done = records[step] if first == 0 else records[step + 1]
            for layer in range(first + 2, n_layers):
                assert len(grid.computed[layer][done.step]) == T


@pytest.mark.parametrize("name", policy_names())
def test_recording_adds_no_host_read_to_a_step(small_model, name):
    """With an observer the stages gather their details (references, no read): the loop still reads once per
    step, once before the first and once for the counters, as without one."""
    ids, mask = polestar.encode_prompts(small_model, [PROMPT])
    config = GenerationConfig(DECODING["gen_length"], DECODING["block_length"])
    details = []
    with count_host_reads() as reads:
        _, stats = decode(small_model, ids, mask, assemble(name, {"threshold?": 0.3}), config,
                          on_step=lambda record: details.append(record.detail))
    assert len(reads) == stats.nfe + 2, reads
    assert len(details) == stats.nfe and all(d is not None for d in details)


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


@pytest.fixture(scope="module")
def sudoku_trace(tmp_path_factory):
    """The documented trace: fast-dllm vs polestar on tiny-llada-noisy's first sudoku test item, via the CLI."""
    out = tmp_path_factory.mktemp("trace")
    args = ["trace", "--model", "tiny-llada-noisy", "--task", "sudoku", "--index", "0", "--policies",
            "fast-dllm,polestar", "--out", str(out)]
    assert main(args) == 0
    return out


@pytest.mark.slow
def test_the_command_writes_the_page_the_data_and_the_figures(sudoku_trace):
    names = {p.name for p in sudoku_trace.iterdir()}
    assert {"trace.html", "trace.json", "commits.png", "recompute-fast-dllm.png", "recompute-polestar.png",
            "drift-polestar.png", "cost.png"} <= names
    data = json.loads((sudoku_trace / "trace.json").read_text())
    assert [f["policy"] for f in data["figures"]] == ["fast-dllm", "polestar"]
    a, b = (f["tokens"][data["prompt_len"]:] for f in data["figures"])
    diff = first_difference(a, b)
    assert data["first_difference"] == (None if diff is None else data["prompt_len"] + diff)
    page = (sudoku_trace / "trace.html").read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)  # self-contained: nothing fetched
    assert page.count("<svg") >= 2 + 2 * 2 + 2 + 3


@pytest.mark.slow
def test_what_the_docs_say_about_item_0_is_what_the_command_draws(sudoku_trace):
    """docs/trace.md describes this very trace (and shows its figures): its outputs, step counts and first
    difference must be the command's, or the page is stale."""
    data = json.loads((sudoku_trace / "trace.json").read_text())
    fast, pole = ({"text": " ".join(f["text"].split()), "nfe": f["nfe"]} for f in data["figures"])
    page = " ".join((Path(__file__).parent.parent / "docs" / "trace.md").read_text().split())
    section = page[page.index("## fast-dllm vs polestar on tiny-llada-noisy sudoku"):page.index("Item 5 shows")]
    assert re.search(rf"Fast-dLLM writes a wrong grid, `{fast['text']}`", section)
    assert f"the whole decode {fast['nfe']}. Polestar" in section
    assert f"the whole decode {pole['nfe']}, and it writes the answer, `{pole['text']}`" in section
    assert pole["text"] == " ".join(data["reference"].split()) != fast["text"]
    column = data["first_difference"]
    assert f"generated position {column - data['prompt_len']}, column {column}" in section


@pytest.mark.parametrize("argv, message", [
    (["--policies", "fast-dllm,polestar,eb"], "one policy or two"),
    (["--policies", "fast-dllm", "--index", "0"], "--index picks an item of --task"),
    (["--policies", "fast-dllm", "--task", "sudoku", "--compile"], "drop --compile"),
    (["--policies", "fast-dllm", "--policy", "eb", "--task", "sudoku"], "takes --policies"),
    (["--policies", "fast-dllm,eb", "--task", "sudoku", "--set", "refresh.topk=3"], "topk"),
])
def test_bad_arguments_are_usage_errors(tmp_path, capsys, argv, message):
    assert main(["trace", "--model", "tiny-llada", "--out", str(tmp_path / "t"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "t").exists()


def test_an_out_folder_inside_a_missing_folder_is_the_same_error_as_bench_json(tmp_path, capsys):
    missing = tmp_path / "missing"
    assert main(["trace", "--model", "tiny-llada", "--policies", "fast-dllm", "--task", "sudoku",
                 "--out", str(missing / "t")]) == 2
    trace_err = capsys.readouterr().err
    assert main(["bench", "--policies", "fast-dllm", "--n", "2", "--json", str(missing / "out.json")]) == 2
    bench_err = capsys.readouterr().err
    for err in (trace_err, bench_err):
        assert f"directory {missing} does not exist; create it first (mkdir -p {missing})" in err, err
        assert err.count("\n") == 1
    assert not missing.exists()


PLUGIN = textwrap.dedent('''
    import attrs

    from polestar.policies.drift import DriftMetric
    from polestar.registry import register


    @register("drift", "trace-l1")
    class L1Drift(DriftMetric):
        """Half the L1 distance of attention rows, averaged over heads: ``[B, H, R, T]`` twice -> ``[B, R]``."""

        @attrs.frozen
        class Config:
            pass

        def score(self, cur, prev):
            return (cur.float() - prev.float()).abs().sum(-1).mul(0.5).mean(dim=1)
''')


def test_a_plugin_stage_is_traced(tmp_path, isolated_registry):
    plugin = tmp_path / "trace_l1.py"
    plugin.write_text(PLUGIN)
    out = tmp_path / "out"
    assert main(["trace", "--plugin", str(plugin), "--model", "tiny-llada", "--task", "arith", "--index", "1",
                 "--policies", "polestar", "--set", "drift=trace-l1", "--gen-length", "32", "--no-png",
                 "--out", str(out)]) == 0
    data = json.loads((out / "trace.json").read_text())
    (fig,) = data["figures"]
    assert fig["stages"]["drift"] == "trace-l1"
    assert {c["origin"] for c in fig["commit"]["cells"]} <= set(ORIGINS)
    assert fig["stage_figures"]["drift"] is not None and not list(out.glob("*.png"))
    page = (out / "trace.html").read_text()  # the drift figure names the plugin's metric
    assert "Cluster drift per layer (polestar, drift=trace-l1)" in page
    assert "Drift metric: drift=trace-l1: Half the L1 distance of attention rows, averaged over heads" in page


def test_the_drift_figure_names_its_metric(tmp_path, monkeypatch):
    """The PNG's title and colour scale and the page's heading name the drift stage and what it computes."""
    pytest.importorskip("matplotlib")
    from polestar.policies.polestar_trace import drift_metric
    from polestar.tracing import png
    from polestar.tracing.run import trace

    assert drift_metric({"drift": "kl"}) == "drift=kl: KL(cur ‖ prev) per head, averaged over heads (Polestar's drift)"
    assert drift_metric({"drift": "js"}).startswith("drift=js: Jensen–Shannon divergence")
    assert drift_metric({"refresh": "dual"}) == "drift"
    texts = {}

    def keep(fig, path):
        texts[path.name] = [text for ax in fig.axes
                            for text in (*(ax.get_title(loc) for loc in ("left", "center")), ax.get_ylabel())]
        return path

    monkeypatch.setattr(png, "save_figure", keep)
    model = polestar.load("tiny-llada")
    result = trace(model, get_task("arith").format_prompt("3+4*2-5"), ["polestar"], tmp_path, gen_length=32,
                   block_length=16, drift="js")
    assert result.figures[0].stage_figures["drift"] is not None
    drift_texts = " | ".join(texts["drift-polestar.png"])
    assert "drift=js: Jensen–Shannon divergence per head, averaged over heads" in drift_texts
    assert "drift=js (log scale)" in drift_texts  # the colour bar's label
    assert "Cluster drift per layer (polestar, drift=js)" in (tmp_path / "trace.html").read_text()


#: set (to anything but 0) where the browser check must run: a missing browser then fails the test instead of
#: skipping it (``.ci/run`` sets it and installs Debian's chromium)
REQUIRE_BROWSER = "POLESTAR_REQUIRE_BROWSER"
#: a Chrome or Chromium binary to use instead of the first one found on PATH
BROWSER_VARIABLE = "POLESTAR_BROWSER"
BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
MACOS_CHROME = "/Applications/Google Chrome.app/Contents/MacOS/Google Chrome"


def find_browser() -> str | None:
    """``$POLESTAR_BROWSER``, else the first Chrome/Chromium binary on PATH (or macOS's Google Chrome), else None."""
    given = os.environ.get(BROWSER_VARIABLE, "").strip()
    if given:
        return shutil.which(given) or (given if os.path.isfile(given) else None)
    found = next((path for path in map(shutil.which, BROWSER_NAMES) if path), None)
    return found or (MACOS_CHROME if os.path.isfile(MACOS_CHROME) else None)


def browser_or_skip() -> str:
    """The browser to load the page in; without one the test is skipped, or fails when ``$POLESTAR_REQUIRE_BROWSER``
    is set (CI)."""
    path = find_browser()
    if path is not None:
        return path
    given = os.environ.get(BROWSER_VARIABLE, "").strip()
    why = (f"{BROWSER_VARIABLE}={given} is not an executable file" if given else
           f"no Chrome or Chromium on PATH (looked for {', '.join(BROWSER_NAMES)})")
    how = (f"install one (Debian: apt-get install -y chromium) or point {BROWSER_VARIABLE} at its binary")
    if os.environ.get(REQUIRE_BROWSER, "0").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(f"{REQUIRE_BROWSER} is set but the page check cannot run: {why}; {how}", pytrace=False)
    pytest.skip(f"{why}; {how} to load the page in a headless browser (set {REQUIRE_BROWSER}=1 to fail instead)")


@pytest.fixture(scope="module")
def browser() -> str:
    return browser_or_skip()


@pytest.mark.slow
def test_the_page_loads_in_a_headless_browser(browser, sudoku_trace, tmp_path):
    from PIL import Image

    page = (sudoku_trace / "trace.html").as_uri()
    shot = tmp_path / "page.png"
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--enable-logging=stderr", "--v=0", "--window-size=1400,1800"]
    run = subprocess.run([*flags, f"--screenshot={shot}", page], capture_output=True, text=True, timeout=120)
    console = [line for line in run.stderr.splitlines() if ":CONSOLE" in line]
    assert console == [], console  # the page logs nothing: no error, no uncaught exception
    dom = subprocess.run([*flags, "--dump-dom", page], capture_output=True, text=True, timeout=120)
    assert 'data-ready="1"' in dom.stdout  # its script ran to the end
    assert [line for line in dom.stderr.splitlines() if ":CONSOLE" in line] == []
    image = Image.open(shot).convert("RGB")
    assert image.size == (1400, 1800)
    colors = image.getcolors(maxcolors=1 << 20)
    assert len(colors) > 50  # drawn, not blank
    assert max(count for count, _ in colors) < 0.95 * image.size[0] * image.size[1]


def test_a_missing_browser_skips_the_page_check_here_and_fails_it_where_required(monkeypatch, tmp_path):
    import tests.test_trace as me

    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH but what the test puts there
    monkeypatch.setattr(me, "MACOS_CHROME", str(tmp_path / "Google Chrome"))
    for name in (BROWSER_VARIABLE, REQUIRE_BROWSER):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no Chrome or Chromium on PATH .*apt-get install -y chromium"):
        browser_or_skip()
    monkeypatch.setenv(REQUIRE_BROWSER, "1")
    with pytest.raises(pytest.fail.Exception, match=f"^{REQUIRE_BROWSER} is set but the page check cannot run"):
        browser_or_skip()
    fake = tmp_path / "google-chrome"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert browser_or_skip() == str(fake)
    monkeypatch.setenv(BROWSER_VARIABLE, str(tmp_path / "chrome-for-testing"))
    with pytest.raises(pytest.fail.Exception, match="chrome-for-testing is not an executable file"):
        browser_or_skip()
    # CI sets the variable before it runs the README's test command, so there a missing browser fails the suite
    ci = (Path(__file__).parent.parent / ".ci" / "run").read_text()
    assert f"export {REQUIRE_BROWSER}=1" in ci and ci.index(f"export {REQUIRE_BROWSER}=1") < ci.index("-m pytest")


def test_a_stage_from_outside_adds_its_own_figure(tmp_path, isolated_registry):
    """A stage gathers what it wants under a name of its own (``state.detail.entry``) and declares a figure that
    reads it back and draws it; the core page and ``trace.json`` carry it, and a policy without that stage has no
    such figure."""
    from typing import NamedTuple

    from polestar.policies.refresh_basic import DualRefresh
    from polestar.tracing.run import trace

    class WidthSeries(NamedTuple):
        steps: tuple[int, ...]
        width: tuple[int, ...]

        def html(self, policy, trace):
            return [f"<h2>Plan width ({policy.policy})</h2>", f"<p>{list(self.width)}</p>"]

        def png(self, policy, trace, out):
            return []

    class WidthFigure:
        key = "width"

        def read(self, stages, row):
            return int(stages["plan-width"][0][row]) if "plan-width" in stages else None

        def series(self, steps, n_layers, stage_names):
            return WidthSeries(tuple(s.step for s in steps), tuple(s.stages["width"] for s in steps))

    @polestar.register("refresh", "dual-width")
    class DualWidth(DualRefresh):
        trace_figures = (WidthFigure(),)

        def plan(self, state, cache, local=None):
            plan = super().plan(state, cache, local)
            if state.detail is not None:  # an observer records
                state.detail.entry("plan-width")[0] = plan.valid.sum(dim=1)
            return plan

    model = polestar.load("tiny-llada")
    prompt = get_task("arith").format_prompt("3+4*2-5")
    result = trace(model, prompt, ["fast-dllm"], tmp_path, gen_length=32, block_length=16, png=False,
                   refresh="dual-width")
    width = result.figures[0].stage_figures["width"]
    assert len(width.steps) == result.figures[0].nfe and max(width.width) > min(width.width) > 0
    assert "<h2>Plan width (fast-dllm)</h2>" in (tmp_path / "trace.html").read_text()
    assert json.loads((tmp_path / "trace.json").read_text())["figures"][0]["stage_figures"]["width"]["width"]
    plain = trace(model, prompt, ["fast-dllm"], gen_length=32, block_length=16)
    assert plain.figures[0].stage_figures == {}
