"""Every example of the docs (``docs/examples/*.py``, included in docs/policies.md) runs as a script: it registers
its stage or policy, passes the ``polestar.testing`` checks it names and decodes with it."""

import re
import runpy
from pathlib import Path

import pytest

from polestar import policy, registry

EXAMPLES = sorted((Path(__file__).parent.parent / "docs" / "examples").glob("*.py"))

#: what each example registers
REGISTERS = {
    "cluster_stride": ("cluster", "stride"), "commit_same_twice": ("commit", "same-twice"),
    "drift_hellinger": ("drift", "hellinger"), "offload_host": ("offload", "host"), "quant_int8": ("quant", "int8"),
    "refresh_lookahead": ("refresh", "lookahead"), "policy_hellinger": ("policy", "polestar-hellinger"),
}


def test_every_stage_kind_has_an_example():
    assert {kind for kind, _ in REGISTERS.values()} == set(registry.KINDS) | {"policy"}
    assert sorted(p.stem for p in EXAMPLES) == sorted(REGISTERS)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path, isolated_registry, capsys):
    runpy.run_path(str(path), run_name="__main__")
    kind, name = REGISTERS[path.stem]
    assert name in (policy.policy_names() if kind == "policy" else registry.names(kind))
    assert capsys.readouterr().out.strip()


def _python_blocks(path: Path) -> list[str]:
    """The ```python blocks of a Markdown file that are code, not snippet includes (``--8<--``)."""
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), re.S)
    return [b for b in blocks if "--8<--" not in b]


ROOT = Path(__file__).parent.parent
#: Markdown code blocks that run as they are on the shipped checkpoints (docs/real-models.md needs a real model)
RUNNABLE = [("README.md", 0), ("docs/trace.md", 0), ("docs/policies.md", 0)]


@pytest.mark.parametrize("doc, index", RUNNABLE, ids=[f"{d}#{i}" for d, i in RUNNABLE])
def test_markdown_python_blocks_run(doc, index, tmp_path, monkeypatch, isolated_registry):
    code = _python_blocks(ROOT / doc)[index]
    monkeypatch.chdir(tmp_path)  # whatever a block writes lands in a temporary folder
    if "hellinger" in code:  # the block checks the stage registered by the Hellinger example
        runpy.run_path(str(ROOT / "docs" / "examples" / "drift_hellinger.py"), run_name="example")
    exec(compile(code, f"{doc} python block {index}", "exec"), {"__name__": "__docs__"})


def test_every_markdown_python_block_is_run_or_needs_a_real_model():
    docs = ["README.md", *(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
    counted = {doc: len(_python_blocks(ROOT / doc)) for doc in docs}
    run = {(d, i) for d, i in RUNNABLE}
    left = [(d, i) for d, n in counted.items() for i in range(n) if (d, i) not in run]
    assert left == [("docs/real-models.md", 0)], left  # loads LLaDA-8B-Instruct from a download
