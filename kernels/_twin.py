"""The kernel in the flavour a launch needs: compiled or interpreted.

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` runs, i.e. when
:mod:`._kernel` is imported. CPU tensors can only run under the interpreter
and CUDA tensors want the compiled kernel, so the flavour that import did not
produce is built from a second copy of ``_kernel.py`` (a "twin"), loaded once
with ``_FORCE_INTERPRET`` in its globals. The environment is never changed.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from types import ModuleType

from . import _kernel

__all__ = ["is_interpreted", "kernel_for", "kernel_module_for"]

_TWINS: dict[bool, ModuleType] = {}
_LOCK = threading.Lock()


def is_interpreted(kernel: object) -> bool:
    """Whether a ``@triton.jit`` object runs under Triton's interpreter."""
    return _kernel._is_interpreted(kernel)


def kernel_module_for(interpret: bool) -> ModuleType:
    """``_kernel`` itself if its flavour is ``interpret``, else its twin."""
    if _kernel.INTERPRETED == interpret:
        return _kernel
    with _LOCK:
        twin = _TWINS.get(interpret)
        if twin is None:
            name = f"{_kernel.__name__}__{'interpreted' if interpret else 'compiled'}"
            spec = importlib.util.spec_from_file_location(name, _kernel.__file__)
            twin = importlib.util.module_from_spec(spec)
            twin._FORCE_INTERPRET = interpret
            sys.modules[name] = twin
            try:
                spec.loader.exec_module(twin)
            except BaseException:
                sys.modules.pop(name, None)
                raise
            if twin.INTERPRETED != interpret:
                raise RuntimeError(f"kernel twin {name} loaded in the wrong flavour")
            _TWINS[interpret] = twin
    return twin


def kernel_for(interpret: bool):
    """``_copy_pages_kernel`` run by Triton's interpreter, or compiled for the GPU."""
    return kernel_module_for(interpret)._copy_pages_kernel
