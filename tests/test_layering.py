"""Layering of the installed package: every module imports, and the static import graph obeys the layers.

The layers of the installed package:

* ``polestar.kernels`` imports only itself (torch / triton outside the package);
* ``polestar.tasks`` (the synthetic task suite) imports only itself;
* ``polestar.models`` imports only itself and the kernels (never the benchmark, a policy or the core);
* the core (the modules in ``polestar/``, except the façade ``polestar/__init__.py`` that wires the built-in
  stages in and the command line ``polestar/cli.py``) reaches no ``polestar.policies`` module;
* no runtime module reaches ``polestar.training`` (it lives outside the runtime import path);
* there is no import cycle, not even through imports made for annotations only (``if TYPE_CHECKING:``): a loop of
  type-only imports is still a design loop (two modules that each need the other's types).

The graph is built from the import statements of each module's source (``ast``), including imports inside
functions; the layer rules exclude those under ``if TYPE_CHECKING:``, the cycle check includes them.
``from P import n`` is an edge to ``P.n`` when that is a module, else to ``P``; importing ``P.Q.m`` also runs the
``__init__`` of each package ``P.Q`` the importer is not inside of, so those packages are edges too (except the
root ``polestar``: the façade runs before every module and is an edge only where a module imports it by name).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FACADE = "polestar"
CLI = "polestar.cli"


def _declared_packages() -> list[str]:
    """The packages ``pyproject.toml`` installs (``[tool.setuptools] packages``)."""
    line = re.search(r"^packages = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    return re.findall(r'"([\w.]+)"', line.group(1))


@cache
def package_modules() -> dict[str, Path]:
    """Every module of the installed distribution → its source file (packages map to their ``__init__.py``)."""
    modules: dict[str, Path] = {}
    for package in _declared_packages():
        pkg = importlib.import_module(package)
        modules[package] = Path(pkg.__file__)
        for info in pkgutil.iter_modules(pkg.__path__):
            if not info.ispkg:
                name = f"{package}.{info.name}"
                modules[name] = Path(importlib.util.find_spec(name).origin)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST, type_only: bool = False):
    """Import / ImportFrom nodes of ``tree``; the bodies of ``if TYPE_CHECKING:`` only with ``type_only``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_only:
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _with_parent_packages(importer: str, target: str, modules) -> set[str]:
    """``target`` plus each package above it (not the root façade) that ``importer`` is not inside of."""
    out = {target}
    parts = target.split(".")
    for i in range(2, len(parts)):
        package = ".".join(parts[:i])
        if package in modules and not (importer == package or importer.startswith(package + ".")):
            out.add(package)
    return out


def _internal_imports(name: str, path: Path, modules, type_only: bool = False) -> set[str]:
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path)), type_only):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                hits = [".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in modules]
                if hits:
                    targets |= _with_parent_packages(name, hits[0], modules)
            continue
        if node.level:
            base_parts = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(base_parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if sub in modules:
                targets |= _with_parent_packages(name, sub, modules)
            elif base in modules:
                targets |= _with_parent_packages(name, base, modules)
    targets.discard(name)
    return targets


@cache
def import_graph(type_only: bool = False) -> dict[str, frozenset[str]]:
    """Module → the package modules it imports (static, see the module docstring); with ``type_only`` also those
    it imports under ``if TYPE_CHECKING:``."""
    modules = package_modules()
    return {name: frozenset(_internal_imports(name, path, modules, type_only)) for name, path in modules.items()}


def reachable(start: str) -> set[str]:
    """Modules reached from ``start`` by following imports (``start`` excluded unless on a cycle)."""
    graph = import_graph()
    seen: set[str] = set()
    stack = list(graph[start])
    while stack:
        m = stack.pop()
        if m not in seen:
            seen.add(m)
            stack.extend(graph[m])
    return seen


def import_cycles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def _in(package: str, module: str) -> bool:
    return module == package or module.startswith(package + ".")


def _core_modules() -> list[str]:
    return sorted(
        m for m, path in package_modules().items()
        if path.parent == ROOT / "polestar" and m not in (FACADE, CLI)
    )


def _polestar_folder_modules() -> list[str]:
    """Every module whose source lies under ``polestar/`` (the façade, the command line and subpackages too)."""
    return sorted(m for m, path in package_modules().items() if (ROOT / "polestar") in path.parents)


@pytest.mark.parametrize("name", sorted(package_modules()))
def test_every_module_imports(name):
    assert importlib.import_module(name).__name__ == name


def test_module_discovery_covers_the_layers():
    modules = package_modules()
    for expected in ("polestar.registry", "polestar.engine", "polestar.policies.drift", "polestar.models.llada",
                     "polestar.kernels.drift", "polestar.tasks.arith", "polestar.training.train"):
        assert expected in modules
    assert {"polestar.registry", "polestar.policy", "polestar.engine", "polestar.api"} <= set(_core_modules())
    assert {FACADE, CLI, "polestar.evaluation.tasks", "polestar.tracing.cli"} <= set(_polestar_folder_modules())


def test_import_graph_resolves_each_import_form():
    graph = import_graph()
    assert "polestar.kernels.proxy_attention" in graph["polestar.models.backbone"]  # absolute from-import
    assert "polestar.models.plan" in graph["polestar.models.backbone"]  # relative from-import
    assert "polestar.tasks" in graph["polestar.training.train"]  # module imported by name
    assert "polestar.tasks.arith" in graph["polestar.training.train"]  # import inside a function
    assert "polestar" in graph["polestar.training.train"]  # `import polestar` is the façade
    assert "polestar.policies" in graph["polestar"]  # the façade registers the built-in stages
    # importing a module of another package runs that package's __init__; one's own package is not an edge
    assert {"polestar.models", "polestar.models.loading"} <= graph["polestar.training.train"]
    assert "polestar.tasks.base" in graph["polestar.tasks.arith"]
    assert "polestar.tasks" not in graph["polestar.tasks.arith"]
    # a cycle through two modules is found
    assert import_cycles({"a": frozenset({"b"}), "b": frozenset({"a"}), "c": frozenset()}) == [["a", "b"]]


def test_no_import_cycles():
    assert import_cycles(import_graph()) == []


def test_no_import_cycles_through_type_only_imports():
    graph = import_graph(type_only=True)
    assert "polestar.models.backbone" in graph["polestar.models.layer_ops"]  # an import under TYPE_CHECKING is an edge
    assert "polestar.models.backbone" not in import_graph()["polestar.models.layer_ops"]
    assert import_cycles(graph) == []


def test_kernels_import_only_kernels():
    bad = {m: sorted(d for d in reachable(m) if not _in("polestar.kernels", d))
           for m in package_modules() if _in("polestar.kernels", m)}
    assert {m: d for m, d in bad.items() if d} == {}


def test_models_import_no_benchmark_policy_or_core():
    bad = {m: sorted(d for d in reachable(m) if not (_in("polestar.models", d) or _in("polestar.kernels", d)))
           for m in package_modules() if _in("polestar.models", m)}
    assert {m: d for m, d in bad.items() if d} == {}


def test_tasks_import_only_tasks():
    bad = {m: sorted(d for d in reachable(m) if not _in("polestar.tasks", d))
           for m in package_modules() if _in("polestar.tasks", m)}
    assert {m: d for m, d in bad.items() if d} == {}


def test_polestar_folder_reaches_no_benchmark():
    bad = {m: sorted(d for d in reachable(m) if _in("polestar.bench", d)) for m in _polestar_folder_modules()}
    assert {m: d for m, d in bad.items() if d} == {}


def test_core_imports_no_policy():
    bad = {m: sorted(d for d in reachable(m) if _in("polestar.policies", d)) for m in _core_modules()}
    assert {m: d for m, d in bad.items() if d} == {}


def test_training_is_off_the_runtime_import_path():
    runtime = [m for m in package_modules() if not _in("polestar.training", m)]
    bad = {m: sorted(d for d in reachable(m) if _in("polestar.training", d)) for m in runtime}
    assert {m: d for m, d in bad.items() if d} == {}
