"""Policy of the SGLang 0.5.18 adapter, in torch only (no sglang import):
what to copy and where, testable with plain integers.

``metadata`` (a node's owned positions and host slots), ``node_state`` (host
state on a tree node: set, split, clear), ``allocator`` (owner-lane paged
allocator with a CPU page mirror and an undo log), ``plan`` (the one write /
load planning path), ``host_eviction`` (the host ledger every rank mirrors and
eviction counted in physical slots), ``load_back`` (load-back by logical
length). The 0.5.18 adapter (``sglang_cp_hicache.sglang_0518``) is their only
production user; SGLang 0.5.23 keeps this bookkeeping itself.
"""

from sglang_cp_hicache.policy_0518.allocator import AllocatorSnapshot, OwnerLaneAllocator, PageAllocation
from sglang_cp_hicache.policy_0518.host_eviction import (
    HostEvictionResult,
    HostLeafIndex,
    HostSlotLedger,
    evict_host_slots,
    is_host_leaf,
)
from sglang_cp_hicache.policy_0518.load_back import LoadBackOutcome, collect_evicted_chain, cp_load_back
from sglang_cp_hicache.policy_0518.metadata import CpHiCacheNodeMetadata
from sglang_cp_hicache.policy_0518.node_state import (
    HostClearResult,
    clear_host_state,
    is_backed_up,
    logical_host_len,
    set_host_state,
    split_host_state,
)
from sglang_cp_hicache.policy_0518.plan import (
    CpLoadPlan,
    CpWritePlan,
    HiCacheWriteFailure,
    page_owners_of,
    plan_load,
    plan_write,
)

__all__ = [
    "AllocatorSnapshot", "CpHiCacheNodeMetadata", "CpLoadPlan", "CpWritePlan", "HiCacheWriteFailure", "HostClearResult",
    "HostEvictionResult", "HostLeafIndex", "HostSlotLedger", "LoadBackOutcome", "OwnerLaneAllocator", "PageAllocation",
    "clear_host_state", "collect_evicted_chain", "cp_load_back", "evict_host_slots", "is_backed_up", "is_host_leaf",
    "logical_host_len", "page_owners_of", "plan_load", "plan_write", "set_host_state", "split_host_state",
]
