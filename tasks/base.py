"""Shared interface of the synthetic task suite: problems, the task protocol, answer cleaning, splits.

Every task is a seeded generator of :class:`Problem` instances plus an exact checker. Prompts are built by
``task.format_prompt(input)`` and are identical in training and evaluation; the model's answer starts right
after the prompt and ends with the EOS token ``<|endoftext|>``.

Train/test membership is decided by a stable hash (MD5) of the *prompt* string, so an input that belongs to
the test split can never be produced for training, whatever the seed. Hashing the prompt (rather than the
raw input) keeps the splits consistent between the ``parallel`` mixture and its stand-alone sub-tasks,
because both render the same prompt for the same problem (e.g. ``"reverse:abcd="``).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator
from typing import Literal, Protocol, runtime_checkable

import attrs

#: Strings that end an answer. A generation is cut at the first occurrence of any of them. They are the
#: EOS/pad token and the mask token as they appear when ids are decoded with ``skip_special_tokens=False``.
EOS_MARKERS: tuple[str, ...] = ("<|endoftext|>", "<|mdm_mask|>")

#: Split rule: an input is in the test split iff ``md5(prompt) % TEST_MODULUS == 0``.
TEST_MODULUS = 10

#: Longest input and output any task may produce (the model generates 64 answer tokens).
MAX_INPUT_CHARS = 40
MAX_OUTPUT_CHARS = 60

SplitName = Literal["train", "test"]


@attrs.frozen
class Problem:
    """One task instance.

    Attributes:
        task: name of the task that produced it (as accepted by ``get_task``).
        input: the problem statement (without the task tag; see ``Task.format_prompt``).
        output: one reference answer; other answers may also be accepted by the checker.
    """

    task: str
    input: str
    output: str


@runtime_checkable
class Task(Protocol):
    """A seeded problem generator with an exact checker.

    Attributes:
        name: registry name of the task.
        max_input_chars: upper bound on ``len(problem.input)``.
        max_output_chars: upper bound on ``len(problem.output)`` (the reference answer).

    A task may also define ``input_space() -> int``, how many distinct inputs ``sample`` can draw (an upper
    bound); :func:`split` then refuses a count beyond it before drawing anything.
    """

    name: str
    max_input_chars: int
    max_output_chars: int

    def sample(self, rng: random.Random) -> Problem:
        """Draw one problem using only ``rng`` for randomness (deterministic given the rng state)."""
        ...

    def validate_input(self, input: str) -> None:
        """Raise ValueError naming the expected format (with an example) if ``input`` is not one of this task's
        inputs; :meth:`format_prompt` calls it."""
        ...

    def format_prompt(self, input: str) -> str:
        """Return the prompt text given to the model; the same layout is used for training and evaluation.
        Raises ValueError (see :meth:`validate_input`) for an input not in the task's format."""
        ...

    def check(self, input: str, generation: str) -> bool:
        """Return True iff the decoded ``generation`` is a correct answer to ``input``.

        ``generation`` may carry trailing junk after an EOS marker (see :func:`clean_generation`).
        """
        ...


def clean_generation(generation: str) -> str:
    """Cut ``generation`` at the first EOS marker (:data:`EOS_MARKERS`) and strip surrounding whitespace."""
    cut = len(generation)
    for marker in EOS_MARKERS:
        pos = generation.find(marker)
        if pos != -1:
            cut = min(cut, pos)
    return generation[:cut].strip()


#: Every prompt is right-padded with spaces to this many characters, so the answer always starts at the same
#: position (the tiny models learn much faster when the answer region does not move).
PROMPT_WIDTH = 32


def tagged_prompt(tag: str, input: str) -> str:
    """The suite's common prompt layout: ``f"{tag}:{input}="``, right-padded with spaces to :data:`PROMPT_WIDTH`.

    Both the input and the answer then start at fixed positions (the input at ``len(tag) + 1``, the answer at
    :data:`PROMPT_WIDTH`), so a token's relation to the input characters it depends on is a fixed offset.

    Prompts longer than :data:`PROMPT_WIDTH` (none of the registered tasks produces one) are left as they are.
    """
    return f"{tag}:{input}=".ljust(PROMPT_WIDTH)


def check_input(tag: str, input: str, ok: bool, expected: str) -> None:
    """Raise ValueError unless ``ok`` and ``input``'s tagged prompt fits in :data:`PROMPT_WIDTH` characters.

    ``expected`` describes the task's input format with an example; the message names the task and the input.
    """
    if not isinstance(input, str):
        raise ValueError(f"{tag} input must be a string, got {type(input).__name__}")
    if not ok:
        raise ValueError(f"not an input of the {tag} task: {input!r}; expected {expected}")
    width = len(f"{tag}:{input}=")
    if width > PROMPT_WIDTH:
        raise ValueError(f"{tag} input {input!r} is too long: its prompt takes {width} characters, the task's "
                         f"layout has {PROMPT_WIDTH}; shorten it to {PROMPT_WIDTH - len(tag) - 2} characters")


def _hash_int(text: str) -> int:
    return int(hashlib.md5(text.encode("utf-8")).hexdigest(), 16)


def is_test_input(task: Task, input: str) -> bool:
    """True iff ``input`` of ``task`` belongs to the test split (``md5(prompt) % 10 == 0``)."""
    return _hash_int(task.format_prompt(input)) % TEST_MODULUS == 0


def _check_split_name(split: str) -> None:
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")


def iter_split(task: Task, split: SplitName, seed: int) -> Iterator[Problem]:
    """Endless stream of problems of one split (duplicates possible), deterministic given ``seed``.

    Useful for on-the-fly training data; :func:`split` returns a fixed, de-duplicated list.
    """
    _check_split_name(split)
    want_test = split == "test"
    rng = random.Random(f"polestar:{task.name}:{split}:{seed}")
    while True:
        problem = task.sample(rng)
        if is_test_input(task, problem.input) == want_test:
            yield problem


def max_distinct(task: Task, split: SplitName) -> int | None:
    """An upper bound on the distinct inputs of ``split``: the task's ``input_space()`` (the distinct inputs its
    sampler can draw) shared out by the hash split (one in :data:`TEST_MODULUS` to the test split), rounded up;
    None for a task that does not state its input space."""
    space = getattr(task, "input_space", None)
    if space is None:
        return None
    total = space()
    share = -(-total // TEST_MODULUS)
    return share if split == "test" else total - total // TEST_MODULUS


def check_split_size(task: Task, n: int, split: SplitName) -> None:
    """ValueError, before any problem is drawn, when ``n`` exceeds :func:`max_distinct` (naming the limit)."""
    limit = max_distinct(task, split)
    if limit is not None and n > limit:
        raise ValueError(f"task {task.name!r} can generate at most {limit:,} distinct {split} problems "
                         f"(about one in {TEST_MODULUS} of the {task.input_space():,} inputs it can draw); "
                         f"asked for {n:,}")


def split(task: Task, n: int, split: SplitName, seed: int,
          progress: Callable[[int], None] | None = None) -> list[Problem]:
    """Return ``n`` distinct problems (distinct inputs) from the ``"train"`` or ``"test"`` split.

    Deterministic given ``(task.name, split, seed)``; no test input ever appears in a train list.
    Raises ValueError up front when ``n`` exceeds what the split can hold (:func:`check_split_size`), and when
    the split cannot supply ``n`` distinct inputs within a generous number of draws. ``progress(k)`` is called
    with each new problem's count ``k`` (for a progress display).
    """
    _check_split_name(split)
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    check_split_size(task, n, split)
    out: list[Problem] = []
    seen: set[str] = set()
    want_test = split == "test"
    rng = random.Random(f"polestar:{task.name}:{split}:{seed}")
    budget = 200 * n + 1000
    for _ in range(budget):
        if len(out) >= n:
            break
        problem = task.sample(rng)
        if problem.input in seen or is_test_input(task, problem.input) != want_test:
            continue
        seen.add(problem.input)
        out.append(problem)
        if progress is not None:
            progress(len(out))
    if len(out) < n:
        raise ValueError(f"task {task.name!r}: only {len(out)} distinct {split} inputs found, wanted {n}")
    return out
