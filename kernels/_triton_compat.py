"""A guarded fix for Triton 3.6's interpreter under numpy >= 2.4.

Triton's interpreter gives ``tl.tensor`` an ``__index__`` so that ``range()``
accepts runtime loop bounds; it calls ``int()`` on the tensor's numpy data,
which for a scalar is a 1-element array with one dimension. numpy 2.4 made
``int()`` of any array with ``ndim > 0`` a ``TypeError`` ("only 0-dimensional
arrays can be converted to Python scalars"; numpy 1.25-2.3 only warned), so
every launch of a kernel with a runtime loop bound fails under
``TRITON_INTERPRET=1``. Triton 3.7 converts ``data.squeeze()`` instead; this
module makes 3.6 do the same.

It acts only where it is needed: triton 3.6.x (3.6.0 fails; 3.7.0 and later
carry the fix) with numpy >= 2.4; everywhere else :func:`apply` changes
nothing. It wraps the interpreter's per-launch tensor patching
(``triton.runtime.interpreter._patch_lang_tensor``), so it touches
interpreted launches only: compiled kernels never run that function. Drop
this module when triton 3.6 is no longer supported.
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import Any, Callable

import numpy
import triton

__all__ = ["AFFECTED_TRITON", "APPLIED", "FIRST_RAISING_NUMPY", "apply", "is_applied", "shim_needed"]

# [first, end) of the triton releases whose interpreter converts with a bare int().
AFFECTED_TRITON = ((3, 6), (3, 7))
# The first numpy whose int() raises on a 1-element, 1-dimensional array.
FIRST_RAISING_NUMPY = (2, 4)

_MARK = "__sglang_cp_hicache_index_shim__"


def _release(version: str) -> tuple[int, ...]:
    """Leading numeric release of a version string ("3.6.0+git1a2b" -> (3, 6, 0))."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    if match is None:
        raise ValueError(f"version: cannot read a release number from {version!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def shim_needed(triton_version: str, numpy_version: str) -> bool:
    """Whether this triton + numpy pair has the interpreter's ``int()`` failure."""
    first, end = AFFECTED_TRITON
    return first <= _release(triton_version)[:2] < end and _release(numpy_version)[:2] >= FIRST_RAISING_NUMPY


def _index(self: Any) -> int:
    # Triton 3.7's own conversion: a 1-element array becomes 0-dimensional first.
    return int(self.handle.data.squeeze())


def _wrap(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def _patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        # Through the launch's scope, so the interpreter restores it afterwards.
        scope.set_attr(tensor, "__index__", _index)

    setattr(_patch_lang_tensor, _MARK, True)
    return _patch_lang_tensor


def is_applied() -> bool:
    """Whether the interpreter currently runs with this shim."""
    from triton.runtime import interpreter

    return bool(getattr(getattr(interpreter, "_patch_lang_tensor", None), _MARK, False))


def apply() -> bool:
    """Install the shim if the installed triton and numpy need it (idempotent).

    Returns whether the shim is in place. An affected triton whose interpreter
    lacks the expected function gets a warning and no patch.
    """
    if not shim_needed(triton.__version__, numpy.__version__):
        return False
    from triton.runtime import interpreter

    if is_applied():
        return True
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        warnings.warn(
            f"triton {triton.__version__}: triton.runtime.interpreter._patch_lang_tensor not found; "
            "the numpy >= 2.4 interpreter fix is not applied",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    interpreter._patch_lang_tensor = _wrap(original)
    return True


APPLIED = apply()
