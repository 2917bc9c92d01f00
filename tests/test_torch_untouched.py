"""``import polestar`` (and every module of the package) leaves torch as it found it: no attribute of a loaded torch
module or class rebound or added, no dynamo, inductor or functorch config changed. Checked in a fresh interpreter,
so nothing another test imported or patched can hide a change: it imports torch's compiler stack, takes a snapshot,
imports every polestar module and compares."""

import json
import subprocess
import sys
import textwrap

_IMPORT_ALL = textwrap.dedent("""
    import importlib, pkgutil
    import polestar
    names = []
    for info in pkgutil.walk_packages(polestar.__path__, "polestar."):
        if info.name.startswith("polestar.evaluation"):  # needs the lm-eval extra
            continue
        importlib.import_module(info.name)
        names.append(info.name)
""")

#: torch's compiler stack, loaded before the snapshot (a patch of a module loaded later would not be seen)
TORCH_MODULES = ("torch._dynamo", "torch._dynamo.config", "torch._dynamo.side_effects", "torch._dynamo.eval_frame",
                 "torch._dynamo.variables.dicts", "torch._dynamo.variables.higher_order_ops", "torch._dynamo.guards",
                 "torch._inductor.config", "torch._functorch.config", "torch._functorch.aot_autograd",
                 "torch._higher_order_ops", "torch.compiler", "torch.fx", "torch.library")

_COMPARE = textwrap.dedent("""
    import importlib, inspect, json, sys
    for name in json.loads(sys.argv[1]):
        importlib.import_module(name)

    def snapshot():
        mods = {n: m for n, m in list(sys.modules.items())
                if m is not None and (n == "torch" or n.startswith("torch."))}
        attrs, classes = {}, {}
        for n, m in mods.items():
            for k, v in list(vars(m).items()):
                attrs[(n, k)] = id(v)
                if inspect.isclass(v) and getattr(v, "__module__", None) == n:
                    for ck, cv in list(vars(v).items()):
                        classes[(n, k, ck)] = id(cv)
        configs = {c: repr(sorted(importlib.import_module(c).get_config_copy().items()))
                   for c in ("torch._dynamo.config", "torch._inductor.config", "torch._functorch.config")}
        return attrs, classes, configs

    before = snapshot()
""") + _IMPORT_ALL + textwrap.dedent("""
    after = snapshot()
    changed = [k for k, v in before[0].items() if after[0].get(k) != v]
    known = {c[:2] for c in before[1]}
    added_class = [k for k in after[1] if k[:2] in known and k not in before[1]]
    changed_class = [k for k, v in before[1].items() if after[1].get(k) != v]
    configs = [c for c in before[2] if before[2][c] != after[2][c]]
    print(json.dumps({"modules": len(names), "changed": [list(k) for k in changed],
                      "class_changed": [list(k) for k in changed_class + added_class], "configs": configs}))
""")


def _run(code: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_importing_every_polestar_module_changes_nothing_of_torch():
    report = json.loads(_run(_COMPARE, json.dumps(TORCH_MODULES)))
    assert report["modules"] > 30  # the package's modules were imported
    assert report["changed"] == []  # no attribute of a torch module rebound (new submodules may appear)
    assert report["class_changed"] == []  # no torch class patched
    assert report["configs"] == []
