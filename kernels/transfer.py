"""The front door of the page copies: one call per operation, dispatched per
call to a backend (compiled Triton for CUDA buffers, Triton's interpreter for
CPU buffers under ``TRITON_INTERPRET=1``, the plain-torch reference
otherwise: :func:`select_backend`, table in :mod:`._backend`), counted, and
warmed up at server start.

The four copies (``backup_kv_all_layers``, ``load_kv_one_layer``,
``backup_indexer_all_layers``, ``load_indexer_one_layer``) are generated from
the :mod:`.reference` functions: same signatures, same semantics, same
argument errors on every backend. Each successful call is counted
(:func:`copy_stats`); interpreted launches are serialised process-wide by the
launcher, so threaded CP ranks can share the interpreter.
"""

from __future__ import annotations

import functools
import inspect
import threading
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from sglang_cp_hicache.kernels import cp_page_copy as _triton
from sglang_cp_hicache.kernels import reference as _reference
from sglang_cp_hicache.kernels._backend import BACKENDS, backend_of, select_backend
from sglang_cp_hicache.kernels.compile import WarmupReport, warmup
from sglang_cp_hicache.placement import CpPlacement

__all__ = [
    "BACKENDS",
    "CopyStats",
    "WarmupReport",
    "backup_indexer_all_layers",
    "backup_kv_all_layers",
    "copy_stats",
    "load_indexer_one_layer",
    "load_kv_one_layer",
    "reset_copy_stats",
    "select_backend",
    "warmup",
]


# ----------------------------------------------------------------------------- counters
@dataclass(frozen=True)
class CopyStats:
    """Copies made through this module since the last :func:`reset_copy_stats`
    (process-wide: threaded ranks add up).

    ``pages_copied`` counts the owned pages of each call (``len(host_locs) //
    page_size``, known on the host without reading device memory); a backup
    of L layers counts each page once. ``backend`` and ``cp_size`` are the
    last call's (None before the first).
    """

    backend: str | None = None
    kv_backup_calls: int = 0
    kv_load_calls: int = 0
    indexer_backup_calls: int = 0
    indexer_load_calls: int = 0
    cp_size: int | None = None
    pages_copied: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


_STATS_LOCK = threading.Lock()
_stats = CopyStats()


def copy_stats() -> CopyStats:
    """A snapshot of the copy counters."""
    with _STATS_LOCK:
        return _stats


def reset_copy_stats() -> None:
    global _stats
    with _STATS_LOCK:
        _stats = CopyStats()


def _record(counter: str, backend: str, layout: CpPlacement, host_locs: torch.Tensor) -> None:
    global _stats
    with _STATS_LOCK:
        s = _stats
        _stats = CopyStats(
            **{
                **asdict(s),
                counter: getattr(s, counter) + 1,
                "backend": backend,
                "cp_size": layout.cp_size,
                "pages_copied": s.pages_copied + host_locs.numel() // layout.page_size,
            }
        )


# ----------------------------------------------------------------------------- the four copies
def _dispatcher(name: str, counter: str) -> Callable[..., None]:
    """``name`` with the reference's signature, run on the backend
    :func:`select_backend` picks for its device buffers (first argument)."""
    ref = getattr(_reference, f"{name}_reference")
    params = list(inspect.signature(ref).parameters)
    buffers_at, host_locs_at, layout_at = 0, params.index("host_locs"), params.index("layout")

    def arg(args: tuple, kwargs: dict, at: int):
        return args[at] if len(args) > at else kwargs.get(params[at])

    @functools.wraps(ref)
    def dispatch(*args, **kwargs) -> None:
        backend = backend_of(arg(args, kwargs, buffers_at))
        # Looked up per call, so a test can wrap either implementation.
        impl = getattr(_reference, f"{name}_reference") if backend == "reference" else getattr(_triton, name)
        impl(*args, **kwargs)
        _record(counter, backend, arg(args, kwargs, layout_at), arg(args, kwargs, host_locs_at))

    dispatch.__name__ = dispatch.__qualname__ = name
    dispatch.__module__ = __name__
    dispatch.__doc__ = (
        f"{ref.__doc__}\n\nRuns on the Triton kernels (compiled on CUDA, interpreted on CPU with "
        f"TRITON_INTERPRET=1) or the torch reference; see :func:`select_backend`."
    )
    return dispatch


backup_kv_all_layers = _dispatcher("backup_kv_all_layers", "kv_backup_calls")
load_kv_one_layer = _dispatcher("load_kv_one_layer", "kv_load_calls")
backup_indexer_all_layers = _dispatcher("backup_indexer_all_layers", "indexer_backup_calls")
load_indexer_one_layer = _dispatcher("load_indexer_one_layer", "indexer_load_calls")
