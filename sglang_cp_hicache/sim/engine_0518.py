"""One simulated scheduler rank: serves requests against a real SGLang 0.5.18
HiCache stack (:mod:`sglang_cp_hicache.testing.stack_0518`), writing and verifying
deterministic KV + indexer content.

Per request, in the same order on every rank (the SGLang contract)::

    match_prefix -> lock the device prefix -> make room (evict) ->
    [host hit] init_load_back + ready_to_load_host_cache -> lock the request's
    last node -> verify every owned page of the matched
    prefix -> alloc the rest (evict the shortfall first) -> write content into
    the owned new pages -> insert -> free duplicates + the unaligned tail ->
    unlock -> check_hicache_events (writing_check + loading_check)

This is the scheduler's flow in 0.5.18 (``PrefillAdder`` admission lock +
``init_load_back``, ``alloc_for_extend`` + ``evict_from_tree_cache``,
``cache_finished_req``), collapsed to one request per batch. Content lives in
:mod:`sglang_cp_hicache.testing.content`; a token's content key is a rolling hash
of its prefix, so a restored page is right only if it holds exactly the bytes
written for that prefix. Works on a plain (non-CP) HiRadixCache too, where this
one process owns every page.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.radix_cache import RadixKey

from sglang_cp_hicache.l3.prefetch import path_length
from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.sglang_0518.hiradix import CpInsertParams
from sglang_cp_hicache.sim.engine_base import NewPages, PrefixHit, RankEngineBase, RequestInFlight
from sglang_cp_hicache.sim.records import EngineTotals
from sglang_cp_hicache.testing.stack_0518 import CpRankStack

__all__ = ["SimRankEngine"]

_EMPTY = torch.empty((0,), dtype=torch.int64)
#: Steps a prefetch takes to settle: the query's MIN, then the fetch's.
_L3_MAX_STEPS = 2


class SimRankEngine(RankEngineBase):
    """Drives one rank's :class:`CpRankStack` (CP or plain) request by request."""

    def __init__(self, stack: CpRankStack, *, content_seed: int = 0) -> None:
        self.cp_mode = stack.config.cp_mode
        # Plain mode: one process owns every page, physical == logical.
        placement = getattr(stack.allocator, "placement", CpPlacement(stack.config.page_size, 1, 0))
        self._bind_stack(stack, placement, content_seed)
        self._backup_tokens = 0
        self._plain_host_evicted_slots = 0
        self._plain_load_backs = 0
        self._plain_load_back_tokens = 0
        self._plain_writes = 0
        self._plain_loads = 0
        self._count_backups()
        # L3 (CP with an L3 directory): the tier, and the spans of the nodes
        # inserted from L3 by the last prefetch.
        self.l3 = getattr(self.cache, "cp_l3", None) if self.cp_mode else None
        self._l3_spans: list[tuple[int, int]] = []
        # What the scheduler's pop_prefetch_loaded_tokens reported, and the
        # tokens of the nodes L3 inserted: equal, or the run reports it.
        self._l3_storage_hit_tokens = 0
        self._l3_inserted_tokens = 0
        if self.l3 is not None:
            self._record_l3_nodes()
            self._record_l3_keys(self.l3)

    # ---- instrumentation --------------------------------------------------
    def _count_backups(self) -> None:
        """Count what SGLang's own write path reports, without changing it:
        instance attributes shadow the bound methods HiRadixCache calls."""
        cache, ctrl = self.cache, self.cache.cache_controller
        write_backup = cache.write_backup

        def counted_write_backup(node: Any, write_back: bool = False) -> int:
            n = write_backup(node, write_back)
            self._backup_tokens += int(n)
            return n

        cache.write_backup = counted_write_backup
        all_reduce = cache._all_reduce

        def timed_all_reduce(data: torch.Tensor, op: Any) -> Any:
            start = time.process_time()
            try:
                return all_reduce(data, op)
            finally:
                self.collective_cpu_seconds += time.process_time() - start
                self.collective_calls += 1

        cache._all_reduce = timed_all_reduce
        if self.cp_mode:
            return  # CpHiRadixCache counts host eviction and transfers itself
        evict_host, write, load = ctrl.evict_host, ctrl.write, ctrl.load

        def counted_evict_host(host_indices: torch.Tensor, *args: Any, **kwargs: Any) -> int:
            n = evict_host(host_indices, *args, **kwargs)
            self._plain_host_evicted_slots += int(n)
            return n

        def counted_write(*args: Any, **kwargs: Any) -> Any:
            out = write(*args, **kwargs)
            self._plain_writes += int(out is not None)
            return out

        def counted_load(*args: Any, **kwargs: Any) -> Any:
            out = load(*args, **kwargs)
            self._plain_loads += int(out is not None)
            return out

        ctrl.evict_host, ctrl.write, ctrl.load = counted_evict_host, counted_write, counted_load

    def _record_l3_nodes(self) -> None:
        """Note (start, length) in tokens of every host-only node the cache
        inserts from L3, without changing what it does."""
        port = self.cache.cp_l3.port
        insert = port.insert_host_node

        def recorded(anchor: Any, key: Any, meta: Any) -> None:
            insert(anchor, key, meta)
            self._l3_spans.append((path_length(anchor), len(key)))

        port.insert_host_node = recorded

    def _l3_prefetch(self, request: RequestInFlight) -> None:
        """L3 as SGLang's scheduler drives it with ``--hicache-storage-backend
        file``, alike on every rank: on arrival ``_prefetch_kvcache`` matches
        and calls ``prefetch_from_storage`` with the deepest node whose host
        copy is final and the tokens past the match; the waiting queue then
        skips the request each step (one ``check_hicache_events``, whose MINs
        settle the query and then the fetch) until ``check_prefetch_progress``
        says True, and takes ``pop_prefetch_loaded_tokens`` as its storage hit."""
        cache = self.cache
        self._l3_spans.clear()
        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(request.tokens)))
        anchor = match.last_host_node
        if not (cache.is_backuped(anchor) or cache.is_root(anchor)):
            return
        matched = int(match.device_indices.numel()) + int(match.host_hit_length)
        rid = f"sim-{request.record.index}"
        cache.prefetch_from_storage(rid, anchor, request.tokens[matched:], cache.get_last_hash_value(anchor), None)
        steps = 0
        while not cache.check_prefetch_progress(rid):
            if steps == _L3_MAX_STEPS:
                raise RuntimeError(f"L3 prefetch of request {request.record.index} not settled after {steps} steps")
            # A server skips the request while reads run; here nothing else
            # runs, so wait for this rank's reads: the steps are then the
            # query's MIN and the fetch's, as in every run.
            cache.l3_wait_io()
            self._check_events()
            steps += 1
        staged = cache.pop_prefetch_loaded_tokens(rid)
        self._l3_storage_hit_tokens += staged
        request.record.l3_hit_tokens = int(staged)
        P = self.page_size
        for start, length in self._l3_spans:
            self._l3_inserted_tokens += length
            ends = request.keys[start + P - 1 : start + length : P]
            self._l3_page_keys.update(ends.tolist())

    # ---- SGLang calls -------------------------------------------------------
    def _make_room(self, num_tokens: int) -> int:
        """``evict_from_tree_cache``: evict only the shortfall."""
        available = self.allocator.available_size()
        if num_tokens <= available:
            return 0
        return int(self.cache.evict(EvictParams(num_tokens=num_tokens - available)).num_tokens_evicted)

    def _check_events(self) -> None:
        """The scheduler's per-iteration ``check_hicache_events``: one MIN
        all-reduce of ready write/load acks, then writing_check and
        loading_check consume that many."""
        ctrl = self.cache.cache_controller
        writes, loads = len(ctrl.ack_write_queue), len(ctrl.ack_load_queue)
        self.cache.check_hicache_events()
        self.acks.write_acks += writes - len(ctrl.ack_write_queue)
        self.acks.load_acks += loads - len(ctrl.ack_load_queue)

    def host_slots_in_use(self) -> int:
        host = self.cache.token_to_kv_pool_host
        return int(host.size - host.available_size())

    # ---- one request: the steps RankEngineBase.serve runs ----------------------
    def _match_and_load(self, request: RequestInFlight) -> PrefixHit:
        cache, record = self.cache, request.record
        if self.l3 is not None:
            self._l3_prefetch(request)
        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(request.tokens)))
        device_locs = match.device_indices.to(torch.int64)
        record.device_hit_tokens = int(device_locs.numel())
        record.host_hit_tokens = int(match.host_hit_length)
        admission = match.last_device_node
        cache.inc_lock_ref(admission)
        record.device_tokens_evicted += self._make_room(request.padded_len - record.device_hit_tokens)
        loaded, last_node = _EMPTY, admission
        if record.host_hit_tokens > 0:
            loaded, last_node = self._load_back(request, match)
        record.loaded_tokens = int(loaded.numel())
        cache.inc_lock_ref(last_node)  # the request's lock (req.last_node)
        cache.dec_lock_ref(admission)
        return PrefixHit(device_locs=device_locs, loaded=loaded, last_node=last_node, lock=last_node)

    def _load_back(self, request: RequestInFlight, match: Any) -> tuple[torch.Tensor, Any]:
        """``init_load_back`` within the quota the new tokens leave, then the load."""
        record, cache = request.record, self.cache
        new_tokens = request.padded_len - record.device_hit_tokens - record.host_hit_tokens
        quota = max(self.allocator.available_size() - new_tokens, 0)
        loaded, last_node = cache.init_load_back(
            InitLoadBackParams(
                best_match_node=match.best_match_node,
                host_hit_length=record.host_hit_tokens,
                mem_quota=quota,
            )
        )
        cache.ready_to_load_host_cache()
        loaded = loaded.to(torch.int64)
        if loaded.numel():
            self._plain_load_backs += 1
            self._plain_load_back_tokens += int(loaded.numel())
        return loaded, last_node

    def _alloc_rest(self, request: RequestInFlight, hit: PrefixHit, prefix: torch.Tensor) -> Optional[NewPages]:
        record, allocator = request.record, self.allocator
        new_len = request.padded_len - prefix.numel()
        record.device_tokens_evicted += self._make_room(new_len)
        if new_len <= 0:
            return NewPages(locs=_EMPTY, pages=_EMPTY)
        if not self.cp_mode:
            new = allocator.alloc(new_len)
            return None if new is None else NewPages(locs=new.to(torch.int64))
        # The CP allocator also hands out the CPU page mirror, and may evict
        # for a lane that is short (host balance).
        reclaimed = self.cache.cp_counters.lane_reclaim_tokens
        got = allocator.alloc_mirrored(new_len)
        record.device_tokens_reclaimed = self.cache.cp_counters.lane_reclaim_tokens - reclaimed
        record.device_tokens_evicted += record.device_tokens_reclaimed
        return None if got is None else NewPages(locs=got.locs.to(torch.int64), pages=got.pages)

    def _insert(self, request: RequestInFlight, hit: PrefixHit, prefix: torch.Tensor, new: NewPages) -> None:
        cache, allocator, key_len = self.cache, self.allocator, request.key_len
        locs = torch.cat([prefix, new.locs])
        key = RadixKey(request.tokens[:key_len])
        if self.cp_mode:
            # The CPU page mirror of the value: the cache never reads it back.
            pages = torch.cat([cache.cp_prefix_pages(hit.last_node), new.pages])
            params = CpInsertParams(key=key, value=locs[:key_len].clone(), value_pages=pages)
        else:
            params = InsertParams(key=key, value=locs[:key_len].clone())
        result = cache.insert(params)
        # cache_finished_req: free what the tree already had, then the tail
        duplicates = locs[prefix.numel() : max(int(result.prefix_len), prefix.numel())]
        request.record.duplicate_tokens_freed = int(duplicates.numel())
        if duplicates.numel():
            allocator.free(duplicates)
        if locs.numel() > key_len:
            allocator.free(locs[max(key_len, prefix.numel()) :])

    def _release(self, hit: PrefixHit) -> None:
        self.cache.dec_lock_ref(hit.lock)

    # ---- end of run ---------------------------------------------------------
    def _host_slots_of(self, node: Any) -> int:
        if self.cp_mode:
            meta = getattr(node, "cp_hicache", None)
            return 0 if meta is None else int(meta.num_host_slots)
        return 0 if node.host_value is None else int(len(node.host_value))

    def tree_digest(self) -> str:
        """Hash of the tree's shape and logical state (keys, logical device
        locs, evicted / backed-up, logical host length, locks). Identical on
        every CP rank when they took identical decisions; per-rank physical
        host slots are left out."""
        rows = []

        def walk(node: Any, path: tuple) -> None:
            children = sorted(node.children.values(), key=lambda c: tuple(c.key.token_ids))
            for i, child in enumerate(children):
                host_len = child.host_len if self.cp_mode else (
                    0 if child.host_value is None else len(child.host_value)
                )
                value = () if child.evicted else tuple(child.value.tolist())
                here = path + (i,)
                rows.append((here, tuple(child.key.token_ids), value, child.evicted, child.backuped,
                             host_len, child.lock_ref))
                walk(child, here)

        walk(self.cache.root_node, ())
        return hashlib.sha256(repr(rows).encode()).hexdigest()[:16]

    def invariant_violations(self) -> list[str]:
        """No leaks, with no request in flight: host slots in use equal those the
        tree holds, device tokens in use equal the tree's device tokens."""
        out = []
        nodes = self._nodes()
        host_in_tree = sum(self._host_slots_of(n) for n in nodes)
        if host_in_tree != self.host_slots_in_use():
            out.append(f"host slots in use {self.host_slots_in_use()} != held by tree nodes {host_in_tree}")
        device_in_tree = sum(len(n.value) for n in nodes if not n.evicted)
        device_in_use = int(self.allocator.size - self.allocator.available_size())
        if device_in_tree != device_in_use:
            out.append(f"device tokens in use {device_in_use} != held by tree nodes {device_in_tree}")
        if self._l3_storage_hit_tokens != self._l3_inserted_tokens:
            out.append(f"L3 storage hits reported {self._l3_storage_hit_tokens} != inserted {self._l3_inserted_tokens}")
        prefetcher = self.l3.prefetcher if self.l3 is not None else None
        if prefetcher is not None and (prefetcher.pending or prefetcher.waiting):
            out.append(f"L3 prefetches left: {len(prefetcher.pending)} pending, {len(prefetcher.waiting)} waiting")
        return out + self._leftovers([n.id for n in nodes if n.lock_ref != 0])

    def totals(self) -> EngineTotals:
        host = self.cache.token_to_kv_pool_host
        totals = EngineTotals(
            backup_tokens=self._backup_tokens,
            host_slot_capacity=int(host.size),
            tree_digest=self.tree_digest(),
            invariant_violations=self.invariant_violations(),
        )
        if self.cp_mode:
            c, s = self.cache.cp_counters, self.cache.cp_transfer.stats
            totals.write_backups, totals.write_failures = c.write_backups, c.write_failures
            totals.host_evicted_slots, totals.host_evicted_nodes = c.host_evicted_slots, c.host_evicted_nodes
            totals.load_backs, totals.load_back_tokens = c.load_backs, c.load_back_tokens
            totals.device_page_reads = c.device_page_reads
            totals.lane_reclaims = self.allocator.lane_reclaims
            totals.uneven_picks = self.allocator.uneven_picks
            totals.host_balance = self.cache.cp_host_balance
            totals.backup_slots, totals.load_slots = s.backup_slots, s.load_slots
            totals.zero_owned_writes, totals.zero_owned_loads = s.zero_owned_writes, s.zero_owned_loads
            self.acks.writes_queued, self.acks.loads_queued = s.writes, s.loads
            self._l3_totals(totals)
        else:
            totals.write_backups = self._plain_writes
            totals.backup_slots = self._backup_tokens
            totals.host_evicted_slots = self._plain_host_evicted_slots
            totals.load_backs = self._plain_load_backs
            totals.load_back_tokens = self._plain_load_back_tokens
            totals.load_slots = self._plain_load_back_tokens
            self.acks.writes_queued, self.acks.loads_queued = self._plain_writes, self._plain_loads
        return totals

    def _wait_l3_io(self) -> None:
        self.cache.l3_wait_io()  # the last writes run on the L3 worker thread
