"""Make a checkout importable without installing it: ``python source_tree.py CHECKOUT DEST``.

The package maps folders of the checkout to subpackages (``pyproject.toml``, ``[tool.setuptools] package-dir``:
``policies/`` is ``polestar.policies``, ``kernels/`` is ``polestar.kernels`` ...), so putting the checkout on
``PYTHONPATH`` does not work. This writes, under ``DEST``, a package tree of symbolic links laid out as the installed
package is (``DEST/polestar/policies`` -> ``CHECKOUT/policies``); with ``DEST`` on ``PYTHONPATH`` ``import polestar``
runs the checkout's code. Nothing is copied or written inside the checkout. Standard library only: it runs before
the package can be imported (``bench/gpu/check.sh``'s fallback when ``pip install -e .`` fails).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def package_dirs(pyproject: Path) -> dict[str, str]:
    """``[tool.setuptools] package-dir`` of ``pyproject``: package name -> folder relative to the checkout."""
    text = pyproject.read_text()
    try:
        import tomllib
    except ImportError:  # Python 3.10: the inline table on its one line
        match = re.search(r"^package-dir\s*=\s*\{(.*)\}\s*$", text, re.MULTILINE)
        if match is None:
            raise ValueError(f"{pyproject}: no package-dir line") from None
        return dict(re.findall(r'"([^"]+)"\s*=\s*"([^"]+)"', match.group(1)))
    return dict(tomllib.loads(text)["tool"]["setuptools"]["package-dir"])


def build(checkout: Path, dest: Path) -> list[Path]:
    """Lay out the package tree of ``checkout`` under ``dest`` (see the module docstring); returns the links made.

    A package whose subpackages all live in its own folder under their own names becomes one link to that folder;
    a package with a subpackage mapped elsewhere becomes a folder of links to its folder's entries, with that
    subpackage placed in it the same way.
    """
    checkout, dest = checkout.resolve(), Path(dest)
    dirs = {name: checkout / folder for name, folder in package_dirs(checkout / "pyproject.toml").items()}
    links: list[Path] = []

    def place(name: str, target: Path) -> None:
        children = [c for c in dirs if c.rsplit(".", 1)[0] == name and "." in c]
        moved = [c for c in children if dirs[c] != dirs[name] / c.rsplit(".", 1)[1]]
        if not moved:
            target.symlink_to(dirs[name], target_is_directory=True)
            links.append(target)
            return
        target.mkdir(parents=True)
        for entry in sorted(dirs[name].iterdir()):
            if entry.name != "__pycache__" and entry.name not in {c.rsplit(".", 1)[1] for c in moved}:
                (target / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
                links.append(target / entry.name)
        for child in moved:
            place(child, target / child.rsplit(".", 1)[1])

    for top in sorted(n for n in dirs if "." not in n):
        place(top, dest / top)
    return links


def main(argv: list[str] | None = None) -> int:
    """``source_tree.py CHECKOUT DEST``: build the tree (DEST must not exist yet); exit status 2 on bad usage."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: source_tree.py CHECKOUT DEST", file=sys.stderr)
        return 2
    dest = Path(argv[1])
    dest.mkdir(parents=True, exist_ok=True)
    links = build(Path(argv[0]), dest)
    print(f"# source tree: {len(links)} links under {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
