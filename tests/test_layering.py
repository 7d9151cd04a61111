"""The package's layering, read from the imports of every module under hybridkv/ (ast; lazy
imports inside functions count too): nothing imports upward.

    forward_batch                the per-step types: imports nothing of hybridkv
    kv/, core/                   specs, plan, scheduler: no layers, models, worker
    ops/ (and ops/native/)       kernels and their references: no layers, models, worker,
                                 engine, entrypoints, serving
    layers/                      the model building blocks: no models, worker, engine, ...
    models/                      the families: no ops.native (layers wrap the kernels:
                                 layers/activation.py, layers/moe.py, ...)
    layers/, distributed/        no ops.native at module level: they declare op families
                                 (hybridkv.ops.registry) whose native implementations import
                                 it lazily, inside a function

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


# modules of layers/ and distributed/ that still import ops.native at module level, and why
# (each to be moved behind its family's declaration, issue 29)
NATIVE_AT_MODULE_LEVEL: set[str] = set()  # (none left: linear and quantization import lazily)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _walk_module_level(tree: ast.AST):
    """The nodes of `tree` that run when the module is imported (not inside a function)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                todo.append(child)


def imported(path: Path, module_level: bool = False) -> set[str]:
    """Every module `path` imports (`module_level`: only at import time, not inside functions);
    `from a import b` gives a.b (b a module or a name in a)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in _walk_module_level(tree) if module_level else ast.walk(tree):
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


def native_at_module_level() -> list[str]:
    """The modules of layers/ and distributed/ importing hybridkv.ops.native at module level,
    less those in NATIVE_AT_MODULE_LEVEL."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        name = module_name(path)
        covered = _inside(name, "hybridkv.layers") or _inside(name, "hybridkv.distributed")
        if not covered or name in NATIVE_AT_MODULE_LEVEL:
            continue
        for target in sorted(imported(path, module_level=True)):
            if _inside(target, "hybridkv.ops.native") or target == "hybridkv.ops.native":
                found.append(f"{name} imports {target} at module level")
    return found


def test_layers_import_no_native_at_module_level():
    """layers/ and distributed/ declare op families; the native kernels are imported where an
    implementation runs (hybridkv/layers/activation.py's adapters), never at module level."""
    assert native_at_module_level() == []
    still = {module_name(p) for p in ROOT.rglob("*.py")} & NATIVE_AT_MODULE_LEVEL
    assert still == NATIVE_AT_MODULE_LEVEL, "a listed module is gone: drop it from the list"


def test_the_rules_see_the_imports():
    """The parser finds what a module imports (lazy and relative ones too)."""
    assert "hybridkv.forward_batch.ForwardBatch" in imported(ROOT / "layers" / "cache.py")
    assert "hybridkv.kv.plan.make_speculative_plan" in imported(ROOT / "models" / "registry.py")
    mlp = ROOT / "layers" / "mlp.py"  # lazy imports: seen, but not at module level
    assert "hybridkv.ops.native.moe" in imported(mlp)
    assert "hybridkv.ops.native.moe" not in imported(mlp, module_level=True)
    linear = ROOT / "layers" / "linear.py"  # module level: the registry; the kernels lazily
    assert "hybridkv.ops.registry.declare" in imported(linear, module_level=True)
    assert "hybridkv.ops.native.bf16_linear" in imported(linear)
    assert "hybridkv.ops.native.bf16_linear" not in imported(linear, module_level=True)
    assert _inside("hybridkv.ops.native.ssm", "hybridkv.ops.native")
    assert not _inside("hybridkv.opsx", "hybridkv.ops")
