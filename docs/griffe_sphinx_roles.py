"""Griffe extension for the API page: Sphinx cross-reference roles in docstrings become Markdown.

The docstrings use Sphinx roles (``:class:`~polestar.state.DecodeState```); mkdocstrings renders Markdown, where a
role would show as raw text. Each role becomes inline code of the name as Sphinx would print it (the last
component after ``~``, else the whole path), linked to the object's entry when the API page shows it: an optional
cross-reference of mkdocs-autorefs, which stays plain code (no warning) for an object the page does not show.
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|obj|exc|const):`(~?)([^`]+)`")


def _link(match: re.Match) -> str:
    short, path = match.group(1), match.group(2)
    title = html.escape(path.rsplit(".", 1)[-1] if short else path)
    return f'<autoref identifier="{html.escape(path)}" optional><code>{title}</code></autoref>'


def convert(text: str) -> str:
    """``:class:`~a.b.C``` → ``C`` as code linked to ``a.b.C``, ``:func:`a.b``` → ``a.b`` linked to ``a.b``
    (every Sphinx Python role)."""
    return ROLE.sub(_link, text)


class SphinxRoles(griffe.Extension):
    """Rewrites the roles of every loaded docstring with :func:`convert`."""

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = convert(obj.docstring.value)
