"""The front door of the page copies: the four copies, each run on the
backend :func:`select_backend` picks for the device its device buffers live
on (compiled Triton for CUDA, Triton's interpreter for CPU under
``TRITON_INTERPRET=1``, the plain-torch reference otherwise; table in
:mod:`._backend`), counted (:func:`copy_stats`), and warmed up at server
start (:func:`warmup`).

Each copy checks every argument on every call, with the same argument errors
on every backend. A server copying between the same pools again and again
binds them once instead, through the other door, :mod:`.bound`
(:func:`~.bound.bind_kv_copies`, :func:`~.bound.bind_indexer_copies`): buffers checked at bind time, only the
index tensors per call, same backend rule and counters.

Interpreted launches are serialised process-wide by the launcher, so
threaded CP ranks can share the interpreter.
"""

from __future__ import annotations

from ._backend import BACKENDS, run_counted, select_backend
from ._copies import CopyFunctions
from ._stats import CopyStats, copy_stats, reset_copy_stats
from .compile import WarmupReport, warmup

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


# The four copies (signatures, arguments and buffer checks in
# :class:`~._copies.CopyFunctions`, shared with both backends).
_COPIES = CopyFunctions(run_counted)
backup_kv_all_layers = _COPIES.backup_kv_all_layers
load_kv_one_layer = _COPIES.load_kv_one_layer
backup_indexer_all_layers = _COPIES.backup_indexer_all_layers
load_indexer_one_layer = _COPIES.load_indexer_one_layer
