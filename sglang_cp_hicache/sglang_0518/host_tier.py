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

from sglang.srt.disaggregation.kv_events import StorageMedium
from sglang.srt.mem_cache.radix_cache import TreeNode

from sglang_cp_hicache.policy_0518.host_eviction import (
    HostEvictionResult,
    HostLeafIndex,
    HostSlotLedger,
    evict_host_slots,
)

__all__ = ["HostTierMixin", "NoHostLeafSet"]


class NoHostLeafSet(set):
    """Stands in for SGLang's evictable_host_leaves; the CP index is the truth."""

    def add(self, item) -> None:  # pragma: no cover - guarded: SGLang paths we override
        raise RuntimeError("CP HiCache keeps host leaves in CpHiRadixCache.host_leaf_index")


class HostTierMixin:
    """Host ledger, host leaves and host eviction, for :class:`CpHiRadixCache`."""

    def _host_priority(self, node):
        return self.eviction_strategy.get_priority(node)

    @property
    def host_slot_ledger(self) -> HostSlotLedger:
        return self._ledger

    @property
    def host_leaf_index(self) -> HostLeafIndex:
        return self._host_leaves

    def _update_host_leaf_status(self, node: TreeNode) -> None:
        self._host_leaves.refresh(node)

    def _evict_host_for(self, required_per_rank: list[int]) -> HostEvictionResult:
        result = evict_host_slots(
            self._host_leaves,
            required_per_rank,
            cp_rank=self.cp_placement.cp_rank,
            child_key=lambda key: key.child_key(self.page_size),
            free_host=self.cache_controller.evict_host,
            ledger=self._ledger,
            on_remove=lambda n: self._record_remove_event(n, medium=StorageMedium.CPU),
        )
        self.cp_counters.host_evicted_nodes += result.nodes_evicted
        self.cp_counters.host_evicted_slots += result.physical_slots_freed
        return result

    def evict_host(self, num_tokens: int) -> int:
        """Free ``num_tokens`` physical host slots on every rank (the same
        nodes everywhere); returns this rank's physical slots freed."""
        return self._evict_host_for([num_tokens] * self.cp_placement.cp_size).physical_slots_freed

    # ---- host balance: evict a device leaf for a short lane -----------------
    def _reclaim_lane(self, lane: int, pages: int) -> int:
        """Evict the least recently used device leaves that hold a page
        owned by ``lane`` until that lane has ``pages`` free pages; returns
        the pages freed (any lane). Same tree, same LRU, same allocator on
        every rank: every rank evicts the same leaves, with no collective."""
        allocator = self.token_to_kv_pool_allocator
        if allocator.lane_available_pages()[lane] >= pages:
            return 0
        start = time.perf_counter()
        write_back = self.cache_controller.write_policy == "write_back"
        heap = self._make_eviction_heap()
        num_evicted = 0
        while heap and allocator.lane_available_pages()[lane] < pages:
            _, x = heapq.heappop(heap)
            if x.lock_ref > 0 or x.cp_pages is None:
                continue
            if not bool((x.cp_pages % self.cp_placement.cp_size == lane).any()):
                continue
            if x.backuped:
                num_evicted += self._evict_backuped(x)
            elif write_back:
                continue  # write-back stages to host first: leave it to evict()
            else:
                num_evicted += self._evict_regular(x)
            self._promote_parent(x, heap)
        self.cp_counters.lane_reclaim_tokens += num_evicted
        self.update_eviction_metrics(num_evicted, start)  # SGLang's eviction metrics count these too
        return num_evicted // self.page_size
