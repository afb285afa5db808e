"""Load-back of the CP cache: restore a chain of evicted nodes from the host
tier, with the page owners they had at backup (owner preservation).

Thresholds and quotas use logical lengths (``host_len``). Pages come from
the owner lanes of the allocator, which is identical on every rank, so every
rank decides the same; a rank whose allocation or copy fails anyway records
it for the step's all-reduce (:mod:`.step_protocol`), which takes the
load-backs back on every rank. Until then it keeps deciding as the others:
a copy that could not be prepared or started leaves the pages and tree edits
in place (only the bytes are missing); an allocation that failed is recorded
as if it had succeeded (same lock, same sizes, nodes left evicted here) and
its pages are counted as taken for the step's later load-back decisions, so
this rank evicts exactly what the others evict.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from sglang.srt.disaggregation.kv_events import StorageMedium
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams
from sglang.srt.mem_cache.radix_cache import TreeNode

from sglang_cp_hicache.policy_0518.load_back import LoadBackOutcome, cp_load_back
from sglang_cp_hicache.policy_0518.plan import page_owners_of
from sglang_cp_hicache.sglang_0518.step_status import Vote
from sglang_cp_hicache.sglang_0518.transfer_adapter import PendingLoad

logger = logging.getLogger(__name__)

__all__ = ["LoadBackMixin", "LoadBackRecord"]


@dataclass
class LoadBackRecord:
    """A load-back whose ack has not been consumed yet. ``load`` is None on
    a rank whose device allocation failed: it records the load-back every
    other rank made (same nodes, locks and sizes) without restoring it."""

    seq: int
    last_node: TreeNode
    ancestor: TreeNode  # the on-device node the restored chain hangs from
    tokens: int  # logical tokens restored (on every rank)
    rr_cursor: int  # the allocator's round-robin cursor before the load-back
    load: Optional[PendingLoad]


@dataclass
class _Attempt:
    """One ``load_back`` call in progress: the chain whose host copies are
    protected, the load queued for it, or the allocation that failed here."""

    last_hit_node: TreeNode
    rr_cursor: int
    chain: list = field(default_factory=list)
    queued: Optional[PendingLoad] = None
    failed_seq: Optional[int] = None  # this rank's allocation failed (every other rank's did not)


class LoadBackMixin:
    """``load_back`` and its quota, for :class:`CpHiRadixCache`."""

    def load_back(self, node: TreeNode, mem_quota: Optional[int] = None) -> Optional[torch.Tensor]:
        start = time.perf_counter()
        attempt = _Attempt(node, self.token_to_kv_pool_allocator.rr_cursor)
        try:
            outcome = cp_load_back(
                node,
                load_back_threshold=self.load_back_threshold,
                mem_quota=mem_quota,
                inc_lock_ref=lambda n: self.inc_lock_ref(n).delta,
                dec_lock_ref=self.dec_lock_ref,
                load=lambda chain: self._load_chain(attempt, chain),
                evict_device=lambda num_tokens: self._evict_for_attempt(attempt),
            )
        finally:
            for n in attempt.chain:
                n.release_host()
        if attempt.failed_seq is not None:
            self._commit_failed_load_back(attempt)
            return None
        if outcome is None:
            if attempt.chain:
                logger.warning(
                    "load_back: failed to load %d logical tokens for node %d even after "
                    "eviction; %s", sum(n.host_len for n in attempt.chain), node.id,
                    self.available_and_evictable_str().strip(),
                )
            return None
        self._commit_load_back(attempt, outcome, start)
        return outcome.device_locs

    def _load_chain(self, attempt: _Attempt, chain: list) -> Optional[torch.Tensor]:
        """Allocate (owner-preserving) and queue the restore of ``chain``;
        the device locs, or None when it does not fit or failed here."""
        if not attempt.chain:
            for n in chain:
                n.protect_host()
            attempt.chain.extend(chain)
        if attempt.failed_seq is not None:
            return None  # the others restored it at the first try: nothing more to decide
        metadata = [n.cp_hicache for n in chain]
        # The allocator is identical on every rank: its lanes decide for all.
        if not self._lanes_fit(metadata):
            return None
        seq, self._load_seq = self._load_seq, self._load_seq + 1
        try:
            pending = self.cp_transfer.queue_load(
                metadata, node_id=attempt.last_hit_node.id, **self._get_extra_pools()
            )
            if pending is None:
                raise RuntimeError("owner-preserving allocation failed although every lane had room")
        except Exception as exc:  # the group hears of it at the step's all-reduce
            self._step_status.fail_load(Vote.FAILED, seq, exc)
            attempt.failed_seq = seq
            # Every other rank holds these pages now: count them as taken here
            # too, so this rank's later load-backs and evictions decide alike.
            for owner in page_owners_of(metadata, self.page_size):
                self._load_shadow[owner] += 1
            return None
        if pending.error is not None:  # pages taken, copy missing: the others' state, no data
            self._step_status.fail_load(Vote.FAILED, seq, pending.error)
        pending.keep()
        attempt.queued = pending
        return pending.plan.device_locs

    def _evict_for_attempt(self, attempt: _Attempt) -> int:
        if attempt.failed_seq is not None:
            return 0  # every other rank restored at the first try, without evicting
        return self._evict_device_for_lanes(attempt.chain)

    def _commit_load_back(self, attempt: _Attempt, outcome: LoadBackOutcome, start: float) -> None:
        """The restored nodes get their device pages (and CPU mirrors); the
        load-back is in flight until its ack is consumed."""
        last_hit_node = attempt.last_hit_node
        pages = attempt.queued.plan.allocation.pages
        offset = 0
        for n in outcome.nodes:  # the CPU mirror of each restored node's new value
            num_pages = n.host_len // self.page_size
            n.cp_pages = pages[offset : offset + num_pages]
            offset += num_pages
        self.ongoing_load_back[last_hit_node.id] = last_hit_node
        self._inflight_loads.append(LoadBackRecord(
            self._load_seq - 1, last_hit_node, outcome.nodes[0].parent, outcome.host_hit_len,
            attempt.rr_cursor, attempt.queued,
        ))
        for n in outcome.nodes:
            self._record_store_event(n, medium=StorageMedium.GPU)
        self.evictable_size_ += outcome.host_hit_len
        self.inc_lock_ref(last_hit_node)
        self.cp_counters.load_backs += 1
        self.cp_counters.load_back_tokens += outcome.host_hit_len
        if self.metrics_collector is not None:
            self.metrics_collector.observe_load_back_duration(time.perf_counter() - start)

    def _commit_failed_load_back(self, attempt: _Attempt) -> None:
        """What every other rank's successful load-back did, without the
        restore: in flight under the same sequence number, the same lock,
        the same sizes. The nodes stay evicted on this rank (requests of this
        step miss them here); the step's all-reduce takes it back everywhere."""
        last_hit_node = attempt.last_hit_node
        tokens = sum(n.host_len for n in attempt.chain)
        self.ongoing_load_back[last_hit_node.id] = last_hit_node
        self._inflight_loads.append(LoadBackRecord(
            attempt.failed_seq, last_hit_node, attempt.chain[0].parent, tokens, attempt.rr_cursor, None,
        ))
        self.evictable_size_ += tokens
        self.inc_lock_ref(last_hit_node)
        self.cp_counters.load_backs += 1
        self.cp_counters.load_back_tokens += tokens

    def _free_lane_pages(self) -> list[int]:
        """Free pages per owner lane as every rank sees them: a rank whose
        allocation failed this step counts the pages the others took."""
        lanes = self.token_to_kv_pool_allocator.lane_available_pages()
        return [a - s for a, s in zip(lanes, self._load_shadow)]

    def _lanes_fit(self, metadata: list) -> bool:
        """Whether every owner lane has the pages a restore of ``metadata``
        needs (the allocator mirror, identical on every rank)."""
        need = [0] * self.cp_placement.cp_size
        for owner in page_owners_of(metadata, self.page_size):
            need[owner] += 1
        return all(n <= a for n, a in zip(need, self._free_lane_pages()))

    def _evict_device_for_lanes(self, chain: list) -> int:
        """Evict device nodes (LRU, as upstream) until every owner lane the
        restored chain needs has enough free pages. Free pages of the wrong
        owner are of no use to an owner-preserving restore, so a plain
        ``evict(host_hit_len)`` can free enough tokens and still fail."""
        owners = page_owners_of([n.cp_hicache for n in chain], self.page_size)
        need = [0] * self.cp_placement.cp_size
        for o in owners:
            need[o] += 1
        evicted = 0
        while True:
            short = sum(max(0, n - a) for n, a in zip(need, self._free_lane_pages()))
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

    # ---- the quota -------------------------------------------------------------
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
        available = sum(self._free_lane_pages()) * self.page_size
        req = params.req
        if req is None:
            return available
        fill = getattr(req, "fill_ids", None) or getattr(req, "full_untruncated_fill_ids", [])
        prefix = len(getattr(req, "prefix_indices", ()))
        own_tokens = max(len(fill) - prefix - params.host_hit_length, 0)
        P = self.page_size
        reserve = -(-own_tokens // P) * P + P
        return max(available - reserve, 0)
