"""The problems a command runs on: the test split of a task, or the records of a ``--data`` JSONL file, checked
before any work (how many one run may hold, and each record against the task's input format)."""

from __future__ import annotations

import json
from pathlib import Path

from polestar.tasks import get_task
from polestar.tasks.base import Problem, check_split_size, split

#: The most problems one bench run generates: every problem and record is held in memory (a larger evaluation
#: is several runs, or ``--data`` files).
MAX_PROBLEMS = 1_000_000


def check_problem_count(task_name: str, n: int) -> None:
    """ValueError, before any problem is generated, for ``n`` above :data:`MAX_PROBLEMS` or above what the task's
    test split can hold distinctly (:func:`~polestar.tasks.base.check_split_size`), naming the limit."""
    if n > MAX_PROBLEMS:
        raise ValueError(f"--n {n:,} is more than one bench run generates ({MAX_PROBLEMS:,}: every problem is held "
                         "in memory); split the evaluation into several runs or pass --data files")
    check_split_size(get_task(task_name), n, "test")


def load_problems(task_name: str, n: int, data: str | None = None, seed: int = 0,
                  show_progress: bool = False) -> list[Problem]:
    """``n`` test problems of ``task_name`` (generated; with ``show_progress`` a progress bar on stderr), or the
    first ``n`` records of a JSONL ``data`` file with ``{"input": ..., "output": ...}`` (Dream's Countdown /
    Sudoku evaluation layout)."""
    if data is None:
        check_problem_count(task_name, n)
        bar = progress_bar(n, show_progress, desc="problems")
        if bar is None:
            return split(get_task(task_name), n, "test", seed)
        with bar:
            return split(get_task(task_name), n, "test", seed, progress=lambda k: bar.update(1))
    path = Path(data)
    if not path.is_file():
        raise FileNotFoundError(f"--data file {data} does not exist")
    from polestar.cli_checks import utf8_lines

    task = get_task(task_name)
    problems = []
    for lineno, line in utf8_lines(path):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{data}:{lineno}: not valid JSON ({err.msg}, column {err.colno}); each line must be one "
                             'object like {"input": "3+4*2", "output": "..."}') from None
        if not isinstance(rec, dict) or "input" not in rec:
            raise ValueError(f"{data}:{lineno}: record has no 'input' field; each line must be one object like "
                             '{"input": "3+4*2", "output": "..."}')
        try:
            task.validate_input(str(rec["input"]))
        except ValueError as err:
            raise ValueError(f"{data}:{lineno}: {err}") from None
        problems.append(Problem(task_name, str(rec["input"]), str(rec.get("output", ""))))
        if len(problems) >= n:
            break
    if not problems:
        raise ValueError(f"{data} holds no records; each line must be one object like "
                         '{"input": "3+4*2", "output": "..."}')
    return problems


def progress_bar(total: int, show: bool, desc: str = "bench"):
    """A tqdm bar over ``total`` problems on stderr; None when not ``show`` or without tqdm (the bench extra)."""
    if not show:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the bench/test extras
        return None
    # the rate since the start, not a moving average: the ETA then reads the decode rate once the caller has
    # restarted the rate after each policy's first batch and moved ``start_t`` past later compiles
    return tqdm(total=total, desc=desc, unit="problem", smoothing=0)
