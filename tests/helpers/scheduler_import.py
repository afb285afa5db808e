"""Import SGLang's ``Scheduler`` class on the CPU harness.

The scheduler module imports a web stack and helpers the harness does not
install; the methods the tests call (storage admin handlers, prefetch) use
none of them, so missing ones get import-only stand-ins: a module whose
attributes are empty classes. Nothing is installed; installed modules are
used as they are.
"""

from __future__ import annotations

import importlib.util
import sys
import types

_STAND_INS = (("setproctitle", ()), ("einops", ()), ("uvicorn", ()), ("fastapi", ("responses",)))


class _Anything:
    """Whatever a module-level use asks of it: constructed, called, used as
    a decorator (returns the function), its attributes the same."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _Anything()

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()


def _stand_in_attribute(name: str):
    if name.startswith("__"):  # module metadata (__file__, __spec__, ...) stays absent
        raise AttributeError(name)
    return type(name, (_Anything,), {})


def scheduler_class() -> type:
    """``sglang.srt.managers.scheduler.Scheduler`` (of the installed release)."""
    for top, subs in _STAND_INS:
        if top in sys.modules or importlib.util.find_spec(top) is not None:
            continue
        for name in (top, *(f"{top}.{sub}" for sub in subs)):
            stub = types.ModuleType(name)
            stub.__path__ = []
            stub.__getattr__ = _stand_in_attribute
            sys.modules[name] = stub
    from sglang.srt.managers.scheduler import Scheduler

    return Scheduler
