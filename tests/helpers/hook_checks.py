"""What both releases' hook-registry tests do to SGLang: take a registered
name away, as a release that renamed it would."""

from __future__ import annotations

import enum
import importlib

import pytest

from sglang_cp_hicache import hook_registry

__all__ = ["check_registry_shape", "remove_hook"]


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
