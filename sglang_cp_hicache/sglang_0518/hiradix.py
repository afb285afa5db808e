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

The cache owns one collaborator per concern, each with its own state, all
built in :meth:`CpHiRadixCache.__init__` and handed what they use (the
SGLang cache itself only as ``tree``, for SGLang's own attributes):
:class:`~.host_tier.HostTier` (ledger, host leaves, host eviction, lane
reclaim), :class:`~.write_through.WriteThrough` and its
:class:`~.write_through.PageMirror` (write-through, the CPU page mirror),
:class:`~.load_back.LoadBack` (load-back, its quota, its take-back),
:class:`~.step_protocol.StepProtocol` (the step's all-reduce: when to take
back), :class:`~.l3_cache.L3Cache` (the L3 tier:
``--hicache-storage-backend file`` or ``SGLANG_CP_HICACHE_L3_DIR``) and
:class:`~.l3_cache.L3Requests` (SGLang's scheduler prefetch calls, served
by that tier). :mod:`.upstream_0518` holds ``match_prefix``,
``_split_node``, ``insert`` and the device eviction bodies carried over from
0.5.18, each saying what differs. Every SGLang method the cache overrides is
a short delegation to one of them; this module builds the cache and keeps
what SGLang asks of it at start-up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Hashable, List, Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams, InitLoadBackParams, InsertParams, InsertResult, MatchPrefixParams, MatchResult,
)
from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sglang_cp_hicache import settings
from sglang_cp_hicache import agreement
from sglang_cp_hicache.agreement import CpAgreementError, RankView, gather_and_check
from sglang_cp_hicache.kernels import transfer
from sglang_cp_hicache.l3.opening import open_l3
from sglang_cp_hicache.l3.rank import RankL3
from sglang_cp_hicache.policy_0518.host_eviction import HostLeafIndex, HostSlotLedger
from sglang_cp_hicache.sglang_0518 import check_sglang_version, upstream_0518
from sglang_cp_hicache.sglang_0518.allocator import CpSharedPagedTokenToKVPoolAllocator
from sglang_cp_hicache.sglang_0518.checks import (
    HOST_BALANCE_ENV, check_cp_hicache_server_args, host_balance_policy, storage_location,
)
from sglang_cp_hicache.sglang_0518.counters import CpHiCacheCounters
from sglang_cp_hicache.sglang_0518.hooks import check_hooks
from sglang_cp_hicache.sglang_0518.host_copies import cp_copies_installed, install_cp_copies
from sglang_cp_hicache.sglang_0518.host_tier import HostTier, NoHostLeafSet
from sglang_cp_hicache.sglang_0518.l3_cache import (
    L3Cache, L3Requests, install_metrics, l3_binding, log_l3_start, refuse_runtime_attach, source_label,
)
from sglang_cp_hicache.sglang_0518.library_metrics import LibraryMetrics0518
from sglang_cp_hicache.sglang_0518.l3_port import L3Port0518
from sglang_cp_hicache.sglang_0518.load_back import LoadBack
from sglang_cp_hicache.sglang_0518.request_rows import RequestRows
from sglang_cp_hicache.sglang_0518.step_protocol import CpHiCacheTransferError, StepProtocol
from sglang_cp_hicache.sglang_0518.step_status import StepStatus, Vote
from sglang_cp_hicache.sglang_0518.transfer_adapter import CpTransferAdapter
from sglang_cp_hicache.sglang_0518.tree_node import CpTreeNode
from sglang_cp_hicache.sglang_0518.write_through import EMPTY_PAGES, PageMirror, WriteThrough

logger = logging.getLogger(__name__)

__all__ = ["CpHiRadixCache", "CpHiCacheCounters", "CpHiCacheTransferError", "CpInsertParams", "Vote"]


#: What to do about a start-up disagreement the agreement message cannot say.
_AGREEMENT_HINTS = {
    agreement.HOST_POOL_SLOTS_KEY: "host pools are sized from the device pool: size every rank's device pool "
    "with CpSharedPagedTokenToKVPoolAllocator.physical_size_for()",
}


@dataclass
class CpInsertParams(InsertParams):
    """``InsertParams`` plus the CPU mirror of ``value``: its logical pages
    (``value_pages[i]`` is page ``i`` of ``value``, i.e. ``value[i*P] // P``),
    as the allocator handed them out. With it the cache never reads ``value``
    back from the device; without it the cache reads it once (a sync) and
    counts that in ``cp_counters.device_page_reads``."""

    value_pages: Optional[torch.Tensor] = None


class _WithoutStorage:
    """``server_args`` as the base cache must see them (SGLang's are
    read-only once resolved): without the storage flag. With it SGLang builds
    its own storage controller, threads and backend, which CP nodes
    (``host_value`` None, rank-local host slots) cannot feed. The scheduler
    keeps the real ones, so it still prefetches -- served by this cache's L3."""

    hicache_storage_backend = None
    hicache_storage_backend_extra_config = None

    def __init__(self, server_args) -> None:
        self._server_args = server_args

    def __getattr__(self, name: str):
        return getattr(self._server_args, name)


def _without_storage(server_args):
    if getattr(server_args, "hicache_storage_backend", None) is None:
        return server_args
    return _WithoutStorage(server_args)



class CpHiRadixCache(HiRadixCache):
    """HiRadixCache whose host tier is CP-sharded (see module docstring)."""

    def __init__(self, params, server_args) -> None:
        check_sglang_version()
        check_hooks()  # SGLang's classes, before anything of theirs runs
        settings.check_all()  # a misspelt setting stops start-up, not a later copy
        settings.log_unknown_names(logger)  # a misspelt name reads as unset: warned, never refused
        allocator = params.token_to_kv_pool_allocator
        if not isinstance(allocator, CpSharedPagedTokenToKVPoolAllocator):
            raise TypeError(
                "CpHiRadixCache needs params.token_to_kv_pool_allocator to be a "
                f"CpSharedPagedTokenToKVPoolAllocator, got {type(allocator).__name__}"
            )
        check_cp_hicache_server_args(server_args, cp_shared_kv=True)
        location = storage_location(server_args)
        self.cp_host_balance = host_balance_policy()
        if not isinstance(allocator.get_kvcache(), DSATokenToKVPool):
            raise TypeError(
                "CP shared KV HiCache needs a DSATokenToKVPool device pool, got "
                f"{type(allocator.get_kvcache()).__name__}"
            )
        if params.page_size != allocator.placement.page_size:
            # the tree would cut keys into pages the allocator does not place
            raise ValueError(
                f"params.page_size ({params.page_size}) must equal the CP allocator's page size "
                f"({allocator.placement.page_size})"
            )
        self.cp_placement = allocator.placement
        self.cp_counters = CpHiCacheCounters()
        self.cp_page_mirror = PageMirror(self.cp_placement.page_size, self.cp_counters)
        self.cp_status = StepStatus()
        # SGLang's __init__ resets the tree before the collaborators exist.
        self.cp_host: Optional[HostTier] = None
        self.cp_rows: Optional[RequestRows] = None
        super().__init__(params, _without_storage(server_args))
        # The scheduler's own inserts carry no page mirror: each request's
        # row is mirrored on the CPU instead (extend, decode, checkpoint).
        self.cp_rows = RequestRows(self.page_size, self.cp_prefix_pages)
        if self.req_to_token_pool is not None:
            self.cp_rows.watch_slots(self.req_to_token_pool)
        allocator.set_request_rows(self.cp_rows)
        self.evictable_host_leaves = NoHostLeafSet()  # the host tier's ordered index replaces SGLang's set
        self.cp_copy_targets = install_cp_copies(self.cache_controller, self.cp_placement)
        if not cp_copies_installed(self.cp_copy_targets):
            raise RuntimeError("CP copies did not take on this cache's host pools; refusing to start")
        self.cp_transfer = CpTransferAdapter(self.cache_controller, self.cp_placement, allocator)
        # Opened before the agreement, raised after it: a rank whose L3 is
        # unusable never leaves its peers waiting in the all-gather.
        opening = open_l3(location, source_label(location), lambda: l3_binding(
            self.cp_placement, self.cp_copy_targets, allocator.get_kvcache(), server_args), server_args=server_args)
        self.cp_l3_location = location
        ledger = self._agree_with_peers(opening.view)
        opening.raise_if_unusable()
        self._build_collaborators(ledger, opening.tier)
        if self.cp_l3 is not None and params.enable_metrics:
            # --enable-metrics: SGLang's storage metrics, fed by this L3
            install_metrics(self, self.cp_placement, self.cp_l3, server_args)
        # --enable-metrics: the library's own counters, labelled as L3's (None: off)
        self.cp_metrics: Optional[LibraryMetrics0518] = None
        if params.enable_metrics:
            self.cp_metrics = LibraryMetrics0518(self, self.cp_placement, self.cp_counters, self.cp_host, server_args)
        log_l3_start(self.cp_placement, self.cp_l3, location)
        host = self.cp_host
        # New pages go preferably to the ranks holding the fewest host slots.
        allocator.set_lane_bias(lambda: host.ledger.used)
        # ...and when the least loaded rank has no free device page, one is
        # made free by evicting for that lane (keeps host shares within a page).
        allocator.set_lane_reclaim(host.reclaim_lane if self.cp_host_balance == "exact" else None)
        self.cp_warmup = self._warm_up_copies()

    def _build_collaborators(self, ledger: HostSlotLedger, l3_tier) -> None:
        """Every collaborator, each handed what it talks to (the one place they are built)."""
        placement, counters, status = self.cp_placement, self.cp_counters, self.cp_status
        self.cp_host = HostTier(self, placement, ledger, counters)
        rank_l3 = None
        if l3_tier is not None:
            rank_l3 = RankL3(l3_tier, L3Port0518(self, l3_tier, placement, self.cp_host), self.cp_l3_location)
        self.cp_l3_cache = L3Cache(self, placement, rank_l3)
        self.cp_l3_requests = L3Requests(self, self.cp_l3_cache)
        self.cp_writes = WriteThrough(self, placement, self.cp_transfer, self.cp_host, status, counters)
        self.cp_loads = LoadBack(self, placement, self.cp_transfer, status, counters)
        self.cp_steps = StepProtocol(self, status, self.cp_writes, self.cp_loads, self.cp_l3_cache)

    # ---- setup -----------------------------------------------------------
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
            "sglang-cp-hicache: copy kernels ready on cp_rank %d/%d: backend=%s, %d kernel(s) %s in %.2f s "
            "(cache dir: %s; set TRITON_CACHE_DIR to a persistent directory to skip this on restart)",
            self.cp_placement.cp_rank, self.cp_placement.cp_size, report.backend, report.compiled,
            ",".join(report.ops) or "-", report.seconds, report.cache_dir,
        )
        return report

    def _agree_with_peers(self, l3_view: str) -> HostSlotLedger:
        """The host ledger, once every CP rank has the same view (one
        all-gather at start-up, :mod:`sglang_cp_hicache.agreement`): every
        value below decides what a rank does without asking the others, so
        ranks that differ would diverge. Refused on every rank, naming the
        rank and value."""
        capacity = int(self.token_to_kv_pool_host.size)
        device = self.token_to_kv_pool_allocator.get_kvcache().kv_buffer[0].device
        view = RankView(self.cp_placement.cp_rank, self.cp_placement.cp_size, {
            agreement.PAGE_SIZE_KEY: self.page_size,
            agreement.HOST_LAYOUT_KEY: self.cache_controller.mem_pool_host.layout,
            agreement.HOST_POOL_SLOTS_KEY: capacity,
            HOST_BALANCE_ENV: self.cp_host_balance,
            agreement.COPY_BACKEND_KEY: transfer.select_backend(device),
            agreement.COPY_PATH_KEY: "library",
            # L3 on or off, and its namespaces (or why this rank's L3 is
            # unusable): a rank reading another namespace would miss where
            # the others hit.
            agreement.L3_KEY: l3_view,
        })
        try:
            gather_and_check(view, self._cp_group())
        except CpAgreementError as exc:
            hint = next((h for key, h in _AGREEMENT_HINTS.items() if f"disagree on {key}:" in str(exc)), None)
            if hint is None:
                raise
            raise CpAgreementError(f"{exc}; {hint}") from exc
        return HostSlotLedger([capacity] * self.cp_placement.cp_size)

    def _cp_group(self):
        """The group whose members are exactly the CP ranks: SGLang's
        ``attn_cp_cache_group``. (``_all_reduce`` also reduces over the
        attention-TP group, whose ranks share a cp_rank.) None for a group
        of one: ranks simulated in one process, or a lone rank -- only this
        rank's own view is checked then."""
        group = self.attn_cp_group
        if group is None or torch.distributed.get_world_size(group=group) <= 1:
            return None
        return group

    def reset(self) -> None:
        super().reset()
        old = self.root_node
        root = CpTreeNode(id=old.id, priority=old.priority)
        root.key, root.value, root.lock_ref = old.key, old.value, old.lock_ref
        root.hash_value = old.hash_value
        root.is_cp_root = True
        root.cp_pages = EMPTY_PAGES
        self.root_node = root
        self._empty_match_result = self._empty_match_result._replace(
            last_device_node=root, last_host_node=root, best_match_node=root
        )
        self.cp_status.clear()
        if self.cp_rows is not None:
            self.cp_rows.reset()
        if self.cp_host is None:
            return  # SGLang's __init__: nothing built yet
        self.cp_host.reset()
        self.cp_writes.reset()
        self.cp_loads.reset()
        self.cp_l3_cache.reset()

    # ---- what tests, tools and the scheduler read -------------------------------------
    @property
    def cp_l3(self) -> Optional[RankL3]:
        """This rank's L3 (None: off)."""
        return self.cp_l3_cache.rank_l3

    @property
    def host_slot_ledger(self) -> HostSlotLedger:
        return self.cp_host.ledger

    @property
    def host_leaf_index(self) -> HostLeafIndex:
        return self.cp_host.leaves

    def cp_prefix_pages(self, node: TreeNode) -> torch.Tensor:
        """CPU mirror of the device locs from the root down to ``node``
        (every node on the path must be on the device)."""
        return self.cp_page_mirror.prefix_pages(node, self.root_node)

    # ---- the tree: 0.5.18's bodies, CP-aware (upstream_0518) ----------------------------
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        result = upstream_0518.match_prefix(self, params)
        self.cp_l3_requests.remember_match(params.key, result)
        return result

    def _split_node(self, key: RadixKey, child: TreeNode, split_len: int):
        return upstream_0518.split_node(self, key, child, split_len)

    def insert(self, params: InsertParams) -> InsertResult:
        return upstream_0518.insert(self, params, self._insert_pages)

    def _insert_pages(self, value: torch.Tensor, value_pages: Optional[torch.Tensor]) -> torch.Tensor:
        """``value``'s CPU pages: the caller's mirror, else the row of the
        request whose ``cache_*_req`` is inserting (else one device read)."""
        if value_pages is None:
            value_pages = self.cp_rows.insert_pages(len(value))
        return self.cp_page_mirror.pages_for(value, value_pages)

    # ---- the scheduler's inserts: upstream's bodies, pages from the request's row ----
    def cache_unfinished_req(self, req, chunked: bool = False) -> None:
        with self.cp_rows.serving(req):
            super().cache_unfinished_req(req, chunked=chunked)
        self.cp_rows.checkpointed(req)

    def cache_finished_req(self, req, is_insert: bool = True, **kwargs) -> None:
        with self.cp_rows.serving(req):
            super().cache_finished_req(req, is_insert=is_insert, **kwargs)
        self.cp_rows.finished(req)

    def _evict_backuped(self, node: TreeNode) -> int:
        return upstream_0518.evict_backuped(self, node)

    def _evict_regular(self, node: TreeNode) -> int:
        return upstream_0518.evict_regular(self, node)

    # ---- write-through ---------------------------------------------------------------
    def write_backup(self, node: TreeNode, write_back: bool = False) -> int:
        return self.cp_writes.backup(node, write_back)

    def _finish_write_through_ack(self, ack_id: int, *, release_lock: bool) -> None:
        self.cp_l3_cache.store_acked(ack_id)  # before SGLang forgets the write's nodes
        self.cp_writes.keep(ack_id)
        super()._finish_write_through_ack(ack_id, release_lock=release_lock)

    # ---- the step's all-reduce ----------------------------------------------------------
    def _sync_hicache_ready_counts(self):
        return self.cp_steps.ready_counts()

    def writing_check(self, write_back: bool = False, finish_count: Optional[int] = None):
        if finish_count is None and not write_back:
            finish_count = self.cp_steps.write_finish_count()
        return super().writing_check(write_back=write_back, finish_count=finish_count)

    def loading_check(self, finish_count: Optional[int] = None):
        self.cp_loads.retire()
        if finish_count is None:
            finish_count = self.cp_steps.load_finish_count()
        super().loading_check(finish_count=finish_count)
        self.cp_loads.retire()

    # ---- host tier ----------------------------------------------------------------------
    def _update_host_leaf_status(self, node: TreeNode) -> None:
        self.cp_host.refresh(node)

    def evict_host(self, num_tokens: int) -> int:
        """Free ``num_tokens`` physical host slots on every rank (the same
        nodes everywhere); returns this rank's physical slots freed."""
        return self.cp_host.evict(num_tokens)

    # ---- load-back ----------------------------------------------------------------------
    def load_back(self, node: TreeNode, mem_quota: Optional[int] = None) -> Optional[torch.Tensor]:
        return self.cp_loads.load_back(node, mem_quota)

    def ready_to_load_host_cache(self) -> int:
        return self.cp_loads.start()

    def init_load_back(self, params: InitLoadBackParams):
        if params.mem_quota is None:
            # 0.5.18's PrefillAdder passes no quota: what is free or evictable,
            # less the room the request's own new tokens need.
            params.mem_quota = self.cp_loads.mem_quota(params)
        return super().init_load_back(params)

    def load_back_mem_quota(self, params: InitLoadBackParams) -> int:
        return self.cp_loads.mem_quota(params)

    # ---- L3 -------------------------------------------------------------------------------
    def l3_prefetch(self, key: RadixKey, rid: Optional[Hashable] = None) -> int:
        return self.cp_l3_cache.prefetch(key, rid)

    def l3_wait_io(self, timeout: Optional[float] = None) -> bool:
        return self.cp_l3_cache.wait_io(timeout)

    def check_hicache_events(self) -> None:
        super().check_hicache_events()
        self.cp_l3_cache.publish_metrics()
        if self.cp_metrics is not None:
            self.cp_metrics.publish()

    def clear_storage_backend(self) -> bool:
        return self.cp_l3_cache.clear()

    def prefetch_from_storage(
        self,
        req_id: str,
        last_host_node: TreeNode,
        new_input_tokens: List[int],
        last_hash: Optional[str] = None,
        prefix_keys: Optional[List[str]] = None,
    ) -> None:
        self.cp_l3_requests.prefetch_from_storage(req_id, last_host_node, new_input_tokens)

    def check_prefetch_progress(self, req_id: str) -> bool:
        return self.cp_l3_requests.check_prefetch_progress(req_id)

    def release_aborted_request(self, rid: str) -> None:
        self.cp_l3_requests.release_aborted_request(rid)

    def attach_storage_backend(
        self,
        storage_backend: str,
        storage_backend_extra_config_json: Optional[str] = None,
        served_model_name: Optional[str] = None,
        hicache_storage_prefetch_policy: Optional[str] = None,
        hicache_write_policy: Optional[str] = None,
    ) -> tuple[bool, str]:
        return refuse_runtime_attach(storage_backend)

    def detach_storage_backend(self) -> tuple[bool, str]:
        return self.cp_l3_requests.detach_storage_backend()

    # ---- device eviction + OOM reporting -------------------------------------
    def evict(self, params: EvictParams):
        result = super().evict(params)
        self.last_evict_result = result
        return result

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
