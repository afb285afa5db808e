"""Context-parallel (CP shared KV) support for SGLang's hierarchical KV cache.

Everything importable from here needs only torch; the SGLang adapter lives in
``sglang_cp_hicache.sglang`` and the kernels in ``sglang_cp_hicache.kernels``.
"""

from sglang_cp_hicache.allocator import OwnerLaneAllocator
from sglang_cp_hicache.controller import (
    CpAck,
    CpHiCacheController,
    CpLoadOp,
    CpLoadPlan,
    CpWriteOp,
    HiCacheWriteFailure,
    HiCacheWriteResult,
    map_cp_load,
    map_cp_write,
)
from sglang_cp_hicache.host_eviction import (
    HostEvictionResult,
    HostLeafIndex,
    HostSlotLedger,
    evict_host_slots,
    is_host_leaf,
)
from sglang_cp_hicache.layout import CpSharedKVLayout
from sglang_cp_hicache.load_back import LoadBackOutcome, collect_evicted_chain, cp_load_back
from sglang_cp_hicache.metadata import CpHiCacheNodeMetadata
from sglang_cp_hicache.node_state import (
    HostClearResult,
    clear_host_state,
    is_backed_up,
    logical_host_len,
    set_host_state,
    split_host_state,
)

__all__ = [
    "CpAck",
    "CpHiCacheController",
    "CpHiCacheNodeMetadata",
    "CpLoadOp",
    "CpLoadPlan",
    "CpSharedKVLayout",
    "CpWriteOp",
    "HiCacheWriteFailure",
    "HiCacheWriteResult",
    "HostClearResult",
    "HostEvictionResult",
    "HostLeafIndex",
    "HostSlotLedger",
    "LoadBackOutcome",
    "OwnerLaneAllocator",
    "clear_host_state",
    "collect_evicted_chain",
    "cp_load_back",
    "evict_host_slots",
    "is_backed_up",
    "is_host_leaf",
    "logical_host_len",
    "map_cp_load",
    "map_cp_write",
    "set_host_state",
    "split_host_state",
]
__version__ = "0.1.0"
