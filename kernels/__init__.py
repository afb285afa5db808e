"""Page-copy kernels between SGLang host pools and DSA device pools under CP.

Shipped as ``sglang_cp_hicache.kernels`` (see pyproject's package-dir).
"""

from sglang_cp_hicache.kernels.reference import (
    HOST_LAYOUTS,
    backup_indexer_all_layers_reference,
    backup_kv_all_layers_reference,
    load_indexer_one_layer_reference,
    load_kv_one_layer_reference,
)

__all__ = [
    "HOST_LAYOUTS",
    "backup_indexer_all_layers_reference",
    "backup_kv_all_layers_reference",
    "load_indexer_one_layer_reference",
    "load_kv_one_layer_reference",
]
