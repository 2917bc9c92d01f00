"""Stages and policies defined outside the package: installed packages and modules or files named at run time.

Two ways in, both of which only *import* code (a plugin registers its stages and policies with
:func:`polestar.registry.register` and :func:`polestar.policy.register_policy` when imported):

* an installed distribution declares an entry point in the group :data:`ENTRY_POINT_GROUP` (``polestar.plugins``),
  e.g. in its ``pyproject.toml``::

      [project.entry-points."polestar.plugins"]
      hellinger = "mydrift"            # a module: importing it registers its stages
      more = "mypkg.stages:register"   # or a callable, called with no argument

  ``import polestar`` loads every such entry point once (a failing one is reported as a warning naming it, and the
  others still load);
* ``--plugin MODULE_OR_FILE`` on ``polestar generate``, ``bench``, ``anatomy``, ``agree`` and ``policies`` (and
  ``polestar lm-eval --plugin ...`` or the lm-eval model argument ``plugin=...``) imports a module by its dotted
  name or a ``.py`` file by its path, in every process (``torchrun`` starts the command in each rank).

A file is imported once per process under its stem as module name, so a second ``--plugin`` of the same file (or a
second command in one process) reuses it.

Stages from outside the package have their outputs checked against their kind's contract by default
(:mod:`polestar.contracts`; a compiled decode checks the first step of each step phase, run eagerly, and compiles
the rest), and :func:`plugin_sources` fingerprints the source file of every plugin module and of
every stage or policy registered from outside the package: ``polestar bench`` records them in its manifest and in
the items log's header, so ``--resume`` refuses to mix items decoded by an edited plugin with new ones.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import warnings
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from types import ModuleType

ENTRY_POINT_GROUP = "polestar.plugins"

_entry_points_loaded = False

#: modules imported as plugins (``--plugin``, :func:`load_plugin`, entry points) in this process, by module name
_LOADED: dict[str, ModuleType] = {}


class PluginError(ValueError):
    """A plugin that cannot be found or fails to import; the message names it and the cause on one line."""


def load_entry_points() -> list[str]:
    """Load, once per process, every entry point of :data:`ENTRY_POINT_GROUP`; return the names loaded.

    A module entry point is imported; one naming a callable (``module:function``) is called with no argument. A
    failure is a ``RuntimeWarning`` naming the entry point and its distribution (a broken plugin must not make
    ``import polestar`` fail).
    """
    global _entry_points_loaded
    if _entry_points_loaded:
        return []
    _entry_points_loaded = True
    loaded = []
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
            if ep.attr is not None and callable(obj):
                obj()
            _remember(sys.modules.get(ep.module))
        except Exception as err:  # noqa: BLE001 - any plugin failure is reported, never raised
            dist = getattr(getattr(ep, "dist", None), "name", "?")
            warnings.warn(f"polestar plugin {ep.name!r} ({ep.value}, from {dist}) failed to load: "
                          f"{type(err).__name__}: {err}", RuntimeWarning, stacklevel=2)
            continue
        loaded.append(ep.name)
    return loaded


def _is_file_spec(spec: str) -> bool:
    return spec.endswith(".py") or os.sep in spec or (os.altsep is not None and os.altsep in spec)


def _load_file(spec: str) -> ModuleType:
    path = Path(spec).expanduser().resolve()
    if not path.is_file():
        raise PluginError(f"plugin file {spec} does not exist")
    name = path.stem
    if not name.isidentifier():
        raise PluginError(f"plugin file {spec}: its name {name!r} is not a Python identifier; rename the file")
    existing = sys.modules.get(name)
    if existing is not None:
        origin = getattr(existing, "__file__", None)
        if origin is not None and Path(origin).resolve() == path:
            return existing
        raise PluginError(f"plugin file {spec}: a module named {name!r} is already imported "
                          f"(from {origin or 'a built-in'}); rename the file")
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException as err:
        del sys.modules[name]
        if isinstance(err, Exception):
            raise PluginError(f"plugin file {spec} failed to import: {type(err).__name__}: {err}") from err
        raise
    return module


def load_plugin(spec: str) -> ModuleType:
    """Import plugin ``spec``: a ``.py`` file (a path) or a module's dotted name; return the module.

    Raises :class:`PluginError` (a ``ValueError``) for a missing file or module, or one whose import fails.
    """
    spec = str(spec).strip()
    if not spec:
        raise PluginError("--plugin needs a module name or a .py file")
    if _is_file_spec(spec) or Path(spec).is_file():
        return _remember(_load_file(spec))
    try:
        return _remember(importlib.import_module(spec))
    except ModuleNotFoundError as err:
        if err.name is not None and (spec == err.name or spec.startswith(err.name + ".")):  # the plugin itself
            raise PluginError(f"plugin {spec}: no module named {err.name!r} (and no such .py file); give an "
                              "importable module name or a path to a .py file") from None
        raise PluginError(f"plugin {spec} failed to import: {type(err).__name__}: {err}") from err
    except Exception as err:
        raise PluginError(f"plugin {spec} failed to import: {type(err).__name__}: {err}") from err


def load_plugins(specs: Iterable[str]) -> list[ModuleType]:
    """:func:`load_plugin` for each of ``specs``, in order."""
    return [load_plugin(s) for s in specs]


def split_plugin_list(value: str) -> list[str]:
    """Plugins in one string, separated by ``os.pathsep`` (``:``), as the lm-eval model argument ``plugin`` takes
    them."""
    return [part for part in str(value).split(os.pathsep) if part.strip()]


def _remember(module: ModuleType | None) -> ModuleType | None:
    """Keep ``module`` among this process's plugin modules (for :func:`plugin_sources`); returns it."""
    if module is not None:
        _LOADED[module.__name__] = module
    return module


def file_digest(path: str | Path) -> str:
    """``sha256:<hex>`` of a file's bytes."""
    return "sha256:" + hashlib.sha256(Path(path).read_bytes()).hexdigest()


def plugin_sources() -> dict[str, str]:
    """``{source file: "sha256:..."}`` for every plugin of this process: each module still imported that
    :func:`load_plugin` or an entry point imported, and the file of each stage class and policy registered from
    outside the package (:func:`polestar.registry.is_builtin`). A plugin with no source file (a notebook cell) is
    listed under ``<module name>`` with the digest ``"no source file"``. Empty without plugins."""
    from polestar import policy, registry
    from polestar.registry import source_file

    sources: dict[str, str] = {}

    def add(obj, name: str) -> None:
        path = source_file(obj)
        if path is None:
            sources[f"<{name}>"] = "no source file"
        else:
            sources[path] = file_digest(path)

    for name, module in _LOADED.items():
        if sys.modules.get(name) is module:  # a test or a notebook may drop a plugin module again
            add(module, name)
    for kind in registry.KINDS:
        for name in registry.names(kind):
            cls = registry.lookup(kind, name)
            if not registry.is_builtin(cls):
                add(cls, cls.__module__)
    for name in policy.policy_names():
        origin = policy._ORIGINS.get(name, "?")
        if origin != registry.PACKAGE and not origin.startswith(registry.PACKAGE + "."):
            module = sys.modules.get(origin)
            if module is None:
                sources.setdefault(f"<{origin}>", "no source file")
            else:
                add(module, origin)
    return dict(sorted(sources.items()))
