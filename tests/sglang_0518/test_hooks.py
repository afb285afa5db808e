"""The hook registry: every SGLang 0.5.18 name the adapter depends on resolves
in the installed release; each one, taken away or changed, refuses start-up
naming exactly that hook; and the adapter's source uses no SGLang name the
registry does not list (overrides, ``self.<name>`` and ``super().<name>``
uses, imports, controller and pool attributes, methods bound on instances)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import sys
import types

import pytest

from sglang_cp_hicache.sglang_0518 import hooks, plugin
from sglang_cp_hicache.sglang_0518.allocator import CpSharedPagedTokenToKVPoolAllocator
from sglang_cp_hicache.sglang_0518.hiradix import CpHiRadixCache
from sglang_cp_hicache.sglang_0518.hooks import HOOKS, HookMismatchError, check_hooks, find_problem
from sglang_cp_hicache.sglang_0518.tree_node import CpTreeNode
from sglang_cp_hicache.testing.stack_0518 import CpStackConfig, build_cp_rank_stack

from tests.helpers.hook_checks import missing_hook_message, registry_tests

ADAPTER = pathlib.Path(hooks.__file__).parent
# hooks.py is the registry itself; every other module of the adapter uses SGLang.
ADAPTER_MODULES = sorted(p for p in ADAPTER.glob("*.py") if p.name != "hooks.py")
OURS = "sglang_cp_hicache."


def registered(owners: set[str], name: str, kinds: tuple[str, ...] = hooks.KINDS) -> bool:
    return any(h.owner in owners and h.attribute == name and h.kind in kinds for h in HOOKS)


(test_the_installed_release_passes, test_every_hook_resolves,
 test_the_registry_names_each_hook_once_and_keeps_its_shape) = registry_tests(
    HOOKS, check_hooks, find_problem, params_kinds=("private-helper", "call"))


# ---- each hook, taken away or changed, is named ------------------------------------


@pytest.mark.parametrize("hook", HOOKS, ids=lambda h: h.name)
def test_a_missing_hook_refuses_by_name(hook, monkeypatch):
    message = missing_hook_message(monkeypatch, hook, HOOKS, check_hooks)
    what = "changed" if hook.attribute == "__init__" else "missing"  # object.__init__ is left
    assert message.startswith(f"SGLang 0.5.18 hook {what}: {hook.name} ({hook.kind}) ")
    assert f"; the adapter needs it because it {hook.why}. " in message
    assert message.endswith("This adapter was written against sglang 0.5.18.")


def _with_params(params: tuple[str, ...]):
    """A function whose parameters are ``params``."""
    source = f"def changed({', '.join(params)}):\n    pass\n"
    namespace: dict = {}
    exec(source, namespace)  # noqa: S102 - builds a signature, runs nothing
    return namespace["changed"]


@pytest.mark.parametrize("hook", [h for h in HOOKS if h.params is not None], ids=lambda h: h.name)
def test_a_changed_signature_refuses_by_name(hook, monkeypatch):
    module = importlib.import_module(hook.module)
    holder = module if hook.owner is None else getattr(module, hook.owner)
    changed = _with_params(tuple(p for p in hook.params if p != "kwds") + ("added_in_a_later_release",))
    if hook.owner is not None and isinstance(inspect.getattr_static(holder, hook.attribute), staticmethod):
        changed = staticmethod(changed)
    monkeypatch.setattr(holder, hook.attribute, changed)
    with pytest.raises(HookMismatchError) as err:
        check_hooks()
    assert err.value.hook is hook
    assert f"SGLang 0.5.18 hook changed: {hook.name}" in str(err.value)
    assert "added_in_a_later_release" in str(err.value)


def test_the_cache_checks_its_hooks_before_sglang_builds_anything(monkeypatch):
    """A release without a private helper the write path calls refuses to
    build the cache by name (before upstream's __init__ runs)."""
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

    monkeypatch.delattr(HiRadixCache, "_track_write_through_node")
    built = []

    def upstream_init(self, params, server_args):
        built.append(self)

    monkeypatch.setattr(HiRadixCache, "__init__", upstream_init)
    with pytest.raises(HookMismatchError, match=r"hook missing: sglang\.srt\.mem_cache\.hiradix_cache\."
                       r"HiRadixCache\._track_write_through_node \(private-helper"):
        build_cp_rank_stack(CpStackConfig(cp_size=2), 0)
    assert built == []


def test_the_plugin_says_so_when_it_registers(monkeypatch, caplog):
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

    monkeypatch.delattr(HiRadixCache, "_count_ready_acks")
    with caplog.at_level("WARNING", logger="sglang_cp_hicache.sglang_0518.plugin"):
        plugin.register()
    assert "HiRadixCache._count_ready_acks (private-helper" in caplog.text
    assert "building the CP cache will fail" in caplog.text


# ---- the registry covers what the adapter's source uses -------------------------------


def _adapter_classes(cls: type) -> list[type]:
    return [k for k in cls.__mro__ if k.__module__.startswith(OURS)]


def _tree(cls: type) -> ast.AST:
    return ast.parse(inspect.getsource(cls))


def _assigned_on_self(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    names.add(sub.attr)
    return names


def _used(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(names used as ``self.<name>``, names used as ``super().<name>``)."""
    on_self, on_super = set(), set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            on_self.add(node.attr)
        elif isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "super":
            on_super.add(node.attr)
    return on_self, on_super


FAMILIES = {
    CpHiRadixCache: ({"HiRadixCache"}, "HiRadixCache"),
    CpTreeNode: ({"TreeNode"}, "TreeNode"),
    CpSharedPagedTokenToKVPoolAllocator: (
        {"BaseTokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator"}, "BaseTokenToKVPoolAllocator"
    ),
}


#: What the cache's collaborators and the carried-over bodies call the cache.
CACHE_NAMES = {"cache", "tree"}


def _used_on_the_cache(path: pathlib.Path) -> set[str]:
    """Names a module uses on the cache held as ``tree`` / ``cache`` (or
    ``self.tree`` / ``self.cache``): the collaborators' way to SGLang's cache."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        if (isinstance(base, ast.Name) and base.id in CACHE_NAMES) or (
            isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) and base.value.id == "self"
            and base.attr.lstrip("_") in CACHE_NAMES
        ):
            names.add(node.attr)
    return names


@pytest.mark.parametrize("cls", list(FAMILIES), ids=lambda c: c.__name__)
def test_every_sglang_name_the_subclass_uses_is_registered(cls):
    owners, _ = FAMILIES[cls]
    ours = set().union(*(vars(k) for k in _adapter_classes(cls)))
    missing = []
    for klass in _adapter_classes(cls):
        tree = _tree(klass)
        ours |= _assigned_on_self(tree)
    for klass in _adapter_classes(cls):
        on_self, on_super = _used(_tree(klass))
        missing += [f"{klass.__name__}: self.{n}" for n in sorted(on_self - ours) if not registered(owners, n)]
        missing += [f"{klass.__name__}: super().{n}" for n in sorted(on_super) if not registered(owners, n)]
    if cls is CpHiRadixCache:  # the collaborators and upstream_0518 reach SGLang's cache as `tree`
        for path in ADAPTER_MODULES:
            used = _used_on_the_cache(path) - ours
            missing += [f"{path.stem}: tree.{n}" for n in sorted(used) if not registered(owners, n)]
    assert missing == []


@pytest.mark.parametrize("cls", list(FAMILIES), ids=lambda c: c.__name__)
def test_every_override_is_registered(cls):
    owners, base_name = FAMILIES[cls]
    base = next(k for k in cls.__mro__ if k.__name__ == base_name)
    overridden = {
        name for klass in _adapter_classes(cls) for name, value in vars(klass).items()
        if (not name.startswith("__") or name == "__init__")
        and (inspect.isfunction(value) or isinstance(value, (property, staticmethod, classmethod)))
    }
    overridden = {n for n in overridden if hasattr(base, n)}
    missing = sorted(n for n in overridden if not registered(owners, n, ("override",)))
    if cls is CpSharedPagedTokenToKVPoolAllocator:  # our own constructor; SGLang never builds it
        missing.remove("__init__")
    assert overridden and missing == []


def _imports(path: pathlib.Path) -> list[tuple[str, str]]:
    return [
        (node.module, alias.name)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "sglang"
        for alias in node.names
    ]


def test_every_sglang_import_is_registered():
    missing = [
        f"{path.name}: from {module} import {name}"
        for path in ADAPTER_MODULES
        for module, name in _imports(path)
        if not any(h.module == module and h.owner is None and h.attribute == name for h in HOOKS)
    ]
    assert missing == []


CONTROLLER = {"HybridCacheController"}
HOST_POOLS = {"MLATokenToKVPoolHost", "DSAIndexerPoolHost", "HostKVCache"}
# (how an expression names an SGLang object in the adapter's source) -> its owner classes
RECEIVERS = {
    ("attr", "cache_controller"): CONTROLLER,
    ("attr", "controller"): CONTROLLER,
    ("name", "ctrl"): CONTROLLER,
    ("name", "controller"): CONTROLLER,
    ("attr", "mem_pool_host"): {"HostPoolGroup"},
    ("name", "group"): {"HostPoolGroup"},
    ("attr", "anchor_entry"): {"PoolEntry"},
    ("name", "device_pool"): {"DSATokenToKVPool"},
    ("attr", "device_pool"): {"DSATokenToKVPool"},
    ("name", "entry"): {"PoolEntry"},
    ("name", "kv_entry"): {"PoolEntry"},
    ("name", "indexer_entry"): {"PoolEntry"},
    ("name", "pool"): HOST_POOLS,
    ("name", "indexer_pool"): HOST_POOLS,
    ("name", "host_pool"): HOST_POOLS | {"HostPoolGroup"},  # transfer_adapter: the group
    ("name", "kv_pool"): HOST_POOLS | {"DSATokenToKVPool"},  # hiradix: the device pool
    ("name", "req_pool"): {"ReqToTokenPool"},  # request_rows: the scheduler's request pool
}


def _receiver(node: ast.expr):
    if isinstance(node, ast.Name):
        return RECEIVERS.get(("name", node.id))
    if isinstance(node, ast.Attribute):
        return RECEIVERS.get(("attr", node.attr))
    return None


def _attribute_use(node: ast.AST):
    """(owner classes, attribute name) for ``<receiver>.name`` and
    ``getattr(<receiver>, "name", ...)``; None for anything else."""
    if isinstance(node, ast.Attribute):
        return _receiver(node.value), node.attr
    if (
        isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr")
        and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
    ):
        return _receiver(node.args[0]), node.args[1].value
    return None


def _bound_functions(tree: ast.AST) -> list[ast.FunctionDef]:
    """Functions defined outside classes whose first parameter is ``self``:
    the methods bound on SGLang instances (host pools, controller)."""
    in_classes = {id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in ast.walk(c)}
    return [
        f for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef) and id(f) not in in_classes and f.args.args and f.args.args[0].arg == "self"
    ]


def test_every_controller_and_pool_attribute_the_adapter_uses_is_registered():
    missing = []
    for path in ADAPTER_MODULES:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            used = _attribute_use(node)
            if used is not None and used[0] and not registered(*used):
                missing.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        for fn in _bound_functions(tree):
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                    if not registered(HOST_POOLS | CONTROLLER, node.attr):
                        missing.append(f"{path.name}:{node.lineno}: {ast.unparse(node)} (bound on an instance)")
    assert missing == []


def _bound_on_instances(cache) -> set[tuple[str, str]]:
    """(class, name) of every method bound on the controller or a host pool INSTANCE."""
    objects = [cache.cache_controller, *(e.host_pool for e in cache.cache_controller.mem_pool_host.entries)]
    return {
        (type(obj).__name__, name)
        for obj in objects for name, value in vars(obj).items() if isinstance(value, types.MethodType)
    }


def test_every_method_bound_on_an_sglang_instance_is_registered():
    """What a CP cache binds on upstream's instances, beyond what upstream
    binds itself (a plain HiRadixCache's), is exactly what the registry
    says is replaced there."""
    plain = build_cp_rank_stack(CpStackConfig(cp_size=1, cp_mode=False), 0)
    stack = build_cp_rank_stack(CpStackConfig(cp_size=2), 0)
    try:
        ours = _bound_on_instances(stack.cache) - _bound_on_instances(plain.cache)
        expected = {
            (h.owner, h.attribute) for h in HOOKS
            if h.kind == "replaced-on-instance" and h.owner in CONTROLLER | HOST_POOLS
        }
        assert ours == expected
        assert type(stack.cache.evictable_host_leaves).__name__ == "NoHostLeafSet"
        assert registered({"HiRadixCache"}, "evictable_host_leaves", ("replaced-on-instance",))
    finally:
        stack.close()
        plain.close()


@pytest.mark.parametrize("dropped, check", [
    ("_detach_backuped", lambda: test_every_sglang_name_the_subclass_uses_is_registered(CpHiRadixCache)),
    ("_track_write_through_node", lambda: test_every_sglang_name_the_subclass_uses_is_registered(CpHiRadixCache)),
    ("_copy_for_free_group",
     lambda: test_every_sglang_name_the_subclass_uses_is_registered(CpSharedPagedTokenToKVPoolAllocator)),
    ("_split_node", lambda: test_every_override_is_registered(CpHiRadixCache)),
    ("backuped", lambda: test_every_override_is_registered(CpTreeNode)),
    ("ack_load_queue", lambda: test_every_controller_and_pool_attribute_the_adapter_uses_is_registered()),
    ("device_pool", lambda: test_every_controller_and_pool_attribute_the_adapter_uses_is_registered()),
    ("mtp_draft_device_pools", lambda: test_every_controller_and_pool_attribute_the_adapter_uses_is_registered()),
    ("RadixKey", lambda: test_every_sglang_import_is_registered()),
], ids=lambda x: x if isinstance(x, str) else "")
def test_the_coverage_checks_catch_an_unregistered_name(dropped, check, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "HOOKS", tuple(h for h in HOOKS if h.attribute != dropped))
    with pytest.raises(AssertionError, match=dropped):
        check()
