"""The host tier of the CP cache: the host slot ledger, the ordered index of
host-evictable leaves, host eviction by physical slots, and the device
eviction that keeps every rank's host share within one page of 1/N.

Each rank holds only its own pages on the host, yet every rank must evict
the same host nodes: the ledger mirrors every rank's host usage (charged
from each node's page owners), so all ranks decide alike with no collective.
"""

from __future__ import annotations

import heapq
import time
from typing import Any

from sglang.srt.disaggregation.kv_events import StorageMedium
from sglang.srt.mem_cache.radix_cache import TreeNode

from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.policy_0518.host_eviction import (
    HostEvictionResult,
    HostLeafIndex,
    HostSlotLedger,
    evict_host_slots,
)
from sglang_cp_hicache.sglang_0518.counters import CpHiCacheCounters

__all__ = ["HostTier", "NoHostLeafSet"]


class NoHostLeafSet(set):
    """Stands in for SGLang's evictable_host_leaves; the CP index is the truth."""

    def add(self, item) -> None:  # pragma: no cover - guarded: SGLang paths we override
        raise RuntimeError("CP HiCache keeps host leaves in CpHiRadixCache.host_leaf_index")


class HostTier:
    """Host ledger, host leaves and host eviction of one CP cache.

    ``tree``: the SGLang cache (its tree, controller, eviction heap and
    allocator are read from it, nothing of this library); ``ledger``: every
    rank's host usage, as the start-up agreement sized it."""

    def __init__(
        self, tree: Any, placement: CpPlacement, ledger: HostSlotLedger, counters: CpHiCacheCounters
    ) -> None:
        self.tree = tree
        self.placement = placement
        self.counters = counters
        self.ledger = ledger
        self.leaves = HostLeafIndex(self._priority)

    def _priority(self, node):
        return self.tree.eviction_strategy.get_priority(node)

    def reset(self) -> None:
        """Empty, as after start-up (the tree and host pool were reset)."""
        self.leaves = HostLeafIndex(self._priority)
        self.ledger = HostSlotLedger(list(self.ledger.capacity))

    def refresh(self, node: TreeNode) -> None:
        """Whether ``node`` is a host-evictable leaf, after any edit of it."""
        self.leaves.refresh(node)

    def evict_for(self, required_per_rank: list[int]) -> HostEvictionResult:
        """Evict host leaves (the same on every rank) until each rank has
        ``required_per_rank`` tokens of host room in the ledger."""
        tree = self.tree
        result = evict_host_slots(
            self.leaves,
            required_per_rank,
            cp_rank=self.placement.cp_rank,
            child_key=lambda key: key.child_key(tree.page_size),
            free_host=tree.cache_controller.evict_host,
            ledger=self.ledger,
            on_remove=lambda n: tree._record_remove_event(n, medium=StorageMedium.CPU),
        )
        self.counters.host_evicted_nodes += result.nodes_evicted
        self.counters.host_evicted_slots += result.physical_slots_freed
        return result

    def evict(self, num_tokens: int) -> int:
        """Free ``num_tokens`` physical host slots on every rank (the same
        nodes everywhere); returns this rank's physical slots freed."""
        return self.evict_for([num_tokens] * self.placement.cp_size).physical_slots_freed

    # ---- host balance: evict a device leaf for a short lane -----------------
    def reclaim_lane(self, lane: int, pages: int) -> int:
        """Evict the least recently used device leaves that hold a page
        owned by ``lane`` until that lane has ``pages`` free pages; returns
        the pages freed (any lane). Same tree, same LRU, same allocator on
        every rank: every rank evicts the same leaves, with no collective."""
        tree = self.tree
        allocator = tree.token_to_kv_pool_allocator
        if allocator.lane_available_pages()[lane] >= pages:
            return 0
        start = time.perf_counter()
        write_back = tree.cache_controller.write_policy == "write_back"
        heap = tree._make_eviction_heap()
        num_evicted = 0
        while heap and allocator.lane_available_pages()[lane] < pages:
            _, x = heapq.heappop(heap)
            if x.lock_ref > 0 or x.cp_pages is None:
                continue
            if not bool((x.cp_pages % self.placement.cp_size == lane).any()):
                continue
            if x.backuped:
                num_evicted += tree._evict_backuped(x)
            elif write_back:
                continue  # write-back stages to host first: leave it to evict()
            else:
                num_evicted += tree._evict_regular(x)
            tree._promote_parent(x, heap)
        self.counters.lane_reclaim_tokens += num_evicted
        tree.update_eviction_metrics(num_evicted, start)  # SGLang's eviction metrics count these too
        return num_evicted // tree.page_size
