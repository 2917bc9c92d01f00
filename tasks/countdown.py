"""``countdown`` / ``countdown4``: reach a target from 3 or 4 source numbers with + - * /.

Input: the source numbers (1-20) and, last, the target, comma separated, e.g. ``"3,5,2,16"``.
Output: comma-separated equations ``a<op>b=c``; operands are source numbers or earlier results, each source
(and each result) used at most once; the last result must equal the target::

    prompt  "countdown:3,5,2,16="
    answer  "3+5=8,8*2=16"

Generated problems are solvable by combining all sources with every intermediate result in 1..99, and the
target never equals a source. The checker accepts any valid solution (it need not use every source).
"""

from __future__ import annotations

import random
import re
from collections import Counter

import attrs

from .base import Problem, check_input, clean_generation, tagged_prompt

_EQ_RE = re.compile(r"(\d{1,4})([+\-*/])(\d{1,4})=(\d{1,5})")
_INPUT_RE = re.compile(r"\d{1,3}(?:,\d{1,3})+")


def parse_input(input: str) -> tuple[list[int], int]:
    """Split a countdown input ``"a,b,c,target"`` into ``([a, b, c], target)``."""
    if not _INPUT_RE.fullmatch(input):
        raise ValueError(f"not an input of the countdown task: {input!r}")
    nums = [int(x) for x in input.split(",")]
    return nums[:-1], nums[-1]


def _eval(a: int, op: str, b: int) -> int | None:
    """Result of ``a op b`` over the non-negative integers, or None if not allowed (inexact division)."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "/":
        if b == 0 or a % b:
            return None
        return a // b
    return None


def verify(sources: list[int], target: int, answer: str) -> bool:
    """True iff ``answer`` (comma-separated equations, already cleaned) reaches ``target`` from ``sources``."""
    if not answer:
        return False
    pool = Counter(sources)
    result = None
    for eq in answer.split(","):
        m = _EQ_RE.fullmatch(eq)
        if m is None:
            return False
        a, op, b, c = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
        if _eval(a, op, b) != c:
            return False
        pool[a] -= 1
        pool[b] -= 1
        if pool[a] < 0 or pool[b] < 0:
            return False
        pool[c] += 1
        result = c
    return result == target


def _candidates(a: int, b: int, max_value: int) -> list[str]:
    """Equations combining ``a`` and ``b`` (either order) whose result lies in 1..max_value."""
    out = []
    for x, y in ((a, b), (b, a)):
        for op in "+-*/":
            if op in "+*" and x > y:
                continue  # commutative: one order is enough
            r = _eval(x, op, y)
            if r is not None and 1 <= r <= max_value:
                out.append(f"{x}{op}{y}={r}")
    return out


def solutions(sources: list[int], target: int, limit: int = 100, max_value: int = 99) -> list[str]:
    """Enumerate up to ``limit`` valid answers (intermediate results in 1..max_value), by depth-first search."""
    found: list[str] = []

    def dfs(pool: list[int], eqs: list[str]) -> None:
        if len(found) >= limit:
            return
        for i in range(len(pool)):
            for j in range(i + 1, len(pool)):
                rest = pool[:i] + pool[i + 1 : j] + pool[j + 1 :]
                for eq in _candidates(pool[i], pool[j], max_value):
                    r = int(eq.rsplit("=", 1)[1])
                    if r == target:
                        found.append(",".join([*eqs, eq]))
                        if len(found) >= limit:
                            return
                    dfs([*rest, r], [*eqs, eq])

    dfs(list(sources), [])
    return found


@attrs.frozen
class CountdownTask:
    """Countdown with ``n_sources`` numbers in ``1..max_source`` and intermediate results ≤ ``max_value``."""

    name: str = "countdown"
    n_sources: int = 3
    max_source: int = 20
    max_value: int = 99
    # training answers combine the first two sources first whenever such a solution exists (a fixed order turns
    # "which pair first" into "which operations"; docs/log.md, countdown third attempt). Inputs are unchanged.
    canonical: bool = False
    # Both bounds assume max_source <= 99 and max_value <= 99 (two-digit numbers).
    max_input_chars: int = attrs.field(
        init=False, default=attrs.Factory(lambda self: 3 * self.n_sources + 2, takes_self=True)
    )  # n sources "dd," + target "dd"
    max_output_chars: int = attrs.field(
        init=False, default=attrs.Factory(lambda self: 9 * self.n_sources - 10, takes_self=True)
    )  # n - 1 equations "dd-dd=dd" joined by commas

    def sample(self, rng: random.Random) -> Problem:
        """Draw sources, combine them all in a random order with random valid ops, use the result as target."""
        while True:
            sources = [rng.randint(1, self.max_source) for _ in range(self.n_sources)]
            pool = list(sources)
            eqs = []
            while len(pool) > 1:
                i, j = rng.sample(range(len(pool)), 2)
                a, b = pool[i], pool[j]
                eq = rng.choice(_candidates(a, b, self.max_value))
                if rng.random() < 0.5:
                    eq = _swap_commutative(eq)
                pool = [x for k, x in enumerate(pool) if k not in (i, j)]
                pool.append(int(eq.rsplit("=", 1)[1]))
                eqs.append(eq)
            target = pool[0]
            if target in sources:
                continue
            input = ",".join(map(str, [*sources, target]))
            answer = ",".join(eqs)
            if self.canonical:
                answer = _first_pair_solution(sources, target, self.max_value) or answer
            return Problem(self.name, input, answer)

    def input_space(self) -> int:
        """An upper bound on the distinct inputs :meth:`sample` can draw: ``n_sources`` numbers in
        ``1..max_source`` and a target in ``1..max_value``."""
        return self.max_source**self.n_sources * self.max_value

    def validate_input(self, input: str) -> None:
        """``n_sources`` comma-separated numbers then the target, e.g. ``3,5,2,16``; else ValueError."""
        ok = isinstance(input, str) and bool(_INPUT_RE.fullmatch(input)) and input.count(",") == self.n_sources
        example = ",".join(["3", "5", "2", "7"][: self.n_sources] + ["16"])
        check_input(self.name, input, ok,
                    f"{self.n_sources} comma-separated source numbers then the target, e.g. '{example}'")

    def format_prompt(self, input: str) -> str:
        """``f"{name}:{input}="``, e.g. ``"countdown:3,5,2,16="`` (ValueError for an input not in the format)."""
        self.validate_input(input)
        return tagged_prompt(self.name, input)

    def check(self, input: str, generation: str) -> bool:
        """True iff the cleaned generation is a valid equation chain ending at the target (any solution)."""
        sources, target = parse_input(input)
        return verify(sources, target, clean_generation(generation))


def _swap_commutative(eq: str) -> str:
    """``"a+b=c"`` -> ``"b+a=c"`` (same for ``*``); other equations are returned unchanged."""
    m = _EQ_RE.fullmatch(eq)
    if m is None or m.group(2) not in "+*":
        return eq
    return f"{m.group(3)}{m.group(2)}{m.group(1)}={m.group(4)}"


def _first_pair_solution(sources: list[int], target: int, max_value: int) -> str | None:
    """The first solution (depth-first order) whose first equation combines ``sources[0]`` and ``sources[1]`` and
    that uses every source, or None."""
    for sol in solutions(sources, target, limit=200, max_value=max_value):
        eqs = sol.split(",")
        m = _EQ_RE.fullmatch(eqs[0])
        if len(eqs) == len(sources) - 1 and sorted((int(m.group(1)), int(m.group(3)))) == sorted(sources[:2]):
            return sol
    return None
