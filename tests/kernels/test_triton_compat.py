"""kernels/_triton_compat.py: the triton 3.6 interpreter fix is installed
exactly where triton + numpy need it, makes a runtime loop bound work under
the interpreter there, and is absent everywhere else (a no-op)."""

from __future__ import annotations

import numpy
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from sglang_cp_hicache.kernels import _kernel, _triton_compat

AFFECTED_HERE = _triton_compat.shim_needed(triton.__version__, numpy.__version__)
HERE = f"triton {triton.__version__} + numpy {numpy.__version__}"


@pytest.mark.parametrize(
    ("triton_version", "numpy_version", "needed"),
    [
        ("3.6.0", "2.4.6", True),
        ("3.6.1", "2.5.0", True),
        ("3.6.0+git1a2b3c", "2.4.0rc1", True),
        ("3.6.0", "2.3.5", False),  # numpy < 2.4 only warns
        ("3.6.0", "1.26.4", False),
        ("3.7.0", "2.4.6", False),  # fixed upstream from 3.7
        ("3.9.0", "2.5.0", False),
        ("3.5.1", "2.4.6", False),  # outside the verified range: left alone
    ],
)
def test_shim_needed_only_on_triton_3_6_with_numpy_2_4_or_later(triton_version, numpy_version, needed):
    assert _triton_compat.shim_needed(triton_version, numpy_version) is needed


def test_unreadable_version_is_refused_by_name():
    with pytest.raises(ValueError, match="version: cannot read"):
        _triton_compat.shim_needed("dev", "2.4.0")


def test_shim_is_installed_exactly_when_this_environment_needs_it():
    assert _triton_compat.APPLIED is AFFECTED_HERE, HERE
    assert _triton_compat.is_applied() is AFFECTED_HERE, HERE
    assert _triton_compat.apply() is AFFECTED_HERE  # idempotent
    patch = interpreter._patch_lang_tensor
    assert _triton_compat.is_applied() is AFFECTED_HERE
    if AFFECTED_HERE:
        assert patch.__wrapped__.__module__ == interpreter.__name__  # wraps triton's own, once
        assert not getattr(patch.__wrapped__, "__sglang_cp_hicache_index_shim__", False)
    else:
        assert patch.__module__ == interpreter.__name__  # triton's own function, untouched


def test_the_kernel_module_imports_the_shim():
    assert _kernel._triton_compat is _triton_compat


def _sum_below(n_ptr, out_ptr):
    # The loop bound is a runtime value: the interpreter converts it with __index__.
    n = tl.load(n_ptr)
    acc = n - n  # builtins only: tl.zeros & co. have the flavour triton was imported with
    for i in range(0, n):
        acc += i
    tl.store(out_ptr, acc)


def _run_interpreted(n: int) -> int:
    kernel = interpreter.InterpretedFunction(_sum_below)
    out = torch.full((1,), -1, dtype=torch.int64)
    kernel[(1,)](torch.tensor([n], dtype=torch.int64), out)
    return int(out.item())


def test_runtime_loop_bound_runs_under_the_interpreter():
    assert _run_interpreted(7) == 21
    assert _run_interpreted(0) == 0
    # the launch's own patches are undone afterwards, the shim's included
    assert getattr(tl.core.tensor, "__index__", None) is not _triton_compat._index


@pytest.mark.skipif(not AFFECTED_HERE, reason=f"{HERE} interpret loop bounds correctly without the shim")
def test_without_the_shim_the_affected_interpreter_fails(monkeypatch):
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", interpreter._patch_lang_tensor.__wrapped__)
    with pytest.raises(Exception, match="only 0-dimensional arrays can be converted"):
        _run_interpreted(7)
