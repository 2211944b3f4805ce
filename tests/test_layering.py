"""The import layering of docs/DESIGN.md, enforced: imports only point down, no cycles, light config.

Every ``import`` / ``from ... import`` in the project's Python files (module level and inside
functions) is read with ``ast``; each module belongs to a layer, and a module may import only its
own component or components of a lower layer.
"""

import ast
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

# Lower number = lower layer. A module may import its own component and lower layers only.
LAYERS = {
    "dmc_train.megatron_import": 0,
    "dmc_train.errors": 0,
    "dmc_train": 1,  # the package's __init__ only (it installs megatron_import's hooks)
    "dmc_train.config": 1,
    "dmc_train.units": 1,  # byte sizes as users write them (torch-free)
    "dmc_train.distributed": 2,
    "dmc_train.plotting": 2,
    "kernels": 3,
    "dmc_train.models": 4,
    "dmc_train.data": 4,
    "dmc_train.policies": 4,  # below the methods: LESS trains against a policy
    "dmc_train.methods": 5,
    "dmc_train.recipes": 6,
    "dmc_train.cluster": 7,
    "dmc_train.training": 8,
    "dmc_train.inference": 9,
    "dmc_train.conversion": 9,
    "dmc_train.evaluation": 10,  # evaluates with the training model and with the inference engine
    "dmc_train.cli": 11,
    "launch": 12,
    "checkpoints_tools": 12,
}
PACKAGES = ("dmc_train", "kernels", "launch", "checkpoints_tools")


def component(module: str) -> str | None:
    """The longest ``LAYERS`` key that is ``module`` or a parent package of it."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in LAYERS and (name != "dmc_train" or module == "dmc_train"):  # no catch-all for the library
            return name
    return None


def project_modules() -> dict[str, str]:
    """Dotted module name -> file path, for every project package."""
    found = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].replace(os.sep, ".")
                    found[rel.removesuffix(".__init__")] = os.path.join(folder, name)
    return found


def imports_of(module: str, path: str) -> set[str]:
    """Project modules imported anywhere in ``path`` (relative imports resolved)."""
    tree = ast.parse(open(path).read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        out.update(n for n in names if n.split(".")[0] in PACKAGES)
    return out


MODULES = project_modules()


def test_every_module_has_a_layer():
    assert [m for m in MODULES if component(m) is None] == []


def test_imports_only_point_down():
    violations = []
    for module, path in MODULES.items():
        src = component(module)
        for target in imports_of(module, path):
            dst = component(target)
            if dst is None or dst == src:
                continue
            if src == "kernels" and target.startswith("dmc_train"):
                violations.append(f"{module} -> {target} (kernels/ stands below the library)")
            elif LAYERS[dst] >= LAYERS[src]:
                violations.append(f"{module} (layer {LAYERS[src]}) -> {target} (layer {LAYERS[dst]})")
    assert violations == []


def test_no_import_cycles():
    graph = {m: {t for t in imports_of(m, p) if t in MODULES and t != m} for m, p in MODULES.items()}
    # A package's __init__ importing its own submodules is not a cycle of concerns; drop those edges.
    graph = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = "open"
        for t in graph[m]:
            if state.get(t) == "open":
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


@pytest.mark.parametrize("recipe", ["base_tiny", "dmc_tiny"])
def test_composing_and_checking_a_config_imports_neither_torch_nor_megatron(recipe):
    code = (f"import sys; from dmc_train.recipes import load_config, validate; "
            f"validate(load_config(['+recipe={recipe}']), 1); "
            f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')); print(heavy)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
