"""Context-parallel (CP shared KV) support for SGLang's hierarchical KV cache.

Everything importable from here needs only torch (policy and vocabulary).
The rooms above it: ``sglang_cp_hicache.kernels`` (Triton page copies and
their dispatcher, ``kernels.transfer``), ``sglang_cp_hicache.sglang`` (the
SGLang 0.5.18 adapter a server runs), ``sglang_cp_hicache.testing`` (CPU
harness for tests and the simulator) and ``sglang_cp_hicache.sim``.
"""

from sglang_cp_hicache.allocator import AllocatorSnapshot, OwnerLaneAllocator, PageAllocation
from sglang_cp_hicache.host_eviction import (
    HostEvictionResult,
    HostLeafIndex,
    HostSlotLedger,
    evict_host_slots,
    is_host_leaf,
)
from sglang_cp_hicache.layout import DSA_PAGE_SIZE, CpSharedKVLayout
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
from sglang_cp_hicache.plan import (
    CpLoadPlan,
    CpWritePlan,
    HiCacheWriteFailure,
    owner_token_counts,
    page_owners_of,
    plan_load,
    plan_write,
)

__all__ = [
    "DSA_PAGE_SIZE",
    "AllocatorSnapshot",
    "CpHiCacheNodeMetadata",
    "CpLoadPlan",
    "CpSharedKVLayout",
    "CpWritePlan",
    "HiCacheWriteFailure",
    "HostClearResult",
    "HostEvictionResult",
    "HostLeafIndex",
    "HostSlotLedger",
    "LoadBackOutcome",
    "OwnerLaneAllocator",
    "PageAllocation",
    "clear_host_state",
    "collect_evicted_chain",
    "cp_load_back",
    "evict_host_slots",
    "is_backed_up",
    "is_host_leaf",
    "logical_host_len",
    "owner_token_counts",
    "page_owners_of",
    "plan_load",
    "plan_write",
    "set_host_state",
    "split_host_state",
]
__version__ = "0.1.0"
