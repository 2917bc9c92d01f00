"""Every example of the docs runs as written: each ``docs/examples/*.py`` (included in docs/policies.md) as a script
(it registers its stage or policy, passes the ``polestar.testing`` checks it names and decodes with it), the
Markdown Python blocks that need no download, and the pytest-plugin command of docs/policies.md (with the reader's
plugin file, and without it: one usage error, nothing of the project's own suite collected)."""

import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from polestar import policy, registry

EXAMPLES = sorted((Path(__file__).parent.parent / "docs" / "examples").glob("*.py"))

#: what each example registers
REGISTERS = {
    "cluster_stride": ("cluster", "stride"), "commit_same_twice": ("commit", "same-twice"),
    "commit_revoke": ("commit", "second-thoughts"),
    "drift_hellinger": ("drift", "hellinger"), "offload_host": ("offload", "host"), "quant_int8": ("quant", "int8"),
    "refresh_lookahead": ("refresh", "lookahead"), "policy_hellinger": ("policy", "polestar-hellinger"),
    "refresh_every_k": ("refresh", "every-k"),
    "kind_confidence": ("confidence", "margin"),
}

#: the stage kind an example declares
DECLARES = {"kind_confidence": "confidence"}


def test_every_stage_kind_has_an_example():
    assert {kind for kind, _ in REGISTERS.values()} == set(registry.KINDS) | {"policy"} | set(DECLARES.values())
    assert sorted(p.stem for p in EXAMPLES) == sorted(REGISTERS)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path, isolated_registry, capsys):
    runpy.run_path(str(path), run_name="__main__")
    kind, name = REGISTERS[path.stem]
    if path.stem in DECLARES:
        assert DECLARES[path.stem] in registry.KINDS
    assert name in (policy.policy_names() if kind == "policy" else registry.names(kind))
    assert capsys.readouterr().out.strip()


def _python_blocks(path: Path) -> list[str]:
    """The ```python blocks of a Markdown file that are code, not snippet includes (``--8<--``)."""
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), re.S)
    return [b for b in blocks if "--8<--" not in b]


ROOT = Path(__file__).parent.parent
#: Markdown code blocks that run as they are on the shipped checkpoints (docs/real-models.md needs a real model)
RUNNABLE = [("README.md", 0), ("docs/trace.md", 0), ("docs/policies.md", 0)]


#: the reader's own plugin file the docs name: the Hellinger example, saved under that name
PLUGIN_FILE = "mydrift.py"


@pytest.mark.parametrize("doc, index", [pytest.param(d, i, marks=[pytest.mark.slow] if d == "docs/trace.md" else [])
                                         for d, i in RUNNABLE], ids=[f"{d}#{i}" for d, i in RUNNABLE])
def test_markdown_python_blocks_run(doc, index, tmp_path, monkeypatch, isolated_registry):
    code = _python_blocks(ROOT / doc)[index]
    monkeypatch.chdir(tmp_path)  # whatever a block writes lands in a temporary folder
    if PLUGIN_FILE in code:  # the block loads the reader's plugin file, as written
        shutil.copy(ROOT / "docs" / "examples" / "drift_hellinger.py", tmp_path / PLUGIN_FILE)
    exec(compile(code, f"{doc} python block {index}", "exec"), {"__name__": "__docs__"})


def _bash_command(doc: str, marker: str) -> list[str]:
    """The one command of ``doc``'s ```bash block that contains ``marker``, as argv (``pytest`` run by this
    Python, so the venv's pytest runs it)."""
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", (ROOT / doc).read_text(), re.S) if marker in b]
    argv = shlex.split(block.strip())
    assert argv[0] == "pytest"
    return [sys.executable, "-m", *argv]


def _run_quietly(argv: list[str], cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not this session's xdist worker
    return subprocess.run([*argv, "-p", "no:cacheprovider"], capture_output=True, text=True, timeout=600, cwd=cwd,
                          env=dict(env, OMP_NUM_THREADS="1"))


@pytest.mark.slow
def test_the_pytest_plugin_command_runs_as_written(tmp_path):
    argv = _bash_command("docs/policies.md", "--polestar-stage")
    shutil.copy(ROOT / "docs" / "examples" / "drift_hellinger.py", tmp_path / PLUGIN_FILE)
    proc = _run_quietly(argv, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"\b5 passed\b", proc.stdout), proc.stdout[-2000:]  # one test per check, all five


@pytest.mark.slow
def test_the_pytest_plugin_command_without_its_file_is_one_error_and_collects_nothing_else(tmp_path):
    argv = _bash_command("docs/policies.md", "--polestar-stage")
    proc = _run_quietly(argv, ROOT)  # from the repository root, where mydrift.py does not exist
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "INTERNALERROR" not in proc.stdout + proc.stderr and "Traceback" not in proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR:")]
    assert errors == ["ERROR: plugin file mydrift.py does not exist"], proc.stderr[-2000:]
    # with the file given by its path, from the root, only the stage's checks run: not the project's own suite
    shutil.copy(ROOT / "docs" / "examples" / "drift_hellinger.py", tmp_path / PLUGIN_FILE)
    argv = [tmp_path / PLUGIN_FILE if a == PLUGIN_FILE else a for a in argv]
    proc = _run_quietly([*map(str, argv), "--polestar-checks", "contract", "--co", "-q"], ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    listed = proc.stdout.split("\n\n")[0].splitlines()  # the collected ids, before the summary line
    assert listed == ["::polestar-stage[drift:hellinger:contract]"], proc.stdout[-2000:]


def test_every_markdown_python_block_is_run_or_needs_a_real_model():
    docs = ["README.md", *(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
    counted = {doc: len(_python_blocks(ROOT / doc)) for doc in docs}
    run = {(d, i) for d, i in RUNNABLE}
    left = [(d, i) for d, n in counted.items() for i in range(n) if (d, i) not in run]
    assert left == [("docs/real-models.md", 0)], left  # loads LLaDA-8B-Instruct from a download


def test_ci_runs_the_readme_test_command_and_the_fast_loop_is_documented():
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    (setup,) = [b for b in blocks if "python -m pytest" in b and "pip install" in b]
    command = setup.strip().split(" && ")[-1]
    assert command.startswith("TRITON_INTERPRET=1 python -m pytest -q -n auto --dist loadfile")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert command in ci  # CI runs exactly the README's command
    (fast,) = [b.strip() for b in blocks if "not slow" in b]
    assert fast == f'{command} -m "not slow"'
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'test = \[[^\]]*"pytest-xdist>=3"', pyproject)  # -n comes with the test extra


WORKED = ROOT / "docs" / "examples" / "refresh_every_k.py"


def test_the_worked_refresh_selector_is_short():
    """The stage itself, its state class and its config: at most 40 lines (the docs' worked example)."""
    lines = WORKED.read_text().split("\n\n\n@attrs.define")[1].split("\nif __name__")[0].splitlines()
    assert 20 < len([line for line in lines if line.strip()]) <= 40


def test_the_worked_refresh_selector_runs_through_every_command(tmp_path, isolated_registry):
    """``--plugin`` brings the selector from outside the package to generate, bench, trace and the stage checks;
    never due it decodes as Fast-dLLM's dual cache, always due as a refresh at every step (tokens and work)."""
    from polestar.cli import main

    plugin = ["--plugin", str(WORKED)]
    common = ["--model", "tiny-llada", "--task", "arith"]
    assert main(["generate", *common, *plugin, "--prompt", "3+4*2-5", "--set", "refresh=every-k"]) == 0
    report = tmp_path / "bench.json"
    assert main(["bench", *common, *plugin, "--policies", "fast-dllm", "--n", "4", "--set", "refresh=every-k",
                 "--json", str(report), "--quiet"]) == 0
    assert report.exists()
    assert main(["trace", *common, *plugin, "--index", "0", "--policies", "fast-dllm", "--set", "refresh=every-k",
                 "--out", str(tmp_path / "trace"), "--no-png"]) == 0
    assert (tmp_path / "trace" / "trace.html").exists()
    from polestar.testing import check_stage

    check_stage("refresh", "every-k", ["contract", "invariants"])

    import polestar
    from polestar.bench.harness import load_problems
    from polestar.tasks import get_task

    model, task = polestar.load("tiny-llada"), get_task("arith")
    prompts = [task.format_prompt(p.input) for p in load_problems("arith", 4)]

    def run(**kw):
        out = polestar.generate(model, prompts, policy="fast-dllm", **kw)
        return out.tokens.tolist(), out.stats.token_layer_evals

    never = {"refresh": "every-k", "refresh.every": 1000, "refresh.burst": 1000}
    assert run(**never) == run()
    assert run(**{"refresh": "every-k", "refresh.every": 1}) == run(**{"refresh.refresh_interval": 1})
