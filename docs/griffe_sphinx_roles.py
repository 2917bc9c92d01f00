"""Griffe extension for the API page: Sphinx cross-reference roles in docstrings become Markdown.

The docstrings use Sphinx roles (``:class:`~polestar.state.DecodeState```); mkdocstrings renders Markdown, where a
role would show as raw text. Each role becomes inline code of the name as Sphinx would print it (the last
component after ``~``, else the whole path); the objects themselves are linked from their signatures.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|obj|exc|const):`(~?)([^`]+)`")


def convert(text: str) -> str:
    """``:class:`~a.b.C``` → ```C```, ``:func:`a.b``` → ```a.b``` (every Sphinx Python role)."""
    return ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text)


class SphinxRoles(griffe.Extension):
    """Rewrites the roles of every loaded docstring with :func:`convert`."""

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = convert(obj.docstring.value)
