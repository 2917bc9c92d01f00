"""ParallelBench-style tasks whose output tokens constrain each other.

Stand-alone sub-tasks (input -> reference output, prompt ``f"{name}:{input}="``):

* ``copy``:    ``"k3q9"``    -> ``"k3q9"``     (prompt ``"copy:k3q9="``)
* ``reverse``: ``"abcd"``    -> ``"dcba"``     (prompt ``"reverse:abcd="``)
* ``sort``:    ``"dbca"``    -> ``"abcd"``     (prompt ``"sort:dbca="``; characters sorted by code point)
* ``pick``:    ``"cat|dog"`` -> ``"cat"``      (prompt ``"pick:cat|dog="``; either word is right, a
  character mixture such as ``"cag"`` is wrong -- the two words differ at every position)

Strings for copy/reverse/sort have 4-8 characters drawn (with repetition) from the lowercase letters, the
digits, or both (alphabet chosen per problem). Pick words are 3-6 random lowercase letters.

``parallel`` is the uniform mixture of the four: its input carries the sub-task name as a prefix
(``"reverse:abcd"``) and its prompt is exactly the sub-task's prompt (``"reverse:abcd="``), so a model trained
on the mixture can be evaluated on any sub-task (and train/test splits agree, as they hash the prompt).
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable

import attrs

from .base import Problem, check_input, clean_generation, tagged_prompt

_STRING_RE = re.compile(r"[a-z0-9]+")
_PICK_RE = re.compile(r"([a-z]+)\|([a-z]+)")
_ALPHABETS = (string.ascii_lowercase, string.digits, string.ascii_lowercase + string.digits)


def _random_string(rng: random.Random, min_len: int, max_len: int) -> str:
    alphabet = rng.choice(_ALPHABETS)
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len)))


@attrs.frozen
class StringMapTask:
    """A deterministic string transformation (copy, reverse, sort) of a 4-8 character string."""

    name: str
    transform: Callable[[str], str]
    min_len: int = 4
    max_len: int = 8
    max_input_chars: int = 8
    max_output_chars: int = 8

    def sample(self, rng: random.Random) -> Problem:
        """Draw a random string and apply the transformation."""
        input = _random_string(rng, self.min_len, self.max_len)
        return Problem(self.name, input, self.transform(input))

    def input_space(self) -> int:
        """An upper bound on the distinct inputs :meth:`sample` can draw: strings of ``min_len..max_len``
        characters over each alphabet."""
        return sum(len(a) ** n for a in _ALPHABETS for n in range(self.min_len, self.max_len + 1))

    def validate_input(self, input: str) -> None:
        """Lowercase letters and digits only, e.g. ``k3q9``; else ValueError."""
        ok = isinstance(input, str) and bool(_STRING_RE.fullmatch(input))
        check_input(self.name, input, ok, "lowercase letters a-z and digits 0-9 only, e.g. 'k3q9'")

    def format_prompt(self, input: str) -> str:
        """``f"{name}:{input}="`` (ValueError for an input not in the format, see :meth:`validate_input`)."""
        self.validate_input(input)
        return tagged_prompt(self.name, input)

    def check(self, input: str, generation: str) -> bool:
        """Exact match of the cleaned generation with the transformed input."""
        return clean_generation(generation) == self.transform(input)


def _copy(s: str) -> str:
    return s


def _reverse(s: str) -> str:
    return s[::-1]


def _sort(s: str) -> str:
    return "".join(sorted(s))


@attrs.frozen
class PickTask:
    """Given ``"w1|w2"`` (equal length, different at every position) answer exactly one of the words."""

    name: str = "pick"
    min_len: int = 3
    max_len: int = 6
    max_input_chars: int = 13
    max_output_chars: int = 6

    def sample(self, rng: random.Random) -> Problem:
        """Draw two random lowercase words of equal length that differ at every position."""
        n = rng.randint(self.min_len, self.max_len)
        first = "".join(rng.choice(string.ascii_lowercase) for _ in range(n))
        second = "".join(rng.choice(string.ascii_lowercase.replace(ch, "")) for ch in first)
        return Problem(self.name, f"{first}|{second}", rng.choice((first, second)))

    def input_space(self) -> int:
        """How many distinct inputs :meth:`sample` can draw: a word of ``min_len..max_len`` letters and a second
        one differing at every position."""
        return sum(26**n * 25**n for n in range(self.min_len, self.max_len + 1))

    def validate_input(self, input: str) -> None:
        """Two lowercase words of equal length joined by ``|``, e.g. ``cat|dog``; else ValueError."""
        m = _PICK_RE.fullmatch(input) if isinstance(input, str) else None
        ok = m is not None and len(m.group(1)) == len(m.group(2))
        check_input(self.name, input, ok, "two lowercase words of the same length joined by '|', e.g. 'cat|dog'")

    def format_prompt(self, input: str) -> str:
        """``f"pick:{input}="`` (ValueError for an input not in the format, see :meth:`validate_input`)."""
        self.validate_input(input)
        return tagged_prompt(self.name, input)

    def check(self, input: str, generation: str) -> bool:
        """True iff the cleaned generation equals one of the two words exactly."""
        return clean_generation(generation) in input.split("|")


def sub_tasks() -> dict[str, StringMapTask | PickTask]:
    """The four stand-alone ParallelBench-style sub-tasks, by name."""
    return {
        "copy": StringMapTask("copy", _copy),
        "reverse": StringMapTask("reverse", _reverse),
        "sort": StringMapTask("sort", _sort),
        "pick": PickTask(),
    }


@attrs.frozen
class ParallelMixtureTask:
    """Uniform mixture of copy/reverse/sort/pick; input ``f"{sub}:{sub_input}"``, dispatch on the prefix."""

    name: str = "parallel"
    subs: dict[str, StringMapTask | PickTask] = attrs.field(factory=sub_tasks, eq=False, repr=False)
    max_input_chars: int = attrs.field(
        init=False,
        default=attrs.Factory(
            lambda self: max(len(k) + 1 + t.max_input_chars for k, t in self.subs.items()), takes_self=True
        ),
    )
    max_output_chars: int = attrs.field(
        init=False,
        default=attrs.Factory(
            lambda self: max(t.max_output_chars for t in self.subs.values()), takes_self=True
        ),
    )

    def _split_input(self, input: str) -> tuple[StringMapTask | PickTask, str]:
        prefix, sep, rest = input.partition(":") if isinstance(input, str) else ("", "", "")
        if not sep or prefix not in self.subs:
            raise ValueError(
                f"parallel input must start with one of {sorted(self.subs)} + ':', got {input!r}"
            )
        return self.subs[prefix], rest

    def sample(self, rng: random.Random) -> Problem:
        """Pick a sub-task uniformly, sample it, and prefix its input with the sub-task name."""
        sub_name = rng.choice(sorted(self.subs))
        problem = self.subs[sub_name].sample(rng)
        return Problem(self.name, f"{sub_name}:{problem.input}", problem.output)

    def input_space(self) -> int:
        """The sub-tasks' input spaces together (each input carries its sub-task's name)."""
        return sum(t.input_space() for t in self.subs.values())

    def validate_input(self, input: str) -> None:
        """A sub-task name, ``:``, and that sub-task's input (``reverse:abcd``); else ValueError."""
        sub, rest = self._split_input(input)
        sub.validate_input(rest)

    def format_prompt(self, input: str) -> str:
        """The sub-task's own prompt, i.e. ``f"{input}="`` (e.g. ``"reverse:abcd="``)."""
        sub, rest = self._split_input(input)
        return sub.format_prompt(rest)

    def check(self, input: str, generation: str) -> bool:
        """Dispatch to the sub-task's checker named by the input prefix."""
        sub, rest = self._split_input(input)
        return sub.check(rest, generation)
