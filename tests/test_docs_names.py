"""Every code name the internals and policies pages mention resolves to something the package (or torch) has.

A page's code spans (backticks) that look like code names are checked: dotted names (``DecodeState.active``,
``step.decode_step``, ``state.phase``), names with an underscore (``block_plan``), CamelCase names
(``WindowBuffers``) and calls (``state.block_columns()``). Plain words (``plan``, ``kl``) and shapes (``[B, T]``)
are not. A name resolves when it is

* an importable path (``polestar.models.layer_regions``, ``torch.topk``), a module's short name with attributes
  (``step.decode_step``), or a class of the package with its attributes (``DiffusionLM.run_plan``);
* a variable's attribute (``cache.key_valid``): its last part is an attribute some class of the package has or
  sets on ``self``, or a field of an attrs class or NamedTuple;
* a single name defined in the package: a module-level name, a class attribute, method or field, a parameter of
  a function, a registered stage, policy or kind name, or a stage's option; or a Python builtin or a tensor
  method (``copy_``).

Names of the reference implementations' own code that a page cites are listed in :data:`EXTERNAL`.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import re
from functools import cache
from pathlib import Path

import attrs
import pytest
import torch

import polestar
from polestar import registry
from polestar.policy import policy_names
from tests.test_layering import package_modules

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["docs/internals.md", "docs/policies.md"]

#: names from the reference implementations' code that the pages cite (Elastic-Cache's released entry point)
EXTERNAL = frozenset({"generate_with_elastic_cache"})

CODE_SPAN = re.compile(r"`([^`\n]+)`")
NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(\(\))?")


def looks_like_code(token: str) -> bool:
    if not NAME.fullmatch(token) or token.startswith("__"):
        return False
    return "." in token or "_" in token or token.endswith("()") or bool(re.search(r"[a-z][A-Z]|^[A-Z][a-z]", token))


@cache
def modules() -> dict[str, object]:
    return {name: importlib.import_module(name) for name in package_modules()}


@cache
def classes() -> dict[str, list[type]]:
    """Simple name → the package's classes of that name (nested classes included)."""
    out: dict[str, list[type]] = {}

    def add(cls: type) -> None:
        if cls not in out.setdefault(cls.__name__, []):
            out[cls.__name__].append(cls)
            for value in vars(cls).values():
                if inspect.isclass(value) and value.__module__.startswith("polestar"):
                    add(value)

    for module in modules().values():
        for value in vars(module).values():
            if inspect.isclass(value) and value.__module__.startswith("polestar"):
                add(value)
    return out


@cache
def self_attributes() -> frozenset[str]:
    """Every ``self.x`` (or ``obj.x``) assigned anywhere in the package's sources."""
    names: set[str] = set()
    for path in {Path(m.__file__) for m in modules().values()}:
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Attribute):
                        names.add(sub.attr)
    return frozenset(names)


def _members(cls: type) -> set[str]:
    names = set(dir(cls))
    if attrs.has(cls):
        names |= {f.name for f in attrs.fields(cls)}
    names |= set(getattr(cls, "_fields", ()))
    names |= set(getattr(cls, "__annotations__", {}))
    return names


@cache
def known_names() -> frozenset[str]:
    """Every single name the package defines or registers (see the module docstring)."""
    names: set[str] = set(self_attributes()) | set(dir(builtins)) | set(dir(torch.Tensor)) | EXTERNAL
    for name, module in modules().items():
        names |= {name.rpartition(".")[2]} | set(vars(module))
        names |= {p for value in vars(module).values() if inspect.isfunction(value) for p in _parameters(value)}
    for group in classes().values():
        for cls in group:
            names |= _members(cls)
            names |= {p for value in vars(cls).values() if inspect.isfunction(value) for p in _parameters(value)}
    for kind in registry.KINDS:
        names.add(kind)
        for stage in registry.names(kind):
            names.add(stage)
            names |= set(registry.config_fields(kind, stage))
    names |= set(policy_names())
    return frozenset(names)


def _parameters(fn) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def _getattr_path(obj, parts: list[str]) -> bool:
    for part in parts:
        if inspect.isclass(obj) and part in _members(obj):
            obj = getattr(obj, part, None)
            if obj is None:
                return True  # a field without a class-level value: the path ends here or goes on unchecked
            continue
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def resolves(token: str) -> bool:
    parts = token.removesuffix("()").split(".")
    if len(parts) == 1:
        return parts[0] in known_names()
    for i in range(len(parts), 0, -1):  # an importable path, then attributes
        for prefix in ("", "polestar."):
            head = prefix + ".".join(parts[:i])
            try:
                module = importlib.import_module(head)
            except ImportError:
                continue
            if _getattr_path(module, parts[i:]):
                return True
    short = {name.rpartition(".")[2]: module for name, module in modules().items()}
    if parts[0] in short and _getattr_path(short[parts[0]], parts[1:]):
        return True
    if any(_getattr_path(cls, parts[1:]) for cls in classes().get(parts[0], [])):
        return True
    if parts[0][0].islower():  # a variable (``state``, ``cache``): its attribute is one the package has
        return parts[-1] in known_names()
    return False


def code_names(page: str) -> list[str]:
    text = (ROOT / page).read_text()
    return sorted({t for t in CODE_SPAN.findall(text) if looks_like_code(t) and not t.endswith((".py", ".md"))})


@pytest.mark.parametrize("page", PAGES)
def test_every_code_name_on_the_page_resolves(page):
    polestar.policy_names()  # the built-in stages are registered
    names = code_names(page)
    assert len(names) > 40
    assert [name for name in names if not resolves(name)] == []


def test_the_resolver_rejects_names_that_do_not_exist():
    assert resolves("DecodeState.active") and resolves("step.decode_step") and resolves("cache.key_valid")
    assert resolves("polestar.models.layer_regions") and resolves("torch.topk") and resolves("block_plan")
    assert not resolves("DecodeState.no_such_field")
    assert not resolves("block_work_that_never_was")
    assert not resolves("step.no_such_function")
    assert not looks_like_code("plan") and looks_like_code("WindowBuffers") and looks_like_code("state.phase")
