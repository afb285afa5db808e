"""The hook registry: every SGLang 0.5.23 name the adapter depends on resolves
in the installed release; each one, taken away or changed, refuses start-up
naming exactly that hook; and the adapter's source uses no SGLang name the
registry does not list."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import re

import pytest

from sglang_cp_hicache import hook_registry
from sglang_cp_hicache.sglang_0523 import plugin, strategy
from sglang_cp_hicache.sglang_0523.hooks import HOOKS, HookMismatchError, check_hooks, find_problem

from tests.helpers.hook_checks import missing_hook_message, registry_tests, remove_hook

ADAPTER = pathlib.Path(strategy.__file__).parent
# hooks.py is the registry itself; every other module of the adapter uses SGLang.
ADAPTER_MODULES = sorted(p for p in ADAPTER.glob("*.py") if p.name != "hooks.py")
MODULE_PATH = re.compile(r"^sglang(\.[A-Za-z_]\w*)+$")


(test_the_installed_release_passes, test_every_hook_resolves,
 test_the_registry_names_each_hook_once_and_keeps_its_shape) = registry_tests(
    HOOKS, check_hooks, find_problem, params_kinds=("override", "private-helper", "call"))


# ---- each hook, taken away or changed, is named ------------------------------------


@pytest.mark.parametrize("hook", HOOKS, ids=lambda h: h.name)
def test_a_missing_hook_refuses_by_name(hook, monkeypatch):
    message = missing_hook_message(monkeypatch, hook, HOOKS, check_hooks)
    assert f"{hook.name} ({hook.kind})" in message
    assert "written against sglang 0.5.23" in message and "SGLANG_CP_HICACHE_COPY=upstream" in message
    # object.__init__ is all that remains of a removed __init__: a changed signature.
    assert ("is missing" in message) or ("changed its parameters" in message and hook.attribute == "__init__")


def _other_signature(unexpected, *, also=None):  # noqa: ANN001 - a stand-in of another shape
    return None


@pytest.mark.parametrize("hook", [h for h in HOOKS if h.params is not None], ids=lambda h: h.name)
def test_a_changed_signature_refuses_by_name(hook, monkeypatch):
    module = importlib.import_module(hook.module)
    target = module if hook.owner is None else getattr(module, hook.owner)
    monkeypatch.setattr(target, hook.attribute, _other_signature)
    with pytest.raises(HookMismatchError) as err:
        check_hooks()
    assert err.value.hook is hook
    assert f"{hook.name} ({hook.kind}) changed its parameters: expected {list(hook.params)}, " \
           f"found ['unexpected', 'also']" in str(err.value)


def test_a_changed_hook_stops_the_strategy_build_first(monkeypatch):
    hook = next(h for h in HOOKS if h.attribute == "_move_kv_shard_indices")
    remove_hook(monkeypatch, hook, HOOKS)
    with pytest.raises(HookMismatchError, match="_move_kv_shard_indices"):
        strategy.LibraryDsaStrategy().build(
            cache=None, kvcache=None, params=None, server_args=None, load_cache_event=None
        )


def test_the_plugin_registers_a_refusing_strategy_on_a_changed_hook(strategies, monkeypatch):
    """SGLang only logs a plugin that raises: the refusal must come at build."""
    monkeypatch.delenv(plugin.COPY_ENV, raising=False)
    strategy.uninstall_strategy()
    hook = next(h for h in HOOKS if h.attribute == "_submission")
    remove_hook(monkeypatch, hook, HOOKS)
    plugin.register()
    refusing = strategies[0]
    assert not isinstance(refusing, strategy.LibraryDsaStrategy)
    with pytest.raises(HookMismatchError) as err:
        refusing.build(cache=None, kvcache=None, params=None, server_args=None, load_cache_event=None)
    assert err.value.hook is hook


# ---- the registry is complete --------------------------------------------------------


def _trees() -> dict[str, ast.AST]:
    return {p.name: ast.parse(p.read_text(), filename=str(p)) for p in ADAPTER_MODULES}


def _defined_by_adapter(trees: dict[str, ast.AST]) -> set[str]:
    """Every name the adapter defines itself: functions, classes, globals,
    ``self.<name>`` assignments."""
    names = {p.stem for p in ADAPTER.glob("*.py")}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
        names |= hook_registry.self_targets(tree)
    return names


def _registered(name: str) -> bool:
    return any(name in (h.attribute, h.owner) for h in HOOKS)


def test_every_private_sglang_name_the_adapter_uses_is_registered():
    """Heuristic: an attribute ``x._name`` (single leading underscore) that the
    adapter does not define itself is SGLang's -- the adapter's own objects
    carry only names it defines. Overrides of private methods are defined by
    the adapter and checked at runtime below."""
    trees = _trees()
    own = _defined_by_adapter(trees)
    used = {
        (file, node.attr)
        for file, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
        and node.attr not in own
    }
    assert used, "the walk found no private SGLang name: the heuristic broke"
    assert sorted((f, n) for f, n in used if not _registered(n)) == []


def test_every_sglang_import_and_module_string_is_registered():
    modules = {h.module for h in HOOKS}
    missing = []
    for file, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sglang":
                for alias in node.names:
                    as_module = f"{node.module}.{alias.name}" in modules
                    as_name = any(
                        h.module == node.module and alias.name in (h.owner, h.attribute) for h in HOOKS
                    )
                    if not (as_module or as_name):
                        missing.append((file, f"{node.module}.{alias.name}"))
            elif isinstance(node, ast.Import):
                missing += [(file, a.name) for a in node.names if a.name.split(".")[0] == "sglang"
                            and a.name not in modules]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_PATH.match(node.value):
                if node.value not in modules:  # importlib.import_module / find_spec targets
                    missing.append((file, node.value))
    assert missing == []


def _adapter_classes() -> list[type]:
    out = []
    for path in ADAPTER_MODULES:
        module = importlib.import_module(f"sglang_cp_hicache.sglang_0523.{path.stem}")
        out += [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module.__name__]
    return out


def _first_sglang_base(cls: type, name: str) -> type | None:
    return next(
        (k for k in cls.__mro__[1:] if k.__module__.split(".")[0] == "sglang" and name in vars(k)), None
    )


def test_every_method_the_adapter_overrides_is_registered_as_an_override():
    found = []
    for cls in _adapter_classes():
        for name, value in vars(cls).items():
            base = _first_sglang_base(cls, name) if inspect.isfunction(value) else None
            if base is not None:
                found.append((cls.__name__, name))
                assert any(
                    h.kind == "override" and h.owner == base.__name__ and h.attribute == name for h in HOOKS
                ), f"{cls.__name__}.{name} overrides {base.__name__}.{name}, which HOOKS does not list"
    assert ("LibraryL2TransferEngine", "submit_host_to_device") in found  # the walk saw the engine


def test_every_upstream_attribute_the_adapter_overwrites_is_registered():
    """``self.<name> = ...`` in an adapter subclass, where upstream's class has
    ``<name>`` too, replaces upstream's value on each instance."""
    replaced = []
    for cls in _adapter_classes():
        bases = [k for k in cls.__mro__[1:] if k.__module__.split(".")[0] == "sglang"]
        if not bases:
            continue
        for name in hook_registry.self_targets(ast.parse(inspect.getsource(cls))):
            owner = next((b for b in bases if name in vars(b) or name in hook_registry._instance_attributes(b)), None)
            if owner is not None:
                replaced.append((cls.__name__, name))
                assert any(
                    h.kind == "replaced-on-instance" and h.attribute == name and h.owner in
                    {b.__name__ for b in bases} for h in HOOKS
                ), f"{cls.__name__} overwrites {owner.__name__}.{name}, which HOOKS does not list"
    assert ("LibraryCopyController", "l2_transfer_engine") in replaced


def test_every_attribute_the_adapter_sets_on_an_upstream_object_is_registered_as_replaced():
    """``<obj>.<name> = ...`` where ``<obj>`` is not ``self`` and ``<name>``
    is not an attribute the adapter's own classes define (``self.<name>``):
    the adapter overwrites an attribute on an instance SGLang built (a cache,
    a tree component, an allocator), which must be listed as
    ``replaced-on-instance`` on some class."""
    trees = _trees()
    own = set().union(*(hook_registry.self_targets(tree) for tree in trees.values()))
    replaced = []
    for file, tree in trees.items():
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AnnAssign) else []
            )
            for target in targets:
                if isinstance(target, ast.Attribute) and not (
                    isinstance(target.value, ast.Name) and target.value.id == "self"
                ) and target.attr not in own:
                    replaced.append((file, target.attr))
    assert {("host_room.py", "_execute_kv_backup"), ("device_free.py", "evict_component"),
            ("device_free.py", "free_segment"), ("device_free.py", "free")} <= set(replaced)
    listed = {h.attribute for h in HOOKS if h.kind == "replaced-on-instance"}
    assert sorted((f, n) for f, n in replaced if n not in listed) == []
