"""The 0.5.18 adapter stays in small modules that import each other in one
direction: ``hiradix`` assembles the cache from its mixins, and no mixin
imports ``hiradix`` or, through another, itself."""

from __future__ import annotations

import ast
import pathlib

from sglang_cp_hicache.sglang_0518 import hooks

ADAPTER = pathlib.Path(hooks.__file__).parent
PACKAGE = "sglang_cp_hicache.sglang_0518"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 100


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(), filename=str(p)) for p in sorted(ADAPTER.glob("*.py"))}


def _adapter_imports(tree: ast.Module) -> set[str]:
    """Adapter modules ``tree`` imports (module level or inside functions)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith(PACKAGE + "."):
                out.add(node.module[len(PACKAGE) + 1:].split(".")[0])
            elif node.module == PACKAGE:
                out.update(a.name for a in node.names if (ADAPTER / f"{a.name}.py").exists())
    return out


def test_modules_and_functions_stay_small():
    too_long = []
    for path in sorted(ADAPTER.glob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{path.name}: {lines} lines")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.name}: {node.name} has {length} lines")
    assert too_long == []


def test_adapter_modules_import_each_other_without_a_cycle():
    graph = {name: _adapter_imports(tree) - {name} for name, tree in _modules().items()}
    state: dict[str, str] = {}
    cycles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for dep in sorted(graph.get(name, ())):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]) if dep in path else f"{name} -> {dep}")
            elif dep not in state:
                visit(dep, path + [dep])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []
    importers_of_hiradix = sorted(n for n, deps in graph.items() if "hiradix" in deps)
    assert importers_of_hiradix == ["plugin"]  # the mixins never reach back to the cache class
