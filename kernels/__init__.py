"""Page-copy kernels between SGLang host pools and DSA device pools under CP.

Shipped as ``sglang_cp_hicache.kernels`` (see pyproject's package-dir).

* :mod:`.transfer` -- the front door: the four copies, each run on the
  backend one rule picks per call (compiled Triton, Triton's interpreter, or
  the torch reference), copy counters, and :func:`~.transfer.warmup`.
* :mod:`.bound` -- the same copies bound to one pool's buffers, checked once
  (:func:`~.bound.bind_kv_copies`, :func:`~.bound.bind_indexer_copies`).
* :mod:`.cp_page_copy` -- the Triton launchers (extra tuning arguments).
* :mod:`.reference` -- the plain-torch reference, also the CPU backend.
* :mod:`.compile` -- warm-up and offline compilation.
* :mod:`._kernel` (the kernel), :mod:`._twin` (its compiled/interpreted
  flavours), :mod:`._launch_spec` (what a launch needs), :mod:`._checks`
  (argument checks), :mod:`._backend` (the backend rule), :mod:`._stats`
  (copy counters).
"""

from sglang_cp_hicache.kernels._checks import DEBUG_ENV, HOST_LAYOUTS
from sglang_cp_hicache.kernels.bound import PoolCopies, bind_indexer_copies, bind_kv_copies
from sglang_cp_hicache.kernels.compile import WarmupReport, compile_offline, warmup
from sglang_cp_hicache.kernels.cp_page_copy import (
    DEFAULT_BLOCK_BYTES,
    DEFAULT_NUM_CTAS,
    backup_indexer_all_layers,
    backup_kv_all_layers,
    load_indexer_one_layer,
    load_kv_one_layer,
)
from sglang_cp_hicache.kernels.reference import (
    backup_indexer_all_layers_reference,
    backup_kv_all_layers_reference,
    load_indexer_one_layer_reference,
    load_kv_one_layer_reference,
)

__all__ = [
    "DEBUG_ENV",
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_NUM_CTAS",
    "HOST_LAYOUTS",
    "PoolCopies",
    "WarmupReport",
    "backup_indexer_all_layers",
    "backup_indexer_all_layers_reference",
    "backup_kv_all_layers",
    "backup_kv_all_layers_reference",
    "bind_indexer_copies",
    "bind_kv_copies",
    "compile_offline",
    "load_indexer_one_layer",
    "load_indexer_one_layer_reference",
    "load_kv_one_layer",
    "load_kv_one_layer_reference",
    "warmup",
]
