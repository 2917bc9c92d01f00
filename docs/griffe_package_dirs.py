"""Griffe extension for the API page: the folders pyproject.toml maps into the ``polestar`` namespace.

``[tool.setuptools] package-dir`` installs the top-level folders ``policies/``, ``models/``, ``kernels/``, ``bench/``,
``tasks/`` and ``training/`` as ``polestar.policies``, ``polestar.models``, ... Griffe finds packages by folder, so
when it loads ``polestar`` this extension loads each mapped folder and mounts it under ``polestar`` by its installed
name: ``::: polestar.policies.drift.DriftMetric`` resolves, and headings and cross-references show the names users
import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import griffe
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "polestar"


def mapped_folders(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, Path]:
    """``{"policies": ROOT / "policies", ...}``: each direct subpackage of ``polestar`` whose folder is not
    ``polestar/<name>`` (from ``package-dir``)."""
    package_dir = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-dir"]
    out = {}
    for package, folder in package_dir.items():
        parent, _, name = package.rpartition(".")
        if parent == PACKAGE and Path(folder) != Path(PACKAGE, name):
            out[name] = ROOT / folder
    return out


def _renamed(path: str, name: str) -> str:
    """``path`` of a module loaded by its folder name ``name`` as installed: ``policies.x`` →
    ``polestar.policies.x``."""
    return f"{PACKAGE}.{path}" if path == name or path.startswith(name + ".") else path


def _rename_imports(module: griffe.Module, name: str) -> None:
    """The relative imports of ``module`` and its submodules (recorded under the folder name) by installed name."""
    module.imports = {key: _renamed(path, name) for key, path in module.imports.items()}
    for member in module.members.values():
        if member.is_alias:
            member.target_path = _renamed(member.target_path, name)
    for submodule in module.modules.values():
        if not submodule.is_alias:
            _rename_imports(submodule, name)


class PackageDirs(griffe.Extension):
    """Mounts the folders of :func:`mapped_folders` under the loaded ``polestar`` package."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.path != PACKAGE:
            return
        for name, folder in mapped_folders().items():
            if name not in pkg.members:
                module = loader.load(folder)
                _rename_imports(module, name)
                pkg.set_member(name, module)
