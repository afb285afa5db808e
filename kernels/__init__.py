"""Page-copy kernels between SGLang host pools and DSA device pools under CP.

Shipped as ``sglang_cp_hicache.kernels`` (see pyproject's package-dir).

* :mod:`.cp_page_copy` -- the Triton kernels and their launchers (compiled on
  CUDA tensors, Triton's interpreter on CPU tensors), ``warmup`` and
  ``compile_offline``.
* :mod:`.reference` -- the plain-torch reference, also the CPU backend.

:mod:`sglang_cp_hicache.transfer` picks between them.
"""

from sglang_cp_hicache.kernels._checks import DEBUG_ENV, HOST_LAYOUTS
from sglang_cp_hicache.kernels.cp_page_copy import (
    DEFAULT_BLOCK_BYTES,
    DEFAULT_NUM_CTAS,
    backup_indexer_all_layers,
    backup_kv_all_layers,
    compile_offline,
    load_indexer_one_layer,
    load_kv_one_layer,
    warmup,
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
    "backup_indexer_all_layers",
    "backup_indexer_all_layers_reference",
    "backup_kv_all_layers",
    "backup_kv_all_layers_reference",
    "compile_offline",
    "load_indexer_one_layer",
    "load_indexer_one_layer_reference",
    "load_kv_one_layer",
    "load_kv_one_layer_reference",
    "warmup",
]
