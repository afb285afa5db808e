"""The 0.5.18 adapter stays in small modules that import each other in one
direction: ``hiradix`` builds the cache and its collaborators, and no
collaborator imports ``hiradix`` or, through another, itself. The cache is
one class of this package on SGLang's ``HiRadixCache`` (at most three), and
what one module puts on the cache no other module reads: collaborators hold
their own state and reach SGLang's cache only as ``tree``, for SGLang's own
attributes."""

from __future__ import annotations

import ast
import inspect
import pathlib
import sys

from sglang_cp_hicache import settings
from sglang_cp_hicache.sglang_0518 import hooks
from sglang_cp_hicache.sglang_0518.hiradix import CpHiRadixCache
from sglang_cp_hicache.testing.stack_0518 import CpStackConfig, build_cp_rank_stack

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
    assert importers_of_hiradix == ["plugin"]  # the collaborators never reach back to the cache class


# ---- the cache: one class, collaborators that own their state ------------------------
OURS = "sglang_cp_hicache."
#: Names a collaborator gives SGLang's cache (the only way it reaches it).
CACHE_NAMES = {"cache", "tree"}
#: Builds the cache and reads its public start-up report, as SGLang's factory would:
#: a caller of the cache, not a part of it.
CALLERS = {"plugin"}


def _package_classes_of_the_cache() -> list[type]:
    return [k for k in CpHiRadixCache.__mro__ if k.__module__.startswith(OURS)]


def _sglang_names() -> set[str]:
    """What SGLang's cache has itself: its class attributes and methods, and
    every ``self.X`` its classes assign."""
    base = next(k for k in CpHiRadixCache.__mro__ if not k.__module__.startswith(OURS))
    names = set(dir(base))
    for klass in base.__mro__:
        if klass is object:
            continue
        tree = ast.parse(inspect.getsource(sys.modules[klass.__module__]))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_name(node.value, "self"):
                names.add(node.attr)
    return names


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _is_the_cache(node: ast.AST, in_cache_class: bool) -> bool:
    """``node`` is the cache: ``self`` in one of its classes, ``cache`` /
    ``tree``, or ``self.cache`` / ``self.tree`` (with or without ``_``)."""
    if isinstance(node, ast.Name):
        return node.id in CACHE_NAMES or (in_cache_class and node.id == "self")
    return (
        isinstance(node, ast.Attribute) and _is_name(node.value, "self") and node.attr.lstrip("_") in CACHE_NAMES
    )


def _attribute_uses(tree: ast.Module, cache_classes: set[str]):
    """(attr, stored?, in a cache class?) of every attribute of the cache
    ``tree`` names, plus the methods and properties a cache class defines
    (stored) and ``setattr(<the cache>, "X", ...)`` (stored)."""
    uses = []

    def walk(node: ast.AST, in_cache_class: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_cache_class
            if isinstance(child, ast.ClassDef):
                inside = child.name in cache_classes
                if inside:
                    uses.extend((f.name, True) for f in child.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)))
            if isinstance(child, ast.Attribute) and _is_the_cache(child.value, inside):
                uses.append((child.attr, isinstance(child.ctx, (ast.Store, ast.Del))))
            if (isinstance(child, ast.Call) and _is_name(child.func, "setattr") and len(child.args) >= 2
                    and _is_the_cache(child.args[0], inside) and isinstance(child.args[1], ast.Constant)):
                uses.append((child.args[1].value, True))
            walk(child, inside)

    walk(tree, False)
    return uses


def _library_attribute_reads_across_modules(modules: dict[str, ast.Module]) -> list[str]:
    """Every read, in one adapter module, of a cache attribute (or method)
    that this library -- not SGLang -- puts on the cache in another module."""
    cache_classes = {k.__name__ for k in _package_classes_of_the_cache()}
    sglang = _sglang_names()
    uses = {name: _attribute_uses(tree, cache_classes) for name, tree in modules.items()}
    set_in: dict[str, set[str]] = {}
    for module, found in uses.items():
        for attr, stored in found:
            if stored and attr not in sglang:
                set_in.setdefault(attr, set()).add(module)
    return sorted({
        f"{module} reads {attr}, which {', '.join(sorted(set_in[attr]))} sets on the cache"
        for module, found in uses.items() if module not in CALLERS
        for attr, stored in found
        if not stored and attr in set_in and module not in set_in[attr]
    })


def test_the_cache_is_at_most_three_classes_of_this_package():
    ours = _package_classes_of_the_cache()
    assert len(ours) <= 3, [k.__qualname__ for k in ours]


def test_no_module_reads_what_another_module_sets_on_the_cache():
    assert _library_attribute_reads_across_modules(_modules()) == []


def test_the_check_sees_a_mixin_reading_the_cache_s_state():
    """The check itself: a second cache class in another module reading an
    attribute ``hiradix`` sets, and a collaborator reading one off ``tree``."""
    modules = _modules()
    modules["hiradix"].body.append(ast.parse("class CpHiRadixCache:\n    def f(self):\n        self.cp_spare = 1\n").body[0])
    modules["write_through"] = ast.parse(
        "class CpHiRadixCache:\n    def g(self):\n        return self.cp_spare\n"
        "class W:\n    def h(self):\n        return self.tree.cp_counters\n"
    )
    assert _library_attribute_reads_across_modules(modules) == [
        "write_through reads cp_counters, which hiradix sets on the cache",
        "write_through reads cp_spare, which hiradix sets on the cache",
    ]


def _collaborators(cache) -> list:
    """Objects of this library reachable from the cache's attributes."""
    seen, out, todo = {id(cache)}, [], list(vars(cache).values())
    while todo:
        obj = todo.pop()
        if id(obj) in seen or not type(obj).__module__.startswith(OURS):
            continue
        seen.add(id(obj))
        out.append(obj)
        if hasattr(obj, "__dict__"):
            todo.extend(vars(obj).values())
    return out


def test_collaborators_hold_the_cache_only_as_tree(tmp_path, monkeypatch):
    """What the AST check above relies on: a collaborator that holds the
    cache holds it as ``tree`` (with L3 on, so the L3 port is among them)."""
    monkeypatch.setenv(settings.L3_DIR.name, str(tmp_path))
    stack = build_cp_rank_stack(CpStackConfig(cp_size=2, device_pages=3, host_pages=8), 0)
    try:
        cache = stack.cache
        assert cache.cp_l3 is not None
        found = _collaborators(cache)
        kinds = {type(o).__name__ for o in found}
        assert {"HostTier", "WriteThrough", "LoadBack", "StepProtocol", "L3Cache", "L3Requests", "L3Port0518"} <= kinds
        holders = sorted(
            f"{type(o).__name__}.{name}" for o in found for name, value in vars(o).items() if value is cache
        )
        assert holders and all(h.endswith(".tree") for h in holders), holders
    finally:
        stack.close()
