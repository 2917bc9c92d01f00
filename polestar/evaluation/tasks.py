"""lm-eval task definitions over the project's own tasks (``polestar.tasks``), written to a directory.

:func:`write_task_dir` writes, for one task of the suite, the test problems as JSONL and two lm-eval task
YAMLs that read them with the ``json`` dataset builder (no download, nothing from a hub):

* ``polestar_<task>`` (``generate_until``): the prompt is ``task.format_prompt(input)``, exactly what
  ``polestar bench`` decodes, and :func:`process_results` scores the answer with the task's own checker
  (metric ``acc``). The problems are ``split(task, n, "test", seed)``, the ones ``polestar bench --n n`` uses.
* ``polestar_<task>_choice`` (``multiple_choice``): the same prompts, the problem's reference answer among
  ``choices - 1`` reference answers of other problems of the same split (metric ``acc``; runs the model's
  ``loglikelihood``).

Use them with ``polestar lm-eval --include_path DIR --tasks polestar_arith ...``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from polestar.tasks import get_task, split

_UTILS_MODULE = "polestar_task_utils"


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval ``process_results`` of the ``polestar_<task>`` tasks: ``acc`` 1.0 when the task's checker accepts
    the generation ``results[0]`` for ``doc["input"]``."""
    task = get_task(doc["task"])
    return {"acc": float(bool(task.check(doc["input"], results[0])))}


def _dataset_lines(name: str, data: Path) -> list[str]:
    """The YAML lines naming the task and its local JSONL test split."""
    return [
        f"task: {name}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {json.dumps(str(data))}",
        "test_split: test",
    ]


#: zero-shot, scored by the mean of ``acc`` (the closing lines of both task YAMLs)
_ACCURACY_LINES = ("num_fewshot: 0", "metric_list:", "  - metric: acc", "    aggregation: mean",
                   "    higher_is_better: true", "")


def _generate_yaml(name: str, data: Path, max_gen_toks: int) -> str:
    return "\n".join([
        *_dataset_lines(name, data),
        "output_type: generate_until",
        "doc_to_text: prompt",
        "doc_to_target: output",
        f"process_results: !function {_UTILS_MODULE}.process_results",
        "generation_kwargs:",
        '  until: ["<|endoftext|>"]',
        f"  max_gen_toks: {max_gen_toks}",
        "  do_sample: false",
        *_ACCURACY_LINES,
    ])


def _choice_yaml(name: str, data: Path) -> str:
    return "\n".join([
        *_dataset_lines(name, data),
        "output_type: multiple_choice",
        "doc_to_text: prompt",
        "doc_to_choice: choices",
        "doc_to_target: gold",
        'target_delimiter: ""',
        *_ACCURACY_LINES,
    ])


def write_task_dir(directory: str | Path, task: str = "arith", n: int = 16, seed: int = 0, choices: int = 4,
                   max_gen_toks: int = 64) -> dict[str, Path]:
    """Write ``polestar_<task>`` and ``polestar_<task>_choice`` (see the module docstring) into ``directory``.

    ``n`` test problems of ``task`` drawn with ``seed`` (those of ``polestar bench --task task --n n``);
    ``choices`` answers per multiple-choice question (needs ``n >= choices``); ``max_gen_toks`` is the
    generation task's ``max_gen_toks``. The YAMLs name their data file by its absolute path, so lm-eval finds it
    from any working directory. Every argument and the folder are checked before anything is written (a
    ValueError naming the problem); a folder inside the installed package's source folders (``tasks/`` of a
    checkout, which is the package ``polestar.tasks``) is refused: write to a scratch folder.
    Returns ``{task name: YAML path}``.
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if not 2 <= choices <= n:
        raise ValueError(f"choices must be between 2 and n ({n}), got {choices}")
    from polestar.output_files import check_outside_source, check_writable

    spec = get_task(task)
    check_outside_source([directory], "the task folder")
    directory = Path(directory).expanduser().resolve()
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{directory} is a file; name a folder for the task files")
    problems = split(spec, n, "test", seed)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"cannot create the task folder {directory}: {err.strerror or err}") from None
    check_writable([directory / f"polestar_{task}.jsonl"])
    rng = random.Random(f"polestar:lm-eval-choices:{task}:{seed}")
    records = []
    for i, prob in enumerate(problems):
        others = rng.sample([p.output for j, p in enumerate(problems) if j != i and p.output != prob.output],
                            choices - 1)
        gold = rng.randrange(choices)
        options = others[:gold] + [prob.output] + others[gold:]
        records.append({"task": task, "input": prob.input, "output": prob.output,
                        "prompt": spec.format_prompt(prob.input), "choices": options, "gold": gold})
    data = directory / f"polestar_{task}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    (directory / f"{_UTILS_MODULE}.py").write_text(
        '"""Written by polestar.evaluation.tasks.write_task_dir."""\n'
        "from polestar.evaluation.tasks import process_results  # noqa: F401\n")
    paths = {f"polestar_{task}": directory / f"polestar_{task}.yaml",
             f"polestar_{task}_choice": directory / f"polestar_{task}_choice.yaml"}
    paths[f"polestar_{task}"].write_text(_generate_yaml(f"polestar_{task}", data, max_gen_toks))
    paths[f"polestar_{task}_choice"].write_text(_choice_yaml(f"polestar_{task}_choice", data))
    return paths
