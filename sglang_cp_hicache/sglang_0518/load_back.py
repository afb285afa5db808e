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
from typing import Any, Optional

import torch
from sglang.srt.disaggregation.kv_events import StorageMedium
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams
from sglang.srt.mem_cache.radix_cache import TreeNode

from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.policy_0518.load_back import LoadBackOutcome, collect_evicted_chain, cp_load_back
from sglang_cp_hicache.policy_0518.node_state import logical_host_len
from sglang_cp_hicache.policy_0518.plan import page_owners_of
from sglang_cp_hicache.sglang_0518.counters import CpHiCacheCounters
from sglang_cp_hicache.sglang_0518.step_status import StepStatus, Vote
from sglang_cp_hicache.sglang_0518.transfer_adapter import CpTransferAdapter, PendingLoad

logger = logging.getLogger(__name__)

__all__ = ["LoadBack", "LoadBackRecord"]


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


@dataclass(eq=False, repr=False)  # identity, not contents; the tree is too big to print
class LoadBack:
    """``load_back``, its quota and the load-backs in flight of one CP cache.

    ``tree``: the SGLang cache (its tree, locks, sizes, device eviction and
    allocator are read from it, nothing of this library); ``status``: where
    a local failure waits for the step's all-reduce."""

    tree: Any
    placement: CpPlacement
    transfer: CpTransferAdapter
    status: StepStatus
    counters: CpHiCacheCounters
    in_flight: list[LoadBackRecord] = field(default_factory=list, init=False)
    _seq: int = field(default=0, init=False)
    # Pages per owner lane that the other ranks took for load-backs this
    # rank failed to allocate, until the step's all-reduce takes them back.
    lane_shadow: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.lane_shadow = [0] * self.placement.cp_size

    def reset(self) -> None:
        self.in_flight = []
        self.lane_shadow = [0] * self.placement.cp_size

    def load_back(self, node: TreeNode, mem_quota: Optional[int] = None) -> Optional[torch.Tensor]:
        tree = self.tree
        start = time.perf_counter()
        attempt = _Attempt(node, tree.token_to_kv_pool_allocator.rr_cursor)
        try:
            outcome = cp_load_back(
                node,
                load_back_threshold=tree.load_back_threshold,
                mem_quota=mem_quota,
                inc_lock_ref=lambda n: tree.inc_lock_ref(n).delta,
                dec_lock_ref=tree.dec_lock_ref,
                load=lambda chain: self._load_chain(attempt, chain),
                evict_device=lambda num_tokens: self._evict_for_attempt(attempt),
            )
        finally:
            for n in attempt.chain:
                n.release_host()
        if attempt.failed_seq is not None:
            self._commit_failed(attempt)
            return None
        if outcome is None:
            self._count_declined(node, attempt)
            if attempt.chain:
                logger.warning(
                    "load_back: failed to load %d logical tokens for node %d even after "
                    "eviction; %s", sum(n.host_len for n in attempt.chain), node.id,
                    tree.available_and_evictable_str().strip(),
                )
            return None
        self._commit(attempt, outcome, start)
        return outcome.device_locs

    def _count_declined(self, node: TreeNode, attempt: _Attempt) -> None:
        """A load-back with host tokens to restore that did not happen
        (threshold, quota, no lane room): the live metrics' declined ones."""
        chain = attempt.chain or collect_evicted_chain(node)[0]
        tokens = sum(logical_host_len(n) for n in chain)
        if tokens:
            self.counters.load_backs_declined += 1
            self.counters.load_back_declined_tokens += tokens

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
        seq, self._seq = self._seq, self._seq + 1
        try:
            pending = self.transfer.queue_load(
                metadata, node_id=attempt.last_hit_node.id, **self.tree._get_extra_pools()
            )
            if pending is None:
                raise RuntimeError("owner-preserving allocation failed although every lane had room")
        except Exception as exc:  # the group hears of it at the step's all-reduce
            self.status.fail_load(Vote.FAILED, seq, exc)
            attempt.failed_seq = seq
            # Every other rank holds these pages now: count them as taken here
            # too, so this rank's later load-backs and evictions decide alike.
            for owner in page_owners_of(metadata, self.placement.page_size):
                self.lane_shadow[owner] += 1
            return None
        if pending.error is not None:  # pages taken, copy missing: the others' state, no data
            self.status.fail_load(Vote.FAILED, seq, pending.error)
        pending.keep()
        attempt.queued = pending
        return pending.plan.device_locs

    def _evict_for_attempt(self, attempt: _Attempt) -> int:
        if attempt.failed_seq is not None:
            return 0  # every other rank restored at the first try, without evicting
        return self._evict_device_for_lanes(attempt.chain)

    def _commit(self, attempt: _Attempt, outcome: LoadBackOutcome, start: float) -> None:
        """The restored nodes get their device pages (and CPU mirrors); the
        load-back is in flight until its ack is consumed."""
        tree = self.tree
        last_hit_node = attempt.last_hit_node
        pages = attempt.queued.plan.allocation.pages
        offset = 0
        for n in outcome.nodes:  # the CPU mirror of each restored node's new value
            num_pages = n.host_len // self.placement.page_size
            n.cp_pages = pages[offset : offset + num_pages]
            offset += num_pages
        tree.ongoing_load_back[last_hit_node.id] = last_hit_node
        self.in_flight.append(LoadBackRecord(
            self._seq - 1, last_hit_node, outcome.nodes[0].parent, outcome.host_hit_len,
            attempt.rr_cursor, attempt.queued,
        ))
        for n in outcome.nodes:
            tree._record_store_event(n, medium=StorageMedium.GPU)
        tree.evictable_size_ += outcome.host_hit_len
        tree.inc_lock_ref(last_hit_node)
        self.counters.load_backs += 1
        self.counters.load_back_tokens += outcome.host_hit_len
        if tree.metrics_collector is not None:
            tree.metrics_collector.observe_load_back_duration(time.perf_counter() - start)

    def _commit_failed(self, attempt: _Attempt) -> None:
        """What every other rank's successful load-back did, without the
        restore: in flight under the same sequence number, the same lock,
        the same sizes. The nodes stay evicted on this rank (requests of this
        step miss them here); the step's all-reduce takes it back everywhere."""
        tree = self.tree
        last_hit_node = attempt.last_hit_node
        tokens = sum(n.host_len for n in attempt.chain)
        tree.ongoing_load_back[last_hit_node.id] = last_hit_node
        self.in_flight.append(LoadBackRecord(
            attempt.failed_seq, last_hit_node, attempt.chain[0].parent, tokens, attempt.rr_cursor, None,
        ))
        tree.evictable_size_ += tokens
        tree.inc_lock_ref(last_hit_node)
        self.counters.load_backs += 1
        self.counters.load_back_tokens += tokens

    def free_lane_pages(self) -> list[int]:
        """Free pages per owner lane as every rank sees them: a rank whose
        allocation failed this step counts the pages the others took."""
        lanes = self.tree.token_to_kv_pool_allocator.lane_available_pages()
        return [a - s for a, s in zip(lanes, self.lane_shadow)]

    def _lane_need(self, metadata: list) -> list[int]:
        """Pages per owner lane a restore of ``metadata`` takes."""
        need = [0] * self.placement.cp_size
        for owner in page_owners_of(metadata, self.placement.page_size):
            need[owner] += 1
        return need

    def _lanes_fit(self, metadata: list) -> bool:
        """Whether every owner lane has the pages a restore of ``metadata``
        needs (the allocator mirror, identical on every rank)."""
        return all(n <= a for n, a in zip(self._lane_need(metadata), self.free_lane_pages()))

    def _evict_device_for_lanes(self, chain: list) -> int:
        """Evict device nodes (LRU, as upstream) until every owner lane the
        restored chain needs has enough free pages. Free pages of the wrong
        owner are of no use to an owner-preserving restore, so a plain
        ``evict(host_hit_len)`` can free enough tokens and still fail."""
        need = self._lane_need([n.cp_hicache for n in chain])
        evicted = 0
        while True:
            short = sum(max(0, n - a) for n, a in zip(need, self.free_lane_pages()))
            if short == 0:
                return evicted
            got = self.tree.evict(EvictParams(num_tokens=short * self.placement.page_size)).num_tokens_evicted
            if got == 0:
                return evicted
            evicted += got

    def start(self) -> int:
        """Start the queued loads, with no collective (SGLang's
        ``ready_to_load_host_cache``). If the copy raises on this rank, the
        step's all-reduce makes every rank take its load-backs back (nodes
        evicted again, pages freed, locks released) and raise."""
        started = self.transfer.start_loading()
        if started.error is not None:
            first = self.in_flight[0].seq if self.in_flight else self._seq
            self.status.fail_load(Vote.FAILED, first, started.error)
        return started.producer_id

    def retire(self) -> None:
        """Forget load-backs whose acks SGLang consumed."""
        ongoing = self.tree.ongoing_load_back
        self.in_flight = [r for r in self.in_flight if r.last_node.id in ongoing]

    # ---- the quota -------------------------------------------------------------
    def mem_quota(self, params: InitLoadBackParams) -> int:
        """Device tokens load-back may take: what is free now plus what device
        eviction can free (as stock ``HiRadixCache``, whose load-back evicts
        and retries), less the request's own new tokens (page-rounded) and
        one page of slack for the partially filled page it will extend.
        Without a request: all of it. The hit's own path is locked while the
        quota is applied (``cp_load_back`` subtracts the lock's delta), so it
        is never counted as room. Free pages and evictable tokens are the
        same on every rank (identical allocator and tree): so is the quota."""
        P = self.placement.page_size
        available = sum(self.free_lane_pages()) * P + int(self.tree.evictable_size())
        req = params.req
        if req is None:
            return available
        fill = getattr(req, "fill_ids", None) or getattr(req, "full_untruncated_fill_ids", [])
        prefix = len(getattr(req, "prefix_indices", ()))
        own_tokens = max(len(fill) - prefix - params.host_hit_length, 0)
        reserve = -(-own_tokens // P) * P + P
        return max(available - reserve, 0)

    # ---- taking load-backs back (the step's all-reduce) ---------------------------
    def take_back(self) -> None:
        """Undo every load-back whose ack has not been consumed (a failed
        load may share a merged copy, and its ack, with the others), newest
        first, with everything the step built on the restored nodes."""
        tree = self.tree
        records, self.in_flight = self.in_flight, []
        queue = tree.cache_controller.ack_load_queue
        for ack in queue:
            ack.finish_event.synchronize()
        queue.clear()
        # Loads queued but not started (their batch was dropped) go too: a
        # later start would copy into pages freed here.
        self.transfer.take_back_loads([r.load for r in records if r.load is not None])
        for record in reversed(records):
            if record.last_node.id in tree.ongoing_load_back:
                self._undo(record)
        allocator = tree.token_to_kv_pool_allocator
        if records:
            allocator.rewind_rr_cursor(records[0].rr_cursor)
        self.lane_shadow = [0] * self.placement.cp_size
        # A rank whose allocation failed never took the pages the others just
        # freed: the free SETS agree, the lists may not. Sorting every free
        # list makes the allocators identical again.
        allocator.merge_and_sort_free()

    def _undo(self, record: LoadBackRecord) -> None:
        """Evict the restored nodes again -- every piece of them, since a
        request may have split them -- after removing what the step built
        below them (new leaves, recomputed nodes): an evicted node keeps no
        node on the device below it. The same nodes on every rank (the tree
        is the same); each frees the pages it holds through its mirror."""
        tree = self.tree
        tree.ongoing_load_back.pop(record.last_node.id, None)
        tree.dec_lock_ref(record.last_node)
        if record.load is None:  # the sizes this rank counted without restoring
            tree.evictable_size_ -= record.tokens
        pieces = self._restored_pieces(record)
        ids = {id(p) for p in pieces}
        for piece in pieces:  # deepest first
            for child in list(piece.children.values()):
                if id(child) not in ids:
                    self._remove_built_on(child)
        for piece in pieces:
            if not piece.evicted:
                tree._evict_backuped(piece)
        self.counters.load_backs -= 1
        self.counters.load_back_tokens -= record.tokens
        self.counters.load_back_takebacks += 1
        self.counters.load_back_takeback_tokens += record.tokens

    def _restored_pieces(self, record: LoadBackRecord) -> list:
        """The nodes now holding the restored chain, deepest first: from the
        last restored node up to the node it hangs from (a split puts the
        new prefix node between them; the split node keeps the suffix)."""
        pieces, node = [], record.last_node
        while node is not record.ancestor:
            if node is None or node is self.tree.root_node:
                raise RuntimeError(
                    f"load-back of node {record.last_node.id} no longer hangs from its ancestor"
                )
            pieces.append(node)
            node = node.parent
        return pieces

    def _remove_built_on(self, top: TreeNode) -> None:
        """Take off the device every node at or below ``top`` that is on it
        (all built after the load-back: nothing below an evicted node is on
        the device), children first: backed-up ones are evicted, the others
        deleted; their pages go back to the allocator."""
        order, stack = [], [top]
        while stack:
            n = stack.pop()
            if not n.evicted:
                order.append(n)
                stack.extend(n.children.values())
        for n in reversed(order):
            if n.write_through_pending_id is not None:
                raise RuntimeError(f"node {n.id} still has a write in flight at a load take-back")
            if n.backuped:
                self.tree._evict_backuped(n)
            else:
                self.tree._evict_regular(n)
