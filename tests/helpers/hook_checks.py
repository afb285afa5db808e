"""What both releases' hook-registry tests do to SGLang: take a registered
name away, as a release that renamed it would."""

from __future__ import annotations

import enum
import importlib
from typing import Callable

import pytest

from sglang_cp_hicache import hook_registry

__all__ = ["check_registry_shape", "missing_hook_message", "remove_hook"]


def remove_hook(
    monkeypatch: pytest.MonkeyPatch, hook: hook_registry.Hook, hooks: tuple[hook_registry.Hook, ...]
) -> None:
    """Make ``hook``'s target absent, as a release that renamed it would: a
    module attribute is deleted, an enum member left out of a rebuilt enum,
    a class attribute deleted from every SGLang class of the owner's MRO that
    defines it, and an instance attribute dropped from what the registry
    finds its owner's classes assigning. Every module of ``hooks`` is
    imported first, as SGLang has them when the adapter checks: a module
    first imported after the removal would fail to import and be named
    instead (which tests ran before in the process must not matter)."""
    for other in hooks:
        importlib.import_module(other.module)
    module = importlib.import_module(hook.module)
    if hook.owner is None:
        monkeypatch.delattr(module, hook.attribute)
        return
    owner = getattr(module, hook.owner)
    if isinstance(owner, enum.EnumMeta):  # enum members cannot be deleted
        kept = {m.name: m.value for m in owner if m.name != hook.attribute}
        monkeypatch.setattr(module, hook.owner, enum.Enum(owner.__name__, kept))
        return
    for klass in owner.__mro__:
        if klass.__module__.split(".")[0] == "sglang" and hook.attribute in vars(klass):
            monkeypatch.delattr(klass, hook.attribute)
    # An instance attribute: a release whose classes no longer assign it.
    scan = hook_registry._instance_attributes
    monkeypatch.setattr(
        hook_registry, "_instance_attributes", lambda cls: scan(cls) - {hook.attribute} if cls is owner else scan(cls)
    )


def missing_hook_message(
    monkeypatch: pytest.MonkeyPatch, hook: hook_registry.Hook, hooks: tuple[hook_registry.Hook, ...],
    check_hooks: Callable[[], None],
) -> str:
    """The refusal ``check_hooks`` gives once ``hook`` is taken away: it
    must name exactly that hook."""
    remove_hook(monkeypatch, hook, hooks)
    with pytest.raises(hook_registry.HookMismatchError) as err:
        check_hooks()
    assert err.value.hook is hook
    return str(err.value)


def check_registry_shape(hooks: tuple[hook_registry.Hook, ...], params_kinds: tuple[str, ...]) -> None:
    """Each hook named once, on an SGLang module, with the reason the adapter
    needs it; the kinds in ``params_kinds`` carry their parameters; what is
    overridden, called as a private helper or replaced on an instance names
    its owner class; an unknown kind is refused."""
    names = [h.name for h in hooks]
    assert len(names) == len(set(names))
    for hook in hooks:
        assert hook.module.startswith("sglang") and hook.why, hook.name
        if hook.kind in params_kinds:
            assert hook.params is not None, hook.name
        if hook.kind in ("override", "private-helper", "replaced-on-instance"):
            assert hook.owner is not None, hook.name
    with pytest.raises(ValueError, match="kind must be one of"):
        hook_registry.Hook("sglang", None, "x", "patched", None, "")


def registry_tests(hooks: tuple[hook_registry.Hook, ...], check_hooks: Callable[[], None],
                   find_problem: Callable[[hook_registry.Hook], object], params_kinds: tuple[str, ...]) -> tuple:
    """A release's three registry tests (the installed release passes,
    every hook resolves, the registry keeps its shape), for its test module
    to bind to test names."""

    def test_the_installed_release_passes() -> None:
        check_hooks()

    @pytest.mark.parametrize("hook", hooks, ids=lambda h: h.name)
    def test_every_hook_resolves(hook: hook_registry.Hook) -> None:
        assert find_problem(hook) is None

    def test_the_registry_names_each_hook_once_and_keeps_its_shape() -> None:
        check_registry_shape(hooks, params_kinds=params_kinds)

    return (test_the_installed_release_passes, test_every_hook_resolves,
            test_the_registry_names_each_hook_once_and_keeps_its_shape)
