"""CP mode for SGLang 0.5.18's ``HiRadixCache`` (DSA pool, HybridCacheController).

Switched on by constructing :class:`CpHiRadixCache` with this library's
:class:`CpSharedPagedTokenToKVPoolAllocator`. What changes under CP, and why:

* nodes are :class:`CpTreeNode`: ``value`` stays the full logical locs,
  ``host_len`` + ``cp_hicache`` carry host state, ``host_value`` stays None;
* every node keeps a CPU mirror of its logical pages (``cp_pages``): page
  owners, host-slot counts and ledger charges are read from it, never from
  the device locs, so writes, host eviction and load-backs do not sync with
  the GPU; callers hand the mirror in with :class:`CpInsertParams`;
* write-through backs up only this rank's pages, through this library's copy
  kernels (:mod:`.host_copies`); host room is decided with a
  :class:`HostSlotLedger` that mirrors every rank's host usage, so every rank
  evicts the same host nodes without asking the others;
* no collective of its own: a rank's local failure (allocation short, copy
  raised) rides SGLang's per-step all-reduce of ready acks, where every rank
  takes the same writes / load-backs back (:mod:`.step_status`);
* host eviction counts physical slots; load-back uses logical lengths and
  allocates pages with the owners they had at backup (owner preservation);
* zero-owned ranks queue empty operations, so ack counts match on every rank
  and SGLang's ready-ack all-reduces stay unconditional.

Methods copied from 0.5.18 (``insert``, ``_split_node``, ``match_prefix``)
differ from upstream only where the CP state is involved; they are pinned to
that release by ``sglang_cp_hicache.sglang_0518.SUPPORTED_SGLANG``.
"""

from __future__ import annotations

import heapq
import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch
from sglang.srt.disaggregation.kv_events import StorageMedium
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InitLoadBackParams,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode
from sglang.srt.mem_cache.utils import compute_node_hash_values, split_node_hash_value

from sglang_cp_hicache.kernels import transfer
from sglang_cp_hicache.kernels._checks import debug_enabled
from sglang_cp_hicache.policy_0518.plan import HiCacheWriteFailure, check_pages, page_owner_tokens, page_owners_of
from sglang_cp_hicache.policy_0518.host_eviction import (
    HostEvictionResult,
    HostLeafIndex,
    HostSlotLedger,
    evict_host_slots,
)
from sglang_cp_hicache.policy_0518.load_back import cp_load_back
from sglang_cp_hicache.policy_0518.node_state import set_host_state, split_host_state
from sglang_cp_hicache.sglang_0518 import check_sglang_version
from sglang_cp_hicache.sglang_0518.allocator import CpSharedPagedTokenToKVPoolAllocator
from sglang_cp_hicache.sglang_0518.checks import (
    HOST_BALANCE_ENV,
    HOST_BALANCE_POLICIES,
    check_cp_hicache_server_args,
    host_balance_policy,
)
from sglang_cp_hicache.sglang_0518.host_copies import cp_copies_installed, install_cp_copies
from sglang_cp_hicache.sglang_0518.step_status import GroupOutcome, StepStatus, Vote
from sglang_cp_hicache.sglang_0518.transfer_adapter import CpTransferAdapter, PendingLoad, PendingWrite, WriteState
from sglang_cp_hicache.sglang_0518.tree_node import CpTreeNode

logger = logging.getLogger(__name__)

__all__ = ["CpHiRadixCache", "CpHiCacheCounters", "CpHiCacheTransferError", "CpInsertParams", "Vote"]

_EMPTY = torch.empty((0,), dtype=torch.int64)


@dataclass
class CpInsertParams(InsertParams):
    """``InsertParams`` plus the CPU mirror of ``value``: its logical pages
    (``value_pages[i]`` is page ``i`` of ``value``, i.e. ``value[i*P] // P``),
    as the allocator handed them out. With it the cache never reads ``value``
    back from the device; without it the cache reads it once (a sync) and
    counts that in ``cp_counters.device_page_reads``."""

    value_pages: Optional[torch.Tensor] = None


class CpHiCacheTransferError(RuntimeError):
    """A CP HiCache copy failed on some rank; every rank rolled back and raises."""


@dataclass
class _LoadBackRecord:
    """A load-back whose ack has not been consumed yet."""

    seq: int
    last_node: TreeNode
    nodes: list
    device_locs: torch.Tensor
    pages: torch.Tensor  # CPU mirror of device_locs


@dataclass
class _InflightWrite:
    """A write whose ack has not been consumed yet (one ack per write)."""

    seq: int
    pending: PendingWrite
    need: list[int]  # ledger charge, tokens per rank


@dataclass
class CpHiCacheCounters:
    write_backups: int = 0
    write_failures: int = 0
    host_evicted_nodes: int = 0
    host_evicted_slots: int = 0  # physical, this rank
    load_backs: int = 0
    load_back_tokens: int = 0  # logical
    device_page_reads: int = 0  # inserts without a CPU page mirror (each one a sync)
    lane_reclaim_tokens: int = 0  # device tokens evicted to keep host shares even


class CpHiRadixCache(HiRadixCache):
    """HiRadixCache whose host tier is CP-sharded (see module docstring)."""

    def __init__(self, params, server_args) -> None:
        check_sglang_version()
        allocator = params.token_to_kv_pool_allocator
        if not isinstance(allocator, CpSharedPagedTokenToKVPoolAllocator):
            raise TypeError(
                "CpHiRadixCache needs params.token_to_kv_pool_allocator to be a "
                f"CpSharedPagedTokenToKVPoolAllocator, got {type(allocator).__name__}"
            )
        check_cp_hicache_server_args(server_args, cp_shared_kv=True)
        self.cp_host_balance = host_balance_policy()
        if not isinstance(allocator.get_kvcache(), DSATokenToKVPool):
            raise TypeError(
                "CP shared KV HiCache needs a DSATokenToKVPool device pool, got "
                f"{type(allocator.get_kvcache()).__name__}"
            )
        self.cp_layout = allocator.layout
        self.cp_counters = CpHiCacheCounters()
        self._host_leaves = HostLeafIndex(self._host_priority)
        self._ledger: Optional[HostSlotLedger] = None
        self._inflight_loads: list[_LoadBackRecord] = []
        self._inflight_writes: dict[int, _InflightWrite] = {}
        self._write_seq = 0
        self._load_seq = 0
        self._step_status = StepStatus()
        self._warned_device_page_read = False
        super().__init__(params, server_args)
        self.evictable_host_leaves = _NoSet()  # the ordered index replaces SGLang's set
        self.cp_copy_targets = install_cp_copies(self.cache_controller, self.cp_layout)
        if not cp_copies_installed(self.cp_copy_targets):
            raise RuntimeError("CP copies did not take on this cache's host pools; refusing to start")
        self.cp_transfer = CpTransferAdapter(self.cache_controller, self.cp_layout, allocator)
        self._ledger = self._make_ledger()
        # New pages go preferably to the ranks holding the fewest host slots.
        allocator.set_lane_bias(lambda: self._ledger.used)
        # ...and when the least loaded rank has no free device page, one is
        # made free by evicting for that lane (keeps host shares within a page).
        allocator.set_lane_reclaim(self._reclaim_lane if self.cp_host_balance == "exact" else None)
        self.cp_warmup = self._warm_up_copies()

    # ---- setup -----------------------------------------------------------
    def _host_priority(self, node):
        return self.eviction_strategy.get_priority(node)

    def _warm_up_copies(self):
        """Compile (CUDA) or load (interpreter) the copy kernels for exactly
        this cache's pools now, so the first request pays no JIT."""
        kv_pool = self.token_to_kv_pool_allocator.get_kvcache()
        kv_layer = kv_pool.kv_buffer[0]
        index_layer = kv_pool.index_k_with_scale_buffer[0]
        report = transfer.warmup(
            page_size=self.page_size,
            host_layout=self.cache_controller.mem_pool_host.layout,
            num_layers=len(kv_pool.kv_buffer),
            kv_dim=int(kv_layer.shape[-1]),
            kv_dtype=kv_layer.dtype,
            indexer_page_bytes=int(index_layer.shape[-1]),
            device=kv_layer.device,
        )
        logger.info(
            "cp-hicache: copy kernels ready on cp_rank %d/%d: backend=%s, %d kernel(s) %s in %.2f s "
            "(cache dir: %s; set TRITON_CACHE_DIR to a persistent directory to skip this on restart)",
            self.cp_layout.cp_rank, self.cp_layout.cp_size, report.backend, report.compiled,
            ",".join(report.ops) or "-", report.seconds, report.cache_dir,
        )
        return report

    def _make_ledger(self) -> HostSlotLedger:
        """The host ledger, after checking (the two start-up all-reduces) that
        every rank has the same host pool size and host-balance policy: either
        differing would make ranks decide differently."""
        capacity = int(self.token_to_kv_pool_host.size)
        policy = HOST_BALANCE_POLICIES.index(self.cp_host_balance)
        lo = torch.tensor([capacity, policy], dtype=torch.int64)
        hi = torch.tensor([-capacity, -policy], dtype=torch.int64)
        self._all_reduce(lo, torch.distributed.ReduceOp.MIN)
        self._all_reduce(hi, torch.distributed.ReduceOp.MIN)
        if int(lo[0]) != capacity or -int(hi[0]) != capacity:
            raise ValueError(
                f"CP ranks have different host pool sizes ({int(lo[0])}..{-int(hi[0])} slots); "
                "size every rank's device pool with "
                "CpSharedPagedTokenToKVPoolAllocator.physical_size_for()"
            )
        if int(lo[1]) != -int(hi[1]):
            raise ValueError(
                f"CP ranks run different {HOST_BALANCE_ENV} policies "
                f"({HOST_BALANCE_POLICIES[int(lo[1])]} and {HOST_BALANCE_POLICIES[-int(hi[1])]}); "
                "set it the same on every rank"
            )
        return HostSlotLedger([capacity] * self.cp_layout.cp_size)

    def reset(self) -> None:
        super().reset()
        old = self.root_node
        root = CpTreeNode(id=old.id, priority=old.priority)
        root.key, root.value, root.lock_ref = old.key, old.value, old.lock_ref
        root.hash_value = old.hash_value
        root.is_cp_root = True
        root.cp_pages = _EMPTY
        self.root_node = root
        self._empty_match_result = self._empty_match_result._replace(
            last_device_node=root, last_host_node=root, best_match_node=root
        )
        self._host_leaves = HostLeafIndex(self._host_priority)
        self._inflight_loads = []
        self._inflight_writes = {}
        self._step_status = StepStatus()
        if self._ledger is not None:
            self._ledger = HostSlotLedger(list(self._ledger.capacity))

    # ---- the CPU page mirror ----------------------------------------------
    def _pages_for(self, value: torch.Tensor, value_pages: Optional[torch.Tensor]) -> torch.Tensor:
        """The CPU mirror of ``value`` (logical pages of its whole pages)."""
        P = self.page_size
        num_pages = len(value) // P
        if value_pages is None:
            self.cp_counters.device_page_reads += 1
            if not self._warned_device_page_read:
                self._warned_device_page_read = True
                logger.warning(
                    "cp-hicache: insert without CpInsertParams.value_pages: reading the node's "
                    "locs back from the device (one sync per insert); pass the allocator's CPU "
                    "page mirror to keep the write path sync-free"
                )
            return value[: num_pages * P : P].to("cpu", torch.int64) // P
        pages = check_pages(value_pages)
        if pages.numel() < num_pages:
            raise ValueError(
                f"value_pages lists {pages.numel()} pages, value has {num_pages} whole pages"
            )
        pages = pages[:num_pages]
        if debug_enabled():  # a sync, on purpose: catch a mirror that lies
            actual = value[: num_pages * P : P].to("cpu", torch.int64) // P
            if not torch.equal(actual, pages):
                raise ValueError("value_pages does not match value's pages")
        return pages

    def cp_prefix_pages(self, node: TreeNode) -> torch.Tensor:
        """CPU mirror of the device locs from the root down to ``node``
        (every node on the path must be on the device)."""
        chunks = []
        while node is not self.root_node:
            if node.evicted:
                raise ValueError(f"node {node.id} is evicted: no device pages to mirror")
            chunks.append(node.cp_pages)
            node = node.parent
        chunks.reverse()
        return torch.cat(chunks) if chunks else _EMPTY

    # ---- write-through ---------------------------------------------------
    def write_backup(self, node: TreeNode, write_back: bool = False) -> int:
        """Back up this rank's pages of ``node``, with no collective: the
        ledger decides identically on every rank. A local failure (host
        allocation short, copy raised) leaves the node looking backed up
        here too, so the trees stay identical, and is reported in the step's
        all-reduce, where every rank takes the write back."""
        if write_back:
            raise ValueError("CP HiCache supports write_through policies, not write_back")
        # Backed-up nodes form a prefix from the root (as upstream).
        if node.parent is not self.root_node and not node.parent.backuped:
            return 0
        # Owners come from the node's CPU page mirror: no read of node.value.
        pages = node.cp_pages
        need = page_owner_tokens(self.cp_layout, pages)
        if not self._ledger.fits(need):
            self._evict_host_for(self._ledger.shortfall(need))
        if not self._ledger.fits(need):  # identical on every rank: nothing to tell
            self.cp_counters.write_failures += 1
            return 0
        seq, self._write_seq = self._write_seq, self._write_seq + 1
        extra = self._get_extra_pools()
        pending = None
        try:
            pending = self.cp_transfer.plan_write(node.value, pages, node_id=node.id, **extra)
            if isinstance(pending, HiCacheWriteFailure):
                self._step_status.fail_write(Vote.REFUSED, seq)
                pending = self.cp_transfer.placeholder_write(node.value, pages, node_id=node.id, **extra)
            pending.start()
        except Exception as exc:  # the group hears of it at the step's all-reduce
            self._step_status.fail_write(Vote.FAILED, seq, exc)
            if pending is not None and pending.state is WriteState.PLANNED:
                pending.abort()
            pending = self.cp_transfer.placeholder_write(node.value, pages, node_id=node.id)
        set_host_state(node, pending.metadata)
        node.host_value = None
        self._ledger.charge(need)
        self._track_write_through_node(node, len(node.key))
        self._inflight_writes[node.id] = _InflightWrite(seq, pending, need)
        self.inc_lock_ref(node)
        self.cp_counters.write_backups += 1
        return len(node.value)

    def _finish_write_through_ack(self, ack_id: int, *, release_lock: bool) -> None:
        record = self._inflight_writes.pop(ack_id, None)
        if record is not None and record.pending.state is WriteState.STARTED:
            record.pending.keep()
        super()._finish_write_through_ack(ack_id, release_lock=release_lock)

    def _undo_write(self, ack_id: int, record: _InflightWrite) -> None:
        """Take one in-flight write back on this rank (before its ack is consumed)."""
        lock_node, _, publish_nodes = self.ongoing_write_through.pop(ack_id)
        if record.pending.state is WriteState.STARTED:
            record.pending.undo()  # waits for the copy, drops the ack, frees the host slots
        for n in publish_nodes:  # the node, or its pieces if it was split since
            n.write_through_pending_id = None
            n.cp_hicache = None
            n.host_len = 0
            self._update_host_leaf_status(n)
        self._ledger.release(record.need)
        self.dec_lock_ref(lock_node)
        self.cp_counters.write_backups -= 1
        self.cp_counters.write_failures += 1

    # ---- the step's all-reduce: SGLang's ready acks + this rank's status ---
    def _exchange(self, counts: list[int]) -> list[int]:
        """SGLang's MIN all-reduce of ready-ack counts, with this rank's step
        status folded into the two count words (no extra word: see
        ``step_status``); every rank then takes back the same failed writes
        and load-backs before any ack is consumed. ``counts``: write acks,
        then load acks, then SGLang's storage counts (passed through).
        Returns the counts every rank may consume."""
        n = len(counts)
        write_acks, load_acks = counts[0], counts[1] if n > 1 else 0
        # Only a failed write needs the oldest in-flight one (its cut's origin).
        first = self._first_inflight_write_seq() if self._step_status.write is not None else None
        vec = torch.tensor(
            [*self._step_status.words(write_acks, load_acks, first), *counts[2:]], dtype=torch.int64
        )
        self._all_reduce(vec, torch.distributed.ReduceOp.MIN)
        reduced = vec.tolist()
        step = self._step_status.read(reduced)
        mine_write, mine_load = self._step_status.clear()
        out = [step.write_acks, step.load_acks, *reduced[2:]][: max(n, 1)]
        write, load = step.write, step.load
        if write.ok and load.ok:
            return out
        if not write.ok:
            self._take_back_writes(write, self._first_inflight_write_seq())
        if not load.ok:
            self._take_back_loads()
        if write.vote == Vote.FAILED or load.vote == Vote.FAILED:
            mine = mine_write if write.vote == Vote.FAILED else mine_load
            error = mine.error if mine is not None else None
            what = "backup" if write.vote == Vote.FAILED else "load-back"
            raise CpHiCacheTransferError(
                f"CP HiCache {what} failed on a CP rank; rolled back on every rank "
                f"(this rank: {error!r})"
            ) from error
        return out

    def _first_inflight_write_seq(self) -> Optional[int]:
        """Sequence number of the oldest write whose ack is not consumed
        (the same on every rank: the same writes, the same acks consumed)."""
        return min((r.seq for r in self._inflight_writes.values()), default=None)

    def _take_back_writes(self, outcome: GroupOutcome, first_seq: int) -> None:
        """Undo every in-flight write from the first failed one on (newest
        first): later writes may be children of it."""
        doomed = [(a, r) for a, r in self._inflight_writes.items() if r.seq - first_seq >= outcome.cut]
        for ack_id, record in reversed(doomed):
            del self._inflight_writes[ack_id]
            self._undo_write(ack_id, record)

    def _take_back_loads(self) -> None:
        """Undo every load-back whose ack has not been consumed: a failed
        load may share a merged copy (and its ack) with the others."""
        records, self._inflight_loads = self._inflight_loads, []
        queue = self.cache_controller.ack_load_queue
        for ack in queue:
            ack.finish_event.synchronize()
        queue.clear()
        for record in reversed(records):
            if record.last_node.id in self.ongoing_load_back:
                self._undo_load_back(record)
        # A rank whose allocation failed never took the pages the others just
        # freed: the free SETS agree, the lists may not. Sorting every free
        # list makes the allocators identical again.
        self.token_to_kv_pool_allocator.merge_and_sort_free()

    def _sync_hicache_ready_counts(self):
        ctrl = self.cache_controller
        storage = (
            (ctrl.prefetch_hit_queue.qsize(), ctrl.ack_backup_queue.qsize(), ctrl.host_mem_release_queue.qsize())
            if self.enable_storage else ()
        )
        counts = [self._count_ready_acks(ctrl.ack_write_queue), self._count_ready_acks(ctrl.ack_load_queue), *storage]
        counts = self._exchange(counts)
        return counts[0], counts[1], tuple(counts[2:])

    def writing_check(self, write_back: bool = False, finish_count: Optional[int] = None):
        if finish_count is None and not write_back:
            ready = self._count_ready_acks(self.cache_controller.ack_write_queue) if self.pp_rank == 0 else 0
            finish_count = self._exchange([ready])[0]
        return super().writing_check(write_back=write_back, finish_count=finish_count)

    def loading_check(self, finish_count: Optional[int] = None):
        self._retire_loads()
        if finish_count is None:
            ready = self._count_ready_acks(self.cache_controller.ack_load_queue) if self.pp_rank == 0 else 0
            # the load count sits where _exchange expects the write count
            finish_count = self._exchange_loads(ready)
        super().loading_check(finish_count=finish_count)
        self._retire_loads()

    def _exchange_loads(self, ready: int) -> int:
        counts = self._exchange([0, ready])
        return counts[1]

    def _retire_loads(self) -> None:
        """Forget load-backs whose acks SGLang consumed."""
        self._inflight_loads = [r for r in self._inflight_loads if r.last_node.id in self.ongoing_load_back]

    # ---- device eviction + OOM reporting -------------------------------------
    def evict(self, params: EvictParams):
        result = super().evict(params)
        self.last_evict_result = result
        return result

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
            if not bool((x.cp_pages % self.cp_layout.cp_size == lane).any()):
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

    def available_and_evictable_str(self) -> str:
        """What SGLang prints on KV OOM: with the allocator's free/deferred
        pages and what the last eviction achieved."""
        allocator = self.token_to_kv_pool_allocator
        evictable = self.evictable_size()
        last = getattr(self, "last_evict_result", None)
        evicted = "evict_result=None" if last is None else (
            f"evict_result=(num_tokens_evicted={last.num_tokens_evicted})"
        )
        return (
            f"Available tokens: {allocator.available_size() + evictable} "
            f"({allocator.allocator_state_str()} + evictable_size={evictable}); {evicted}\n"
        )

    # ---- host tier -------------------------------------------------------
    def _update_host_leaf_status(self, node: TreeNode) -> None:
        self._host_leaves.refresh(node)

    def _evict_host_for(self, required_per_rank: list[int]) -> HostEvictionResult:
        result = evict_host_slots(
            self._host_leaves,
            required_per_rank,
            cp_rank=self.cp_layout.cp_rank,
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
        return self._evict_host_for([num_tokens] * self.cp_layout.cp_size).physical_slots_freed

    @property
    def host_slot_ledger(self) -> HostSlotLedger:
        return self._ledger

    @property
    def host_leaf_index(self) -> HostLeafIndex:
        return self._host_leaves

    # ---- load-back -------------------------------------------------------
    def load_back(self, node: TreeNode, mem_quota: Optional[int] = None) -> Optional[torch.Tensor]:
        start = time.perf_counter()
        last_hit_node = node
        protected: list = []
        queued: list[PendingLoad] = []

        def load(chain):
            if not protected:
                for n in chain:
                    n.protect_host()
                protected.extend(chain)
            if self._step_status.load is not None:
                return None  # this rank already failed this step: no further allocation
            metadata = [n.cp_hicache for n in chain]
            # The allocator is identical on every rank: its lanes decide for all.
            if not self._lanes_fit(metadata):
                return None
            seq, self._load_seq = self._load_seq, self._load_seq + 1
            try:
                pending = self.cp_transfer.queue_load(
                    metadata, node_id=last_hit_node.id, **self._get_extra_pools()
                )
                if pending is None:
                    raise RuntimeError("owner-preserving allocation failed although every lane had room")
            except Exception as exc:  # the group hears of it at the step's all-reduce
                self._step_status.fail_load(Vote.FAILED, seq, exc)
                return None
            pending.keep()
            queued.append(pending)
            return pending.plan.device_locs

        def evict_device(num_tokens):
            if self._step_status.load is not None:
                return 0  # failed locally: evicting here alone would split the trees
            return self._evict_device_for_lanes(protected)

        try:
            outcome = cp_load_back(
                node,
                load_back_threshold=self.load_back_threshold,
                mem_quota=mem_quota,
                inc_lock_ref=lambda n: self.inc_lock_ref(n).delta,
                dec_lock_ref=self.dec_lock_ref,
                load=load,
                evict_device=evict_device,
            )
        finally:
            for n in protected:
                n.release_host()
        if outcome is None:
            if protected:
                logger.warning(
                    "load_back: failed to load %d logical tokens for node %d even after "
                    "eviction; %s", sum(n.host_len for n in protected), last_hit_node.id,
                    self.available_and_evictable_str().strip(),
                )
            return None
        pages = queued[-1].plan.allocation.pages
        offset = 0
        for n in outcome.nodes:  # the CPU mirror of each restored node's new value
            num_pages = n.host_len // self.page_size
            n.cp_pages = pages[offset : offset + num_pages]
            offset += num_pages
        self.ongoing_load_back[last_hit_node.id] = last_hit_node
        self._inflight_loads.append(
            _LoadBackRecord(self._load_seq - 1, last_hit_node, outcome.nodes, outcome.device_locs, pages)
        )
        for n in outcome.nodes:
            self._record_store_event(n, medium=StorageMedium.GPU)
        self.evictable_size_ += outcome.host_hit_len
        self.inc_lock_ref(last_hit_node)
        self.cp_counters.load_backs += 1
        self.cp_counters.load_back_tokens += outcome.host_hit_len
        if self.metrics_collector is not None:
            self.metrics_collector.observe_load_back_duration(time.perf_counter() - start)
        return outcome.device_locs

    def _lanes_fit(self, metadata: list) -> bool:
        """Whether every owner lane has the pages a restore of ``metadata``
        needs (the allocator mirror, identical on every rank)."""
        need = [0] * self.cp_layout.cp_size
        for owner in page_owners_of(metadata, self.page_size):
            need[owner] += 1
        lanes = self.token_to_kv_pool_allocator.lane_available_pages()
        return all(n <= a for n, a in zip(need, lanes))

    def _evict_device_for_lanes(self, chain: list) -> int:
        """Evict device nodes (LRU, as upstream) until every owner lane the
        restored chain needs has enough free pages. Free pages of the wrong
        owner are of no use to an owner-preserving restore, so a plain
        ``evict(host_hit_len)`` can free enough tokens and still fail."""
        owners = page_owners_of([n.cp_hicache for n in chain], self.page_size)
        need = [0] * self.cp_layout.cp_size
        for o in owners:
            need[o] += 1
        evicted = 0
        while True:
            lanes = self.token_to_kv_pool_allocator.lane_available_pages()
            short = sum(max(0, n - a) for n, a in zip(need, lanes))
            if short == 0:
                return evicted
            got = self.evict(EvictParams(num_tokens=short * self.page_size)).num_tokens_evicted
            if got == 0:
                return evicted
            evicted += got

    def ready_to_load_host_cache(self) -> int:
        """Start the queued loads, with no collective. If the copy raises on
        this rank, the step's all-reduce makes every rank take its
        load-backs back (nodes evicted again, pages freed, locks released)
        and raise."""
        started = self.cp_transfer.start_loading()
        if started.error is not None:
            first = self._inflight_loads[0].seq if self._inflight_loads else self._load_seq
            self._step_status.fail_load(Vote.FAILED, first, started.error)
        return started.producer_id

    def _undo_load_back(self, record: "_LoadBackRecord") -> None:
        self.ongoing_load_back.pop(record.last_node.id, None)
        self.dec_lock_ref(record.last_node)
        for n in reversed(record.nodes):
            self.evictable_size_ -= len(n.value)
            self._record_remove_event(n, medium=StorageMedium.GPU)
            n.value = None
            n.cp_pages = None
            self._update_leaf_status(n)
            self._update_host_leaf_status(n)
            self._update_leaf_status(n.parent)
        self.token_to_kv_pool_allocator.free_mirrored(record.pages)
        self.cp_counters.load_backs -= 1
        self.cp_counters.load_back_tokens -= int(record.device_locs.numel())

    # ---- device eviction: free by the CPU mirror (no read of node.value) ----
    def _evict_backuped(self, node: TreeNode):
        pages, node.cp_pages = node.cp_pages, None
        num_evicted = self._detach_backuped(node)
        self.token_to_kv_pool_allocator.free_mirrored(pages)
        return num_evicted

    def _evict_regular(self, node: TreeNode):
        assert len(node.children) == 0, f"non-leaf, {node.id=}"
        self._record_remove_event(node)
        self.token_to_kv_pool_allocator.free_mirrored(node.cp_pages)
        num_evicted = len(node.value)
        node.cp_pages = None
        self._delete_leaf(node)
        return num_evicted

    def init_load_back(self, params: InitLoadBackParams):
        if params.mem_quota is None:
            # 0.5.18's PrefillAdder passes no quota: keep room for the request's
            # own new tokens so load-back cannot take the pages it needs.
            params.mem_quota = self.load_back_mem_quota(params)
        return super().init_load_back(params)

    def load_back_mem_quota(self, params: InitLoadBackParams) -> int:
        """Device tokens load-back may take: what is free now, less the
        request's own new tokens (page-rounded) and one page of slack for the
        partially filled page it will extend. Without a request: all of it."""
        available = self.token_to_kv_pool_allocator.available_size()
        req = params.req
        if req is None:
            return available
        fill = getattr(req, "fill_ids", None) or getattr(req, "full_untruncated_fill_ids", [])
        prefix = len(getattr(req, "prefix_indices", ()))
        own_tokens = max(len(fill) - prefix - params.host_hit_length, 0)
        P = self.page_size
        reserve = -(-own_tokens // P) * P + P
        return max(available - reserve, 0)

    # ---- tree edits (0.5.18 logic, CP node type) ---------------------------
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        if self.disable:
            return self._empty_match_result
        key, _ = params.key.maybe_to_bigram_view(self.is_eagle)
        key = key.page_aligned(self.page_size)
        if len(key) == 0:
            return self._empty_match_result
        value, last_node = self._match_prefix_helper(self.root_node, key)
        value = torch.cat(value) if value else self._empty_match_result.device_indices
        host_hit_length = 0
        last_host_node = last_node
        while last_node.evicted:
            host_hit_length += last_node.host_len  # logical length
            last_node = last_node.parent
        while not last_host_node.backuped:
            last_host_node = last_host_node.parent
        return MatchResult(
            device_indices=value,
            last_device_node=last_node,
            last_host_node=last_host_node,
            best_match_node=last_host_node,
            host_hit_length=host_hit_length,
        )

    def _split_node(self, key: RadixKey, child: TreeNode, split_len: int):
        new_node = CpTreeNode(priority=child.priority)
        new_node.children = {key[split_len:].child_key(self.page_size): child}
        new_node.parent = child.parent
        new_node.lock_ref = child.lock_ref
        new_node.key = child.key[:split_len]
        new_node.hit_count = child.hit_count
        if child.evicted:
            new_node.value = None
        else:
            new_node.value = child.value[:split_len].clone()
            child.value = child.value[split_len:].clone()
            split_pages = split_len // self.page_size
            new_node.cp_pages = child.cp_pages[:split_pages]
            child.cp_pages = child.cp_pages[split_pages:]
        was_backed_up = child.backuped
        split_host_state(child, new_node, split_len)
        new_node.hash_value, child.hash_value = split_node_hash_value(
            child.hash_value, split_len, self.page_size
        )
        new_node.event_hash_value, child.event_hash_value = split_node_hash_value(
            child.event_hash_value, split_len, self.page_size
        )
        child.parent = new_node
        child.key = child.key[split_len:]
        new_node.parent.children[key.child_key(self.page_size)] = new_node
        if was_backed_up:
            self._replace_pending_write_through_node(child, [new_node, child])
        # The prefix part has a child now; the suffix keeps its leaf status.
        self._update_host_leaf_status(new_node)
        return new_node

    def insert(self, params: InsertParams) -> InsertResult:
        key, value, chunked = params.key, params.value, params.chunked
        priority = params.priority if params.priority is not None else 0
        key, value = key.maybe_to_bigram_view(self.is_eagle, value)
        key = key.page_aligned(self.page_size)
        if value is not None:
            value = value[: len(key)]
        if len(key) == 0:
            return InsertResult(prefix_len=0)
        P = self.page_size
        pages = self._pages_for(value, getattr(params, "value_pages", None))
        node = self.root_node
        child_key = key.child_key(self.page_size)
        total_prefix_length = 0
        while len(key) > 0 and child_key in node.children:
            node = node.children[child_key]
            node.last_access_time = time.monotonic()
            node.priority = max(node.priority, priority)
            prefix_len = node.key.match(key, page_size=self.page_size)
            if prefix_len < len(node.key):
                node = self._split_node(node.key, node, prefix_len)
                node.priority = max(node.priority, priority)
            if node.evicted:
                # recomputed KV replaces the evicted device copy
                node.value = value[:prefix_len].clone()
                node.cp_pages = pages[: prefix_len // P]
                self.evictable_size_ += len(node.value)
                self._update_leaf_status(node)
                self._update_host_leaf_status(node)
                self._update_leaf_status(node.parent)
            else:
                self._inc_hit_count(node, chunked)
                total_prefix_length += prefix_len
            key = key[prefix_len:]
            value = value[prefix_len:]
            pages = pages[prefix_len // P :]
            if len(key):
                child_key = key.child_key(self.page_size)
        if len(key):
            new_node = CpTreeNode(priority=priority)
            new_node.parent = node
            new_node.key = key
            new_node.value = value.clone()
            new_node.cp_pages = pages
            node.children[child_key] = new_node
            self.evictable_size_ += len(value)
            self._update_leaf_status(node)
            self._update_leaf_status(new_node)
            self._update_host_leaf_status(node)
            if self.enable_storage or self.enable_kv_cache_events:
                new_node.hash_value = compute_node_hash_values(new_node, self.page_size)
            self._record_store_event(new_node)
            self._inc_hit_count(new_node, chunked)
        return InsertResult(prefix_len=total_prefix_length)


class _NoSet(set):
    """Stands in for SGLang's evictable_host_leaves; the CP index is the truth."""

    def add(self, item) -> None:  # pragma: no cover - guarded: SGLang paths we override
        raise RuntimeError("CP HiCache keeps host leaves in CpHiRadixCache.host_leaf_index")
