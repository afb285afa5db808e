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

The class is assembled from one mixin per concern: :mod:`.write_through`
(write-through, the CPU page mirror), :mod:`.step_protocol` (the step's
all-reduce and the take-backs), :mod:`.host_tier` (ledger, host leaves, host
eviction, lane reclaim), :mod:`.load_back` (load-back and its quota),
:mod:`.l3_cache` (the L3 tier: ``--hicache-storage-backend file`` or
``SGLANG_CP_HICACHE_L3_DIR``), :mod:`.l3_requests` (SGLang's scheduler
prefetch calls, served by that tier) and
:mod:`.upstream_0518` (``match_prefix``, ``_split_node``, ``insert`` and the
device eviction bodies carried over from 0.5.18, each saying what differs).
This module builds the cache and keeps what SGLang asks of it at start-up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

from sglang_cp_hicache import settings
from sglang_cp_hicache.agreement import CpAgreementError, RankView, gather_and_check
from sglang_cp_hicache.kernels import transfer
from sglang_cp_hicache.policy_0518.host_eviction import HostLeafIndex, HostSlotLedger
from sglang_cp_hicache.sglang_0518 import check_sglang_version
from sglang_cp_hicache.sglang_0518.allocator import CpSharedPagedTokenToKVPoolAllocator
from sglang_cp_hicache.sglang_0518.checks import (
    HOST_BALANCE_ENV, check_cp_hicache_server_args, host_balance_policy, storage_location,
)
from sglang_cp_hicache.sglang_0518.hooks import check_hooks
from sglang_cp_hicache.sglang_0518.host_copies import cp_copies_installed, install_cp_copies
from sglang_cp_hicache.sglang_0518.host_tier import HostTierMixin, NoHostLeafSet
from sglang_cp_hicache.l3.rank import RankL3
from sglang_cp_hicache.sglang_0518.l3_cache import L3CacheMixin
from sglang_cp_hicache.sglang_0518.l3_metrics import install_metrics
from sglang_cp_hicache.sglang_0518.l3_port import L3Port0518
from sglang_cp_hicache.sglang_0518.l3_requests import L3RequestsMixin, source_label
from sglang_cp_hicache.sglang_0518.l3_tier import open_l3
from sglang_cp_hicache.sglang_0518.load_back import LoadBackMixin
from sglang_cp_hicache.sglang_0518.step_protocol import CpHiCacheTransferError, StepProtocolMixin
from sglang_cp_hicache.sglang_0518.step_status import StepStatus, Vote
from sglang_cp_hicache.sglang_0518.transfer_adapter import CpTransferAdapter
from sglang_cp_hicache.sglang_0518.tree_node import CpTreeNode
from sglang_cp_hicache.sglang_0518.upstream_0518 import Upstream0518Mixin
from sglang_cp_hicache.sglang_0518.write_through import EMPTY_PAGES, WriteThroughMixin

logger = logging.getLogger(__name__)

__all__ = ["CpHiRadixCache", "CpHiCacheCounters", "CpHiCacheTransferError", "CpInsertParams", "Vote"]


#: What to do about a start-up disagreement the agreement message cannot say.
_AGREEMENT_HINTS = {
    "host_pool_slots": "host pools are sized from the device pool: size every rank's device pool "
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


class CpHiRadixCache(
    L3RequestsMixin, L3CacheMixin,
    WriteThroughMixin, StepProtocolMixin, HostTierMixin, LoadBackMixin, Upstream0518Mixin, HiRadixCache
):
    """HiRadixCache whose host tier is CP-sharded (see module docstring)."""

    def __init__(self, params, server_args) -> None:
        check_sglang_version()
        check_hooks()  # SGLang's classes, before anything of theirs runs
        settings.check_all()  # a misspelt setting stops start-up, not a later copy
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
        self._host_leaves = HostLeafIndex(self._host_priority)
        self._ledger: Optional[HostSlotLedger] = None
        self._inflight_loads: list = []
        self._inflight_writes: dict = {}
        self._write_seq = 0
        self._load_seq = 0
        self._step_status = StepStatus()
        # Pages per owner lane that the other ranks took for load-backs this
        # rank failed to allocate, until the step's all-reduce takes them back.
        self._load_shadow = [0] * self.cp_placement.cp_size
        self._warned_device_page_read = False
        self.cp_l3: Optional[RankL3] = None
        super().__init__(params, _without_storage(server_args))
        self.evictable_host_leaves = NoHostLeafSet()  # the ordered index replaces SGLang's set
        self.cp_copy_targets = install_cp_copies(self.cache_controller, self.cp_placement)
        if not cp_copies_installed(self.cp_copy_targets):
            raise RuntimeError("CP copies did not take on this cache's host pools; refusing to start")
        self.cp_transfer = CpTransferAdapter(self.cache_controller, self.cp_placement, allocator)
        # Opened before the agreement, raised after it: a rank whose L3 is
        # unusable never leaves its peers waiting in the all-gather.
        opening = open_l3(self, location, source_label(location), server_args=server_args)
        self.cp_l3_location = location
        self._ledger = self._agree_with_peers(opening.view)
        opening.raise_if_unusable()
        if opening.tier is not None:
            self.cp_l3 = RankL3(opening.tier, L3Port0518(self, opening.tier), location)
            if params.enable_metrics:  # --enable-metrics: SGLang's storage metrics, fed by this L3
                install_metrics(self, self.cp_l3, server_args)
        self._log_l3_start()
        # New pages go preferably to the ranks holding the fewest host slots.
        allocator.set_lane_bias(lambda: self._ledger.used)
        # ...and when the least loaded rank has no free device page, one is
        # made free by evicting for that lane (keeps host shares within a page).
        allocator.set_lane_reclaim(self._reclaim_lane if self.cp_host_balance == "exact" else None)
        self.cp_warmup = self._warm_up_copies()

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
            "cp-hicache: copy kernels ready on cp_rank %d/%d: backend=%s, %d kernel(s) %s in %.2f s "
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
            "page_size": self.page_size,
            "host_layout": self.cache_controller.mem_pool_host.layout,
            "host_pool_slots": capacity,
            HOST_BALANCE_ENV: self.cp_host_balance,
            "copy_backend": transfer.select_backend(device),
            "copy_path": "library",
            # L3 on or off, and its namespaces (or why this rank's L3 is
            # unusable): a rank reading another namespace would miss where
            # the others hit.
            "l3": l3_view,
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
        self._host_leaves = HostLeafIndex(self._host_priority)
        self._inflight_loads = []
        self._inflight_writes = {}
        self._step_status = StepStatus()
        self._load_shadow = [0] * self.cp_placement.cp_size
        if self.cp_l3 is not None:  # the lookups go with the tree and host pool (their I/O writes no more)
            self.cp_l3.prefetcher.reset()
        if self._ledger is not None:
            self._ledger = HostSlotLedger(list(self._ledger.capacity))

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
