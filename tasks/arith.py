"""``arith``: running-value arithmetic chains mod 10, answered step by step.

Input: a start digit followed by 3-6 operations ``+``, ``-`` or ``*`` with a digit, e.g. ``"3+4*2-5"``.
Evaluation is strictly left to right and every intermediate result is taken mod 10 (a dependency chain:
each step uses the previous result, like GSM8K).

Reference output: one step per operation, comma separated, each ``prev<op>digit=result``::

    prompt  "arith:3+4*2-5="
    answer  "3+4=7,7*2=4,4-5=9"

The checker only grades the final answer: the text after the last ``=`` must be exactly the true result
digit (so ``"...,=9"`` or a bare ``"9"`` are accepted too); intermediate steps are not checked.
"""

from __future__ import annotations

import random
import re

import attrs

from .base import Problem, check_input, clean_generation, tagged_prompt

_INPUT_RE = re.compile(r"\d(?:[+\-*]\d)+")


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return (a + b) % 10
    if op == "-":
        return (a - b) % 10
    if op == "*":
        return (a * b) % 10
    raise ValueError(f"unknown operator {op!r}")


def steps(input: str) -> list[tuple[int, str, int, int]]:
    """Return the chain of ``(prev, op, digit, result)`` steps for an arith input like ``"3+4*2"``."""
    if not _INPUT_RE.fullmatch(input):
        raise ValueError(f"not an arith input: {input!r}")
    value = int(input[0])
    out = []
    for i in range(1, len(input), 2):
        op, digit = input[i], int(input[i + 1])
        result = _apply(value, op, digit)
        out.append((value, op, digit, result))
        value = result
    return out


def solve(input: str) -> int:
    """The final value (mod 10) of an arith chain."""
    return steps(input)[-1][3]


@attrs.frozen
class ArithTask:
    """Mod-10 arithmetic chains with a step-by-step answer (see module docstring for the format)."""

    name: str = "arith"
    min_ops: int = 3
    max_ops: int = 6
    max_input_chars: int = 13  # 1 + 2 * max_ops
    max_output_chars: int = 35  # 6 * max_ops - 1

    def sample(self, rng: random.Random) -> Problem:
        """Draw a chain with a random start digit and ``min_ops..max_ops`` random operations."""
        n_ops = rng.randint(self.min_ops, self.max_ops)
        parts = [str(rng.randrange(10))]
        for _ in range(n_ops):
            parts.append(rng.choice("+-*"))
            parts.append(str(rng.randrange(10)))
        input = "".join(parts)
        return Problem(self.name, input, self.reference(input))

    def input_space(self) -> int:
        """How many distinct inputs :meth:`sample` can draw: a start digit and ``min_ops..max_ops`` operations
        of 3 operators × 10 digits."""
        return 10 * sum(30**k for k in range(self.min_ops, self.max_ops + 1))

    def reference(self, input: str) -> str:
        """The canonical step-by-step answer, e.g. ``"3+4=7,7*2=4,4-5=9"``."""
        return ",".join(f"{a}{op}{b}={r}" for a, op, b, r in steps(input))

    def validate_input(self, input: str) -> None:
        """A digit followed by one or more ``+``/``-``/``*`` and a digit, e.g. ``3+4*2``; else ValueError."""
        check_input(self.name, input, isinstance(input, str) and bool(_INPUT_RE.fullmatch(input)),
                    "a digit then +, - or * and a digit, repeated, e.g. '3+4*2-5'")

    def format_prompt(self, input: str) -> str:
        """``f"arith:{input}="`` (ValueError for an input not in the format, see :meth:`validate_input`)."""
        self.validate_input(input)
        return tagged_prompt(self.name, input)

    def check(self, input: str, generation: str) -> bool:
        """True iff the text after the last ``=`` of the cleaned generation is the true final digit."""
        answer = clean_generation(generation).rsplit("=", 1)[-1]
        return len(answer) == 1 and answer.isdigit() and int(answer) == solve(input)
