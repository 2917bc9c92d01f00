"""Synthetic task suite for training and evaluating tiny diffusion LMs.

Registered tasks (see each module for the exact formats): ``arith``, ``countdown`` (3 sources),
``countdown4`` (4 sources), ``sudoku`` (4x4), ``copy``, ``reverse``, ``sort``, ``pick`` and ``parallel``
(uniform mixture of the last four). Every prompt is ``task.format_prompt(input)`` = ``f"{tag}:{input}="``
right-padded with spaces to ``PROMPT_WIDTH`` (32).

Example::

    from polestar.tasks import get_task, split
    task = get_task("countdown")
    train = split(task, 1000, "train", seed=0)
    ok = task.check(train[0].input, train[0].output)
"""

from __future__ import annotations

from collections.abc import Callable

from .arith import ArithTask
from .base import (
    EOS_MARKERS,
    MAX_INPUT_CHARS,
    MAX_OUTPUT_CHARS,
    Problem,
    Task,
    clean_generation,
    is_test_input,
    iter_split,
    split,
)
from .countdown import CountdownTask
from .parallel import ParallelMixtureTask, PickTask, StringMapTask, sub_tasks
from .sudoku import SudokuTask

_REGISTRY: dict[str, Callable[[], Task]] = {
    "arith": ArithTask,
    "countdown": lambda: CountdownTask(name="countdown", n_sources=3),
    "countdown4": lambda: CountdownTask(name="countdown4", n_sources=4),
    "sudoku": SudokuTask,
    **{name: (lambda t=t: t) for name, t in sub_tasks().items()},
    "parallel": ParallelMixtureTask,
}


def task_names() -> list[str]:
    """Names of all registered tasks, in registration order."""
    return list(_REGISTRY)


def get_task(name: str) -> Task:
    """Return the task registered under ``name``; raise ValueError listing the registered names otherwise."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; registered tasks: {', '.join(_REGISTRY)}") from None
    return factory()


__all__ = [
    "EOS_MARKERS",
    "MAX_INPUT_CHARS",
    "MAX_OUTPUT_CHARS",
    "ArithTask",
    "CountdownTask",
    "ParallelMixtureTask",
    "PickTask",
    "Problem",
    "StringMapTask",
    "SudokuTask",
    "Task",
    "clean_generation",
    "get_task",
    "is_test_input",
    "iter_split",
    "split",
    "sub_tasks",
    "task_names",
]
