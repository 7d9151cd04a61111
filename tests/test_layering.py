"""The package's layering, read from the imports of every module under hybridkv/ (ast; lazy
imports inside functions count too): nothing imports upward.

    forward_batch                the per-step types: imports nothing of hybridkv
    kv/, core/                   specs, plan, scheduler: no layers, models, worker
    ops/ (and ops/native/)       kernels and their references: no layers, models, worker,
                                 engine, entrypoints, serving
    layers/                      the model building blocks: no models, worker, engine, ...
    models/                      the families: no ops.native (layers wrap the kernels:
                                 layers/activation.py, layers/moe.py, ...)

A remaining arrow that the package keeps on purpose is listed in ALLOWED with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "hybridkv"

SERVING = ("hybridkv.engine", "hybridkv.entrypoints", "hybridkv.serving")
RULES = {
    # (the modules a rule covers) -> the modules they must not import
    "hybridkv.forward_batch": ("hybridkv.",),
    "hybridkv.ops.": ("hybridkv.layers", "hybridkv.models", "hybridkv.worker", *SERVING),
    "hybridkv.layers.": ("hybridkv.models", "hybridkv.worker", *SERVING),
    "hybridkv.kv.": ("hybridkv.layers", "hybridkv.models", "hybridkv.worker", *SERVING),
    "hybridkv.core.": ("hybridkv.layers", "hybridkv.models", "hybridkv.worker", *SERVING),
    "hybridkv.models.": ("hybridkv.ops.native",),
}

# (importer, imported) arrows kept on purpose, and why
ALLOWED = {
    # the attention backends' declarations are pure data (they import only hybridkv.dtypes):
    # the memory plan chooses kernel block sizes from them
    ("hybridkv.kv.plan", "hybridkv.layers.attention.registry"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every module `path` imports; `from a import b` gives a.b (b a module or a name in a)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: from the package, `level - 1` packages up
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _inside(module: str, prefix: str) -> bool:
    """module is prefix or inside it (a prefix ending in "." matches what starts with it)."""
    if prefix.endswith("."):
        return module.startswith(prefix)
    return module == prefix or module.startswith(prefix + ".")


def upward(rule: str) -> list[str]:
    """The imports of the modules a rule covers that it forbids, less the ALLOWED ones."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        name = module_name(path)
        if not (_inside(name, rule) or name == rule.rstrip(".")):
            continue
        for target in sorted(imported(path)):
            if not any(_inside(target, f) for f in RULES[rule]):
                continue
            if not any(n == name and _inside(target, t) for n, t in ALLOWED):
                found.append(f"{name} imports {target}")
    return found


@pytest.mark.parametrize("rule", list(RULES))
def test_nothing_imports_upward(rule):
    assert upward(rule) == []


def test_the_rules_see_the_imports():
    """The parser finds what a module imports (lazy and relative ones too)."""
    assert "hybridkv.forward_batch.ForwardBatch" in imported(ROOT / "layers" / "cache.py")
    assert "hybridkv.kv.plan.make_plan" in imported(ROOT / "models" / "registry.py")
    assert _inside("hybridkv.ops.native.ssm", "hybridkv.ops.native")
    assert not _inside("hybridkv.opsx", "hybridkv.ops")
