"""Every command of the reproduction blocks of docs/results.md and docs/performance.md runs as written.

The convention these pages follow: each figure's command is a line of a ```bash block, complete (no ``...``, no
placeholders, no optional ``[...]`` parts, no "add --set ..." prose), one of ``polestar <command>``, ``bash
bench/<script>.sh [N]``, ``python bench/<script>.py`` or ``python -m polestar.bench.<module>`` with optional
``VAR=value`` prefixes, and carries its expected run time in a comment on the line or right above it.

The fast test checks the convention and parses every command, and every ``polestar`` / ``python`` command the
bench scripts run (the scripts are run by bash with stand-ins on ``PATH`` that record their arguments), with the
real parsers and the bench's argument checks (policies, ``--set`` options, models, tasks), so a template line or
an option the code no longer takes fails here. The run test (slow for results.md's ~45 commands, ~15 s) runs
every documented command at a tiny size in a scratch copy of the docs folder: ``--n`` and a script's ``N``
become 2, the scripts run one model and one task (their ``MODELS`` / ``TASKS`` variables) and the step-cost
module the narrow model (``POLESTAR_RW_WIDTH=tiny``, one round per row). The commands a script records are
replayed in this process, in order, so the whole page costs seconds, and each must exit 0 and print its table.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("docs/results.md", "docs/performance.md")
#: a run time in a comment: "~25 min", "6 s", "1.5 h", "3 hours"
RUN_TIME = re.compile(r"\b\d+(\.\d+)?\s*(s|min|h|hours?|minutes?|seconds?)\b")
#: what a template line looks like
TEMPLATE = re.compile(r"\.\.\.|…|<[A-Za-z_ -]+>|\[--|\{[^}]*,[^}]*\}|\badd --set\b")
#: the size knobs of the slow run: one model and task per script, two thresholds and one alpha in the frontier
SMALL_SCRIPT_ENV = {"MODELS": "tiny-llada", "TASKS": "arith", "T05_TASKS": "arith", "ANATOMY_TASKS": "arith",
                    "TAUS": "0.5 0.9", "ALPHAS": "3"}
SMALL_N = "2"
#: what each kind of command prints (a line of its table)
TABLE_LINE = {
    "bench": re.compile(r"^policy +accuracy +95% CI", re.M),
    "anatomy": re.compile(r"commit anatomy", re.M),
    "agree": re.compile(r"^policy +n +changed +token mismatch", re.M),
    "sweep_table.py": re.compile(r"^run +accuracy +evals/tok", re.M),
    "frontier_table.py": re.compile(r"^policy +options +accuracy +TPF +evals/tok", re.M),
    "side_by_side_table.py": re.compile(r"^setting +accuracy +pos/fwd +rows/pos", re.M),
    "polestar.bench.real_width": re.compile(r"^\| layers \| dtype \| batch \| policy \|", re.M),
    "render_results.py": None,  # writes the page; checked below
}


@attrs.frozen
class Command:
    doc: str
    line: str  # as written (continuations joined)
    env: tuple[tuple[str, str], ...]
    argv: tuple[str, ...]
    comment: str  # its trailing comment and the comment lines right above it

    @property
    def kind(self) -> str:
        if self.argv[0] == "polestar":
            return self.argv[1]
        if self.argv[0] == "bash":
            return "script"
        return self.argv[2] if self.argv[1] == "-m" else Path(self.argv[1]).name


def bash_blocks(doc: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (ROOT / doc).read_text(), re.S)


def doc_commands(doc: str) -> list[Command]:
    """The commands of ``doc``'s ```bash blocks, in page order."""
    found = []
    for block in bash_blocks(doc):
        above: list[str] = []
        for line in block.replace("\\\n", " ").splitlines():
            if not line.strip():
                above = []
                continue
            if line.lstrip().startswith("#"):
                above.append(line.strip())
                continue
            words = shlex.split(line, comments=True)
            comment = " ".join([*above, line[line.index("#"):] if " #" in line else ""])
            env = []
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                key, value = words.pop(0).split("=", 1)
                env.append((key, value))
            found.append(Command(doc, " ".join(line.split()), tuple(env), tuple(words), comment))
            above = []
    return found


ALL = [c for doc in DOCS for c in doc_commands(doc)]


def test_the_pages_have_reproduction_blocks():
    kinds = {c.kind for c in ALL}
    assert {"script", "bench", "render_results.py", "polestar.bench.real_width"} <= kinds, kinds
    scripts = {c.argv[1] for c in ALL if c.kind == "script"}
    assert {"bench/run_results.sh", "bench/run_agreement.sh", "bench/run_sweep.sh", "bench/run_frontier.sh",
            "bench/run_side_by_side.sh"} <= scripts


@pytest.mark.parametrize("doc", DOCS)
def test_every_line_is_a_complete_command_with_its_run_time(doc):
    for block in bash_blocks(doc):
        assert not TEMPLATE.search(block), f"{doc}: a template in a command block:\n{block}"
    for c in doc_commands(doc):
        assert c.argv[0] in ("polestar", "bash", "python"), f"{doc}: not a runnable command: {c.line}"
        if c.argv[0] == "bash":
            assert re.fullmatch(r"bench/\w+\.sh", c.argv[1]) and (ROOT / c.argv[1]).is_file(), c.line
            assert all(a.isdigit() for a in c.argv[2:]), f"{doc}: a script takes only N: {c.line}"
        if c.argv[0] == "python":
            target = c.argv[2] if c.argv[1] == "-m" else c.argv[1]
            assert c.argv[1] == "-m" and target.startswith("polestar.bench.") or (ROOT / target).is_file(), c.line
        assert RUN_TIME.search(c.comment), f"{doc}: no run time stated for: {c.line}"


# -- recording what the scripts run ------------------------------------------------------------------------------

SHIM = """#!/bin/sh
# records one command: its name, then each argument after a unit separator (\\037), one line per command
{ printf '%s' "$(basename "$0")"; for a in "$@"; do printf '\\037%s' "$a"; done; printf '\\n'; } >> "$DOCS_RECORD"
"""


def _workspace(tmp: Path) -> Path:
    """A scratch folder laid out like the repository root for the commands: ``bench`` (a link to the repository's)
    and a copy of ``docs/results.md`` and ``docs/results``, so that the scripts' and the renderer's default paths
    (``docs/results``, ``runs/...``) land in it."""
    (tmp / "bench").symlink_to(ROOT / "bench")
    (tmp / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "results.md", tmp / "docs" / "results.md")
    shutil.copytree(ROOT / "docs" / "results", tmp / "docs" / "results")
    return tmp


def record_script(command: Command, cwd: Path, n: str | None = None, small: bool = False) -> list[list[str]]:
    """Run ``command`` (a ``bash bench/*.sh`` line) with stand-ins for ``polestar`` and ``python`` that record their
    arguments; returns the recorded commands in order. ``n``: the script's N instead of the documented one;
    ``small``: the :data:`SMALL_SCRIPT_ENV` knobs unless the command sets them."""
    shims = cwd / ".shims"
    shims.mkdir(exist_ok=True)
    for name in ("polestar", "python"):
        (shims / name).write_text(SHIM)
        (shims / name).chmod(0o755)
    record = cwd / ".record"
    record.write_text("")
    env = {k: v for k, v in os.environ.items() if k not in SMALL_SCRIPT_ENV}
    env.update(SMALL_SCRIPT_ENV if small else {})
    env.update(dict(command.env), PATH=f"{shims}{os.pathsep}{env['PATH']}", DOCS_RECORD=str(record))
    argv = list(command.argv) if n is None else [*command.argv[:2], n]
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{command.line}: {proc.stderr[-2000:]}"
    return [line.split("\x1f") for line in record.read_text().splitlines()]


def _check_args(argv: list[str]) -> None:
    """Parse a ``polestar`` command (without ``polestar``) as the CLI does and run bench's argument checks."""
    from polestar.bench.harness import check_problem_args
    from polestar.cli import build_parser, decoding_from_args
    from polestar.cli_checks import parse_sets

    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"polestar {' '.join(argv)}: {err.getvalue().strip()}")
    if args.command in ("bench", "anatomy"):
        check_problem_args(args, parse_sets(args.set), decoding_from_args(args))


def test_every_command_and_every_command_of_the_scripts_parses(tmp_path, monkeypatch):
    monkeypatch.chdir(_workspace(tmp_path))
    for c in ALL:
        recorded = record_script(c, tmp_path) if c.kind == "script" else [list(c.argv)]
        assert recorded, c.line
        for argv in recorded:
            if argv[0] == "polestar":
                _check_args(argv[1:])
            else:
                assert argv[0] == "python" and (argv[1] == "-m" or (tmp_path / argv[1]).is_file()), argv


# -- running them small ------------------------------------------------------------------------------------------


def _small(argv: list[str]) -> list[str]:
    """``--n K`` → ``--n 2`` (added to bench / anatomy when absent: their defaults are 200 and 100)."""
    argv = list(argv)
    if "--n" in argv:
        argv[argv.index("--n") + 1] = SMALL_N
    elif argv[:2] in (["polestar", "bench"], ["polestar", "anatomy"]):
        argv += ["--n", SMALL_N]
    return argv


def _kind(argv: list[str]) -> str:
    return argv[1] if argv[0] == "polestar" else argv[2] if argv[1] == "-m" else Path(argv[1]).name


def run_here(argv: list[str], monkeypatch) -> str:
    """Run one ``polestar`` / ``python`` command in this process; returns its stdout (fails on a non-zero exit)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), monkeypatch.context() as m:
        if argv[0] == "polestar":
            from polestar.cli import main

            code = main(argv[1:])
        else:
            m.setattr(sys, "argv", [argv[2] if argv[1] == "-m" else argv[1], *argv[(3 if argv[1] == "-m" else 2):]])
            try:
                if argv[1] == "-m":  # the module's main, as its ``__main__`` block calls it (runpy cannot run a module
                    # that pytest's assertion rewriting imported)
                    code = importlib.import_module(argv[2]).main(argv[3:]) or 0
                else:
                    runpy.run_path(argv[1], run_name="__main__")
                    code = 0
            except SystemExit as done:
                code = done.code or 0
    assert code == 0, f"{' '.join(argv)} exited {code}\n{out.getvalue()[-2000:]}"
    return out.getvalue()


@pytest.mark.parametrize("doc", [pytest.param(d, marks=[pytest.mark.slow] if d == "docs/results.md" else [])
                                 for d in DOCS])  # results.md: ~45 commands, ~17 s; performance.md ~4 s
def test_every_command_runs_small_and_prints_its_table(doc, tmp_path, monkeypatch):
    monkeypatch.chdir(_workspace(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for c in doc_commands(doc):
        if c.kind == "script":
            n = SMALL_N if len(c.argv) > 2 else None
            steps = [_small(argv) for argv in record_script(c, tmp_path, n=n, small=True)]
        else:
            steps = [_small(list(c.argv))]
        with monkeypatch.context() as m:
            for key, value in c.env:
                m.setenv(key, value)
            if c.kind == "polestar.bench.real_width":  # the narrow model, one round per row
                m.setenv("POLESTAR_RW_WIDTH", "tiny")
                m.setenv("POLESTAR_RW_DEVICE", "cpu")
                m.setenv("POLESTAR_RW_ROUNDS", "1")
            for argv in steps:
                printed = run_here(argv, monkeypatch)
                want = TABLE_LINE.get(_kind(argv))
                if want is not None:
                    assert want.search(printed), f"{c.line}: {' '.join(argv)} printed no table:\n{printed[-1500:]}"
                if _kind(argv) == "render_results.py":
                    page = (tmp_path / "docs" / "results.md").read_text()
                    assert page.startswith("# Results") and "<!-- notes:" in page
