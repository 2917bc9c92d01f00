"""``sudoku``: 4x4 sudoku (digits 1-4, 2x2 boxes) with a unique solution.

Input: 4 lines of 4 digits, ``0`` for a blank (4-8 blanks). Output: the solved grid in the same layout::

    prompt  "sudoku:0423\\n0340\\n4032\\n3010="      (\\n is a real newline)
    answer  "1423\\n2341\\n4132\\n3214"

Puzzles are made by blanking 4-8 random cells of a uniformly drawn valid grid (all 288 are enumerated),
keeping only puzzles with exactly one solution. The checker verifies rows, columns, 2x2 boxes and the givens.
"""

from __future__ import annotations

import functools
import math
import random
import re

import attrs

from .base import Problem, check_input, clean_generation, tagged_prompt

_GRID_RE = re.compile(r"[0-4]{4}(?:\n[0-4]{4}){3}")

Grid = tuple[int, ...]  # 16 cells, row-major


def _units() -> list[tuple[int, ...]]:
    rows = [tuple(4 * r + c for c in range(4)) for r in range(4)]
    cols = [tuple(4 * r + c for r in range(4)) for c in range(4)]
    boxes = [
        tuple(4 * (br + r) + (bc + c) for r in range(2) for c in range(2)) for br in (0, 2) for bc in (0, 2)
    ]
    return rows + cols + boxes


UNITS = _units()


@functools.cache
def all_grids() -> tuple[Grid, ...]:
    """All 288 valid completed 4x4 sudoku grids, in a fixed (lexicographic) order."""
    out: list[Grid] = []
    cells = [0] * 16

    def ok(i: int, v: int) -> bool:
        return all(cells[j] != v for unit in UNITS if i in unit for j in unit if j != i)

    def fill(i: int) -> None:
        if i == 16:
            out.append(tuple(cells))
            return
        for v in range(1, 5):
            if ok(i, v):
                cells[i] = v
                fill(i + 1)
                cells[i] = 0

    fill(0)
    return tuple(out)


def parse_grid(text: str) -> Grid | None:
    """Parse 4 lines of 4 digits (0-4) into a 16-tuple, or None if the layout is wrong."""
    if not _GRID_RE.fullmatch(text):
        return None
    return tuple(int(ch) for ch in text if ch != "\n")


def render_grid(grid: Grid) -> str:
    """Render a 16-cell grid as 4 newline-separated lines of 4 digits."""
    return "\n".join("".join(str(v) for v in grid[4 * r : 4 * r + 4]) for r in range(4))


def is_solved(grid: Grid) -> bool:
    """True iff every row, column and 2x2 box holds the digits 1-4 exactly once."""
    return all(sorted(grid[i] for i in unit) == [1, 2, 3, 4] for unit in UNITS)


@functools.cache
def _cell_masks() -> tuple[tuple[int, ...], ...]:
    """``masks[cell][v]``: bitmask over ``all_grids()`` of the grids with value ``v`` at ``cell``."""
    masks = [[0] * 5 for _ in range(16)]
    for k, grid in enumerate(all_grids()):
        for cell, v in enumerate(grid):
            masks[cell][v] |= 1 << k
    return tuple(tuple(m) for m in masks)


def completions(puzzle: Grid) -> list[Grid]:
    """All valid grids consistent with the givens (non-zero cells) of ``puzzle``."""
    masks = _cell_masks()
    alive = (1 << len(all_grids())) - 1
    for cell, v in enumerate(puzzle):
        if v:
            alive &= masks[cell][v]
    return [g for k, g in enumerate(all_grids()) if alive >> k & 1]


@attrs.frozen
class SudokuTask:
    """4x4 sudoku with ``min_blanks..max_blanks`` blanks and a unique solution."""

    name: str = "sudoku"
    min_blanks: int = 4
    max_blanks: int = 8
    max_input_chars: int = 19
    max_output_chars: int = 19

    def sample(self, rng: random.Random) -> Problem:
        """Draw a random full grid, blank random cells, retry until the solution is unique."""
        grids = all_grids()
        while True:
            solution = rng.choice(grids)
            n_blanks = rng.randint(self.min_blanks, self.max_blanks)
            blanks = set(rng.sample(range(16), n_blanks))
            puzzle = tuple(0 if i in blanks else v for i, v in enumerate(solution))
            if len(completions(puzzle)) == 1:
                return Problem(self.name, render_grid(puzzle), render_grid(solution))

    def input_space(self) -> int:
        """An upper bound on the distinct inputs :meth:`sample` can draw: every solution grid with every set of
        ``min_blanks..max_blanks`` blanks (the unique-solution rule keeps fewer)."""
        return len(all_grids()) * sum(math.comb(16, k) for k in range(self.min_blanks, self.max_blanks + 1))

    def validate_input(self, input: str) -> None:
        """4 newline-separated lines of 4 digits 0-4 (0 = blank); else ValueError."""
        check_input(self.name, input, isinstance(input, str) and parse_grid(input) is not None,
                    "4 lines of 4 digits 0-4 separated by newlines (0 for a blank), e.g. '0423\\n0340\\n4032\\n3010'")

    def format_prompt(self, input: str) -> str:
        """``f"sudoku:{input}="`` (the grid keeps its newlines; ValueError for an input not in the format)."""
        self.validate_input(input)
        return tagged_prompt(self.name, input)

    def check(self, input: str, generation: str) -> bool:
        """True iff the cleaned generation is a solved grid in the 4-line layout that keeps all givens."""
        puzzle = parse_grid(input)
        grid = parse_grid(clean_generation(generation))
        if puzzle is None or grid is None:
            return False
        return is_solved(grid) and all(p == 0 or p == v for p, v in zip(puzzle, grid))
