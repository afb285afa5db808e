"""Page-copy kernels between SGLang host pools and DSA device pools under CP.

Shipped as ``sglang_cp_hicache.kernels`` (see pyproject's package-dir).

Two public doors, one per way of calling:

* :mod:`.transfer` -- every call: the four copies, each run on the backend
  one rule picks per call (compiled Triton, Triton's interpreter, or the
  torch reference), copy counters, and :func:`~.transfer.warmup`.
* :mod:`.bound` -- the same copies bound to one pool's buffers, checked once
  (:func:`~.bound.bind_kv_copies`, :func:`~.bound.bind_indexer_copies`).

Behind them: :mod:`.reference` (the plain-torch reference, also the CPU
backend), :mod:`.compile` (warm-up and offline compilation), and the private
modules :mod:`._triton_launch` (the Triton launchers, with extra tuning
arguments, for the kernel's own tests and benchmarks), :mod:`._kernel` (the
kernel), :mod:`._twin` (its compiled/interpreted flavours),
:mod:`._launch_spec` (what a launch needs), :mod:`._copies` (the four
copies' signatures and buffer checks, written once for every backend),
:mod:`._checks` (argument checks), :mod:`._backend` (the backend rule),
:mod:`._stats` (copy counters).

Code outside this folder imports this package's face or its two doors,
never a private module: the supported host layouts (``HOST_LAYOUTS``, the
one list) and the debug switch (``debug_enabled``) are handed on here.
Inside it, imports are relative, so tools follow them from the folder.

This package exports no copy function itself: a copy is called as
``transfer.backup_kv_all_layers(...)`` (or through a bound ``PoolCopies``),
so one name means one thing.
"""

from ._checks import DEBUG_ENV, HOST_LAYOUTS, debug_enabled
from ._kernel import DEFAULT_BLOCK_BYTES, DEFAULT_NUM_CTAS
from .bound import PoolCopies, as_locs, bind_indexer_copies, bind_kv_copies
from .compile import WarmupReport, compile_offline, warmup

__all__ = [
    "DEBUG_ENV",
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_NUM_CTAS",
    "HOST_LAYOUTS",
    "PoolCopies",
    "WarmupReport",
    "as_locs",
    "bind_indexer_copies",
    "bind_kv_copies",
    "compile_offline",
    "debug_enabled",
    "warmup",
]
