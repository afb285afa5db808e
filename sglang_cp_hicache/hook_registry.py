"""The shape of an adapter's hook registry and how it is checked (both releases).

Each adapter lists every SGLang name it depends on -- methods it overrides,
attributes it replaces on live instances, private helpers it calls, classes,
fields and queues it reads or edits in place, public functions it calls with
named arguments -- as :class:`Hook` entries in its own ``hooks`` module, read
from one SGLang release. :func:`check_hooks` resolves every entry in the
installed SGLang and raises :class:`HookMismatchError` naming the FIRST one
that is missing or whose parameter names changed, so a release that renamed
one refuses to start by name instead of failing in the middle of a request.
Parameter names are compared exactly (``self`` included for methods): a new
optional parameter of an overridden method is one SGLang may start passing.

Resolution: ``module`` is imported; ``owner`` (if any) is a class in it; the
attribute is found on the owner's MRO (methods, properties, class
attributes, enum members) or, for instance attributes (queues, node fields),
declared in an SGLang class of the MRO (annotations, dataclass or msgspec
fields) or assigned as ``self.<name>`` in its source. Registries list
classes first, so a missing class is named as the class, not as a later
hook on it.

Importing this module imports no SGLang; checking does.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

__all__ = [
    "KINDS", "Hook", "HookMismatchError", "Kind", "attribute_hooks", "check_hooks", "find_problem", "owner_hooks",
    "page_byte_hooks", "self_targets",
]

Kind = Literal["override", "replaced-on-instance", "private-helper", "attribute", "call"]
KINDS: tuple[str, ...] = ("override", "replaced-on-instance", "private-helper", "attribute", "call")


@dataclass(frozen=True)
class Hook:
    """One SGLang name an adapter depends on.

    ``kind``: ``override`` -- a method the adapter's subclass replaces (SGLang
    calls it with ``params``); ``replaced-on-instance`` -- a method or
    attribute the adapter overwrites on each instance after upstream's
    ``__init__``; ``private-helper`` -- a private method or function the
    adapter calls; ``attribute`` -- a class, value, field or queue the adapter
    reads or edits in place; ``call`` -- a public function, method or class
    the adapter calls with arguments it names. ``params``: the exact
    parameter names, or None where nothing is called with arguments.
    ``why`` completes "the adapter needs it because it ...".
    """

    module: str
    owner: Optional[str]
    attribute: str
    kind: Kind
    params: Optional[tuple[str, ...]]
    why: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def name(self) -> str:
        owner = f"{self.owner}." if self.owner else ""
        return f"{self.module}.{owner}{self.attribute}"


def owner_hooks(module: str, owner: Optional[str]) -> Callable[[str, Kind, Optional[tuple[str, ...]], str], Hook]:
    """A maker of the hooks on one ``owner`` class of ``module`` (None: the
    module's own names): ``make(attribute, kind, params, why)``."""
    return functools.partial(Hook, module, owner)


def attribute_hooks(module: str, owner: str, names: str, why: str) -> tuple[Hook, ...]:
    """One ``attribute`` hook per space-separated name read on ``owner``."""
    return tuple(Hook(module, owner, n, "attribute", None, why) for n in names.split())


def page_byte_hooks(kv_module: str, indexer_module: str) -> tuple[Hook, ...]:
    """The host pools' page methods the L3 tier reads and restores pages with (alike on both releases)."""
    pools = ((kv_module, "MLATokenToKVPoolHost", "KV"), (indexer_module, "DSAIndexerPoolHost", "indexer"))
    return tuple(hook for module, owner, what in pools for hook in (
        Hook(module, owner, "get_data_page", "call", ("self", "index", "flat"),
             f"reads an owned page's {what} bytes for L3 (flat=False: the view a verified L3 page is copied into)"),
        Hook(module, owner, "set_from_flat_data_page", "call", ("self", "index", "data_page"),
             f"puts a verified L3 page's {what} bytes into the host pool where the page view is not the pool's own")))


class HookMismatchError(RuntimeError):
    """The installed SGLang lacks or changed a name an adapter depends on."""

    def __init__(self, hook: Hook, problem: str, installed: str, read_from: str, remedy: str = "") -> None:
        self.hook = hook
        what = "missing" if problem.startswith(("is missing", "cannot be imported")) else "changed"
        super().__init__(
            f"SGLang {read_from} hook {what}: {hook.name} ({hook.kind}) {problem} in the installed "
            f"sglang {installed}; the adapter needs it because it {hook.why}. "
            f"This adapter was written against sglang {read_from}.{' ' + remedy if remedy else ''}"
        )


def self_targets(tree: ast.AST) -> set[str]:
    """Names assigned as ``self.<name>`` anywhere in ``tree``."""
    names = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        )
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    names.add(sub.attr)
    return names


@functools.lru_cache(maxsize=None)
def _module_tree(path: str) -> Optional[ast.Module]:
    """One source file's syntax tree, parsed once per process (a class-by-class
    ``inspect.getsource`` re-parses and re-tokenizes the whole file for every
    class: seconds at every start of a rank process)."""
    try:
        with open(path, encoding="utf-8") as f:
            return ast.parse(f.read(), path)
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None


def _class_node(klass: type) -> Optional[ast.ClassDef]:
    """The ``class`` statement that defined ``klass``, found by its qualified
    name in its module's source; None without source (built-in, generated)."""
    try:
        path = inspect.getsourcefile(klass)
    except TypeError:
        return None
    tree = _module_tree(path) if path else None
    if tree is None or "<locals>" in klass.__qualname__:
        return None
    body: list[ast.stmt] = tree.body
    found: Optional[ast.ClassDef] = None
    for part in klass.__qualname__.split("."):
        # The last definition of a name wins, as at import.
        found = next((n for n in reversed(body) if isinstance(n, ast.ClassDef) and n.name == part), None)
        if found is None:
            return None
        body = found.body
    return found


@functools.lru_cache(maxsize=None)
def _instance_attributes(cls: type) -> frozenset[str]:
    """Instance attributes the SGLang classes of ``cls``'s MRO declare
    (annotations, dataclass / msgspec fields) or assign as ``self.<name>``."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("sglang"):
            continue
        names.update(vars(klass).get("__annotations__", {}))
        names.update(getattr(klass, "__struct_fields__", ()))
        names.update(getattr(klass, "__dataclass_fields__", {}))
        node = _class_node(klass)
        if node is not None:  # without source, its declarations above still count
            names.update(self_targets(node))
    return frozenset(names)


def _target(hook: Hook) -> tuple[Any, Optional[str]]:
    """(the resolved object or None, the problem or None)."""
    try:
        module = importlib.import_module(hook.module)
    except ImportError as exc:
        return None, f"cannot be imported ({exc})"
    if hook.owner is None:
        if not hasattr(module, hook.attribute):
            return None, f"is missing: module {hook.module} has no {hook.attribute}"
        return getattr(module, hook.attribute), None
    owner = getattr(module, hook.owner, None)
    if not isinstance(owner, type):
        return None, f"is missing: module {hook.module} has no class {hook.owner}"
    if any(hook.attribute in vars(klass) for klass in owner.__mro__):
        return getattr(owner, hook.attribute), None
    if hook.attribute in _instance_attributes(owner):
        return None, None  # an instance attribute: nothing to call
    return None, f"is missing: {hook.owner} no longer has {hook.attribute}"


def find_problem(hook: Hook) -> Optional[str]:
    """What is wrong with ``hook`` in the installed SGLang, or None."""
    target, problem = _target(hook)
    if problem is not None or hook.params is None:
        return problem
    if hook.kind in ("override", "private-helper") and not callable(target):
        return f"is no longer callable (found {type(target).__name__})"
    try:
        found = tuple(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return "has no inspectable signature"
    if found != hook.params:
        return f"changed its parameters: expected {list(hook.params)}, found {list(found)}"
    return None


#: CP ranks run as threads of one process build their caches at once; the
#: source parsing behind the check is not safe to run concurrently in CPython.
_CHECK_LOCK = threading.Lock()


def check_hooks(hooks: tuple[Hook, ...], read_from: str, remedy: str = "") -> None:
    """Raise :class:`HookMismatchError` naming the first of ``hooks`` that is
    missing or changed in the installed SGLang (read from ``read_from``)."""
    with _CHECK_LOCK:
        for hook in hooks:
            problem = find_problem(hook)
            if problem is not None:
                # Resolving the hooks imported SGLang (if it is installed at all).
                installed = getattr(sys.modules.get("sglang"), "__version__", "(unknown)")
                raise HookMismatchError(hook, problem, installed, read_from, remedy)
