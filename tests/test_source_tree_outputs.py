"""Nothing is written into the installed package's source folders: ``write_task_dir`` and every command's output
paths refuse them with one line naming the folder and the fix, and no recipe of the docs writes there."""

import re
import shlex
from pathlib import Path

import pytest

from polestar.cli import main
from polestar.output_files import check_outside_source, check_writable, source_folder_of, source_folders

ROOT = Path(__file__).resolve().parents[1]


def test_the_source_folders_are_the_packages_folders():
    folders = source_folders()
    assert folders[(ROOT / "tasks").resolve()] == "polestar.tasks"
    assert {"polestar", "polestar.policies", "polestar.kernels", "polestar.models", "polestar.tasks",
            "polestar.training"} <= set(folders.values())
    assert source_folder_of(ROOT / "tasks" / "new" / "x.json") == ((ROOT / "tasks").resolve(), "polestar.tasks")
    assert source_folder_of(ROOT / "runs" / "x.json") is None
    assert source_folder_of(ROOT / "docs" / "x.json") is None


def test_write_task_dir_refuses_the_tasks_source_folder(monkeypatch):
    from polestar.evaluation.tasks import write_task_dir

    before = sorted(p.name for p in (ROOT / "tasks").iterdir())
    monkeypatch.chdir(ROOT)  # the docs' old recipe, run from the repository root
    for target in ("tasks", "tasks/lm-eval", ROOT / "polestar" / "out"):
        with pytest.raises(ValueError, match=r"is inside the source folder .* write to a scratch folder") as err:
            write_task_dir(target, "arith", n=4, choices=2)
        assert "\n" not in str(err.value) and str(target) in str(err.value)
    assert sorted(p.name for p in (ROOT / "tasks").iterdir()) == before  # nothing written, no folder made
    assert not (ROOT / "tasks" / "lm-eval").exists() and not (ROOT / "polestar" / "out").exists()


def test_check_writable_refuses_source_folders(tmp_path):
    check_writable([tmp_path / "ok.json"])
    with pytest.raises(ValueError, match="policies"):
        check_writable([ROOT / "policies" / "out.json"])
    with pytest.raises(ValueError, match=r"^--json .*models"):
        check_outside_source([None, ROOT / "models" / "r.json"], "--json")


@pytest.mark.parametrize("argv, flag", [
    (["bench", "--n", "1", "--policies", "fast-dllm", "--json", "tasks/out.json"], "--json"),
    (["bench", "--n", "1", "--policies", "fast-dllm", "--plot", "kernels/out.png"], "--plot"),
    (["anatomy", "--n", "1", "--json", "training/a.json"], "--json"),
    (["trace", "--task", "arith", "--index", "0", "--policies", "fast-dllm", "--out", "polestar/trace"], "--out"),
], ids=["bench-json", "bench-plot", "anatomy-json", "trace-out"])
def test_commands_refuse_outputs_in_source_folders(argv, flag, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {flag} ") and "scratch folder" in err[0], err
    assert not (ROOT / "polestar" / "trace").exists()


def test_lm_eval_output_path_in_a_source_folder_is_refused(monkeypatch, capsys):
    from polestar.evaluation import cli as eval_cli

    monkeypatch.setattr(eval_cli, "_run_harness", lambda argv: pytest.fail("lm-eval ran before the check"))
    monkeypatch.chdir(ROOT)
    args = ["lm-eval", "--model_args", "pretrained=tiny-llada", "--tasks", "polestar_arith"]
    assert main([*args, "--output_path", "tasks/results"]) == 2
    assert "--output_path tasks/results is inside the source folder" in capsys.readouterr().err


#: options of the documented commands that name a file or folder they write
_WRITES = ("--out", "--json", "--plot", "--output_path", "--include_path")


def _documented_outputs() -> list[tuple[str, str]]:
    """``(doc, path)`` of every output path of a command in README.md and docs/*.md (code blocks and inline code),
    and every folder a documented ``write_task_dir(...)`` call writes."""
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        for call in re.findall(r"write_task_dir\(\s*['\"]([^'\"]+)['\"]", text):
            found.append((doc.name, call))
        blocks = re.findall(r"```\w*\n(.*?)```", text, re.S)
        inline = re.findall(r"`([^`\n]+)`", re.sub(r"```\w*\n.*?```", "", text, flags=re.S))
        for line in [*"\n".join(blocks).replace("\\\n", " ").splitlines(), *inline]:
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # an unbalanced quote
                words = line.split()
            for i, word in enumerate(words[:-1]):
                if word in _WRITES and not words[i + 1].startswith("-"):
                    found.append((doc.name, words[i + 1]))
    return found


def test_no_docs_recipe_writes_into_a_source_folder():
    outputs = _documented_outputs()
    assert ("evaluate.md", "runs/lm-eval-tasks") in outputs  # the lm-eval recipe is read
    inside = [(doc, path) for doc, path in outputs
              if not path.startswith(("/", "$", "<")) and source_folder_of(ROOT / path) is not None]
    assert inside == []
