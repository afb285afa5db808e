"""One simulated scheduler rank on SGLang 0.5.23's KV-sharded DSA HiCache
(:mod:`sglang_cp_hicache.testing.stack_0523`), writing and verifying the same
deterministic KV + indexer content as :mod:`.engine_0518` (0.5.18).

Per request, in the same order on every rank (the 0.5.23 prefill scheduler's
flow, one request per batch)::

    match_prefix -> lock the device prefix -> evict for the request ->
    [host hit] init_load_back + ready_to_load_host_cache -> lock the
    request's last node -> verify every owned page of the matched prefix (KV
    rows and indexer row) -> evict + alloc_extend on the chain's rotation base
    -> write content into the owned new pages -> insert (rotation base,
    prev_prefix_len: the tree frees duplicates itself) -> release the
    request as the scheduler does (a ``Req`` with a ``req_to_token`` row,
    ``release_kv_cache``: frees the unaligned tail, or the whole own run
    when the insert was declined) -> unlock -> check_hicache_events

Upstream's sharded pool decides every owner: the allocator's rotation gives
page ``i`` of a chain to rank ``(base + i) % N``, host slots follow their
device pages' owners and a load-back allocates device pages of the host
pages' owners. The engine reads ownership off the logical locs with this
library's :class:`CpPlacement` (the same bijection; the differential
tests pin that) and checks owner preservation as an invariant.

``copy_path`` is the stack's: ``"upstream"`` (``owned_rows`` + the stock ops)
or ``"library"`` (this library's kernels through the 0.5.23 adapter). The CPU
time spent preparing indices and copying (``_move_write_operation``,
``_move_op_indices``, the engine's ``submit_*``) is measured per rank.

The tree's bookkeeping is counted by wrappers put on the built stack's
instances around whatever each holds (upstream's method, or the library's
replacement), so both copy paths are measured alike and behave as without
them: node backups and those refused (the cache's ``_execute_kv_backup``
returning None), device evictions (the FULL component's ``evict_component``
on a node with a device value, with the tokens it reports freed) and host
reads of device locs (the allocator's ``free`` called with locs outside a
free group: upstream's splits them by owner with ``torch.unique`` and masks).
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import asdict, replace
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    CacheRequestHandle,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.common import evict_from_tree_cache
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.components.base import EvictLayer

from sglang_cp_hicache.sim.copy_path_times import CopyPathTimes, timed as _timed
from sglang_cp_hicache.sim.engine_base import NewPages, PrefixHit, RankEngineBase, RequestInFlight
from sglang_cp_hicache.sim.records import EngineTotals
from sglang_cp_hicache.sglang_0523.controller import library_stack
from sglang_cp_hicache.testing.requests_0523 import LoadBackRequest, SchedulerRequests
from sglang_cp_hicache.testing.stack_0523 import ShardedRankStack

__all__ = ["CopyPathTimes", "ShardedSimRankEngine"]

_EMPTY = torch.empty((0,), dtype=torch.int64)
_FULL = ComponentType.FULL


class ShardedSimRankEngine(RankEngineBase):
    """Drives one rank's :class:`ShardedRankStack` request by request."""

    def __init__(self, stack: ShardedRankStack, *, content_seed: int = 0) -> None:
        self._bind_stack(stack, stack.placement, content_seed)
        self.cp_size = stack.config.cp_size
        self.copy_path = stack.config.copy_path
        self.copy_times = CopyPathTimes(self.copy_path)
        self._totals = EngineTotals()
        # Host pages per owner class (= rank) with nothing in use: what this
        # rank holds is its class's pages less its class's free ones.
        self._host_class_pages = self._host_class_free_pages()
        self._time_copy_path()
        self._count_transfers()
        self._count_bookkeeping()
        # L3 (the library stack with an L3 directory): its driver.
        record = library_stack(self.cache)
        self.l3 = record.l3 if record is not None else None
        if self.l3 is not None:
            self._record_l3_keys(self.l3)
        # One req_to_token row: the engine serves one request at a time.
        self.requests = SchedulerRequests(self.cache, rows=1, max_tokens=1 << 14)

    # ---- instrumentation (instance attributes shadow the bound methods) ------
    def _owned_tokens(self, logical: torch.Tensor) -> int:
        return int(self.placement.owned_by_this_rank(logical.to(torch.int64).cpu()).sum())

    def _time_copy_path(self) -> None:
        """CPU time in index preparation, submission and the consensus
        all-reduce; one queued operation per submit."""
        cache, ctrl = self.cache, self.cache.cache_controller
        engine = ctrl.l2_transfer_engine

        def add_prepare(seconds: float) -> None:
            self.copy_times.prepare_seconds += seconds
            self.copy_times.prepare_calls += 1

        def add_write_submit(seconds: float) -> None:
            self.copy_times.submit_seconds += seconds
            self.copy_times.submit_calls += 1
            self.acks.writes_queued += 1  # one merged write operation, one ack

        def add_load_submit(seconds: float) -> None:
            self.copy_times.submit_seconds += seconds
            self.copy_times.submit_calls += 1
            self.acks.loads_queued += 1

        def add_collective(seconds: float) -> None:
            self.collective_cpu_seconds += seconds
            self.collective_calls += 1

        ctrl._move_write_operation = _timed(ctrl._move_write_operation, add_prepare)
        ctrl._move_op_indices = _timed(ctrl._move_op_indices, add_prepare)
        engine.submit_device_to_host = _timed(engine.submit_device_to_host, add_write_submit)
        engine.submit_host_to_device = _timed(engine.submit_host_to_device, add_load_submit)
        cache._all_reduce_attn_groups = _timed(cache._all_reduce_attn_groups, add_collective)

    def _count_transfers(self) -> None:
        """Backups, load-backs and host frees as the controller and the host
        pool see them, in logical tokens and in this rank's owned slots."""
        ctrl = self.cache.cache_controller
        anchor = ctrl.mem_pool_host.anchor_entry.host_pool
        t = self._totals
        write, load, free_host = ctrl.write, ctrl.load, anchor.free

        def counted_write(device_indices: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            host = write(device_indices, *args, **kwargs)
            if host is None:  # counted where the backup gives up (_count_bookkeeping)
                return host
            owned = self._owned_tokens(host)
            t.write_backups += 1
            t.backup_tokens += int(len(host))
            t.backup_slots += owned
            t.zero_owned_writes += int(owned == 0)
            return host

        def counted_load(host_indices: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            device = load(host_indices, *args, **kwargs)
            if device is not None and host_indices.numel():
                owned = self._owned_tokens(host_indices)
                t.load_backs += 1
                t.load_back_tokens += int(host_indices.numel())
                t.load_slots += owned
                t.zero_owned_loads += int(owned == 0)
            return device

        def counted_free(indices: torch.Tensor) -> int:
            t.host_evicted_slots += self._owned_tokens(indices)
            t.host_evicted_nodes += 1
            return free_host(indices)

        ctrl.write, ctrl.load, anchor.free = counted_write, counted_load, counted_free

    def _count_bookkeeping(self) -> None:
        """Refused backups, device evictions and host reads of device locs,
        counted by wrappers on the built stack's instances around whatever
        method each holds (upstream's, or the library's replacement): the
        same measurement on both copy paths, no behaviour changed."""
        cache, allocator, t = self.cache, self.allocator, self._totals
        backup = cache._execute_kv_backup
        full = cache.components[_FULL]
        evict, free = full.evict_component, allocator.free

        def counted_backup(*args: Any, **kwargs: Any) -> Any:
            # Upstream gives up before calling write when one evict_host frees
            # too little: counting here, not at write, sees that refusal too.
            host = backup(*args, **kwargs)
            t.backups_attempted += 1
            t.write_failures += int(host is None)
            return host

        def counted_evict(node: Any, device_frees: dict, host_frees: dict, cache_actions: list,
                          target: EvictLayer = EvictLayer.DEVICE) -> tuple[int, int]:
            had_value = node.component(_FULL).value is not None
            freed, host_freed = evict(node, device_frees, host_frees, cache_actions, target=target)
            if had_value and EvictLayer.DEVICE in target:
                t.device_evictions += 1
                t.device_eviction_tokens += int(freed)
            return freed, host_freed

        def counted_free(free_index: torch.Tensor) -> Any:
            # Upstream's free splits the locs with torch.unique and boolean
            # masks (a device-to-host sync on a GPU) unless a free group defers it.
            if free_index.numel() and allocator.free_group is None:
                t.device_index_host_reads += 1
            return free(free_index)

        cache._execute_kv_backup, full.evict_component, allocator.free = counted_backup, counted_evict, counted_free

    def _library_counters(self, totals: EngineTotals) -> None:
        """The library stack's own counters (absent on upstream's)."""
        record = library_stack(self.cache)
        if record is not None:
            totals.host_room = asdict(record.host_room.counters)
            totals.device_frees = asdict(record.device_frees.counters)
            totals.warmup = {"backend": record.warmup.backend, "seconds": float(record.warmup.seconds)}

    # ---- L3: the scheduler's storage calls ----------------------------------------
    def _l3_prefetch(self, request: RequestInFlight) -> None:
        """What SGLang's scheduler does for an arriving request with a storage
        backend on (``_prefetch_kvcache``, then ``check_prefetch_progress``
        each step until it is True, then ``pop_prefetch_loaded_span``), alike
        on every rank: look the pages past the matched prefix up in L3."""
        cache, P = self.cache, self.page_size
        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", request.tokens))))
        matched = int(match.device_prefix_len) + int(match.host_hit_length)
        limit = len(request.tokens) - 1  # the scheduler matches at most input_len - 1 tokens
        if limit <= matched:
            return
        handle = CacheRequestHandle(f"sim-{request.record.index}", 0)
        anchor = match.last_host_node
        cache.prefetch_from_storage(
            handle, anchor, request.tokens[matched:limit], cache.get_last_hash_value(anchor), None,
            matched_prefix_tokens=request.tokens[:matched],
        )
        for _ in range(3):  # a lookup settles in two steps (query, fetch)
            if cache.check_prefetch_progress(handle):
                break
            # A server skips the request while reads run; here nothing else
            # runs, so wait for this rank's L3 reads: the steps are then the
            # query's MIN and the fetch's, as in every run.
            self.l3.wait_io()
            self._check_events()
        else:
            raise RuntimeError(f"L3 lookup of request {request.record.index} still pending after 3 steps")
        tokens, start = cache.pop_prefetch_loaded_span(handle)
        request.record.l3_hit_tokens = int(tokens)
        if tokens:
            self._l3_page_keys.update(request.keys[start + P - 1 : start + tokens : P].tolist())

    def _wait_l3_io(self) -> None:
        self.l3.wait_io()  # the last writes run on the L3 I/O threads

    # ---- SGLang calls -------------------------------------------------------
    def _reserve_tokens(self, new_tokens: int) -> int:
        # alloc_extend's conservative demand: one spare page per owner class.
        return new_tokens + self.page_size * self.cp_size

    def _make_room(self, new_tokens: int) -> int:
        before = self._device_tokens_in_tree()
        evict_from_tree_cache(self.cache, self._reserve_tokens(new_tokens))
        return max(before - self._device_tokens_in_tree(), 0)

    def _check_events(self) -> None:
        """The scheduler's per-iteration poll: flushes the deferred backups
        (new write acks), one MIN all-reduce of ready acks, then writing_check
        and loading_check consume that many."""
        ctrl = self.cache.cache_controller
        writes, loads = len(ctrl.ack_write_queue), len(ctrl.ack_load_queue)
        submitted = self.acks.writes_queued
        self.cache.check_hicache_events()
        writes += self.acks.writes_queued - submitted  # queued by the flush inside the poll
        self.acks.write_acks += writes - len(ctrl.ack_write_queue)
        self.acks.load_acks += loads - len(ctrl.ack_load_queue)

    def _alloc(self, prefix_len: int, total: int, last_loc: int, base: Optional[int]) -> tuple[Any, Optional[int]]:
        lens = torch.tensor([prefix_len, total], dtype=torch.int64)
        bases = [base]
        rotation = {"rotation_bases": bases} if self.cp_size > 1 else {}  # a plain allocator has no rotation
        out = self.allocator.alloc_extend(
            prefix_lens=lens[:1], prefix_lens_cpu=lens[:1], seq_lens=lens[1:], seq_lens_cpu=lens[1:],
            last_loc=torch.tensor([last_loc], dtype=torch.int64), extend_num_tokens=total - prefix_len,
            **rotation,
        )
        return out, bases[0]

    # ---- one request: the steps RankEngineBase.serve runs ----------------------
    def _match_and_load(self, request: RequestInFlight) -> PrefixHit:
        cache, record = self.cache, request.record
        if self.l3 is not None:
            self._l3_prefetch(request)
        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", request.tokens))))
        record.device_hit_tokens = int(match.device_prefix_len)
        record.host_hit_tokens = int(match.host_hit_length)
        device_locs = cache.path_device_indices(match.last_device_node)[: record.device_hit_tokens]
        admission = cache.lock(match.last_device_node)
        record.device_tokens_evicted += self._make_room(request.padded_len - record.device_hit_tokens)
        last_node = match.last_device_node
        loaded = _EMPTY
        if record.host_hit_tokens > 0:
            loaded, last_node = self._load_back(request, match)
        record.loaded_tokens = int(loaded.numel())
        request_lock = cache.lock(last_node)
        cache.unlock(admission)
        return PrefixHit(device_locs=device_locs.to(torch.int64), loaded=loaded, last_node=last_node,
                         lock=request_lock)

    def _load_back(self, request: RequestInFlight, match: Any) -> tuple[torch.Tensor, Any]:
        """``init_load_back`` on the chain's rotation base, within the quota
        the new tokens leave; the loaded locs are read off the tree."""
        record, cache = request.record, self.cache
        new_tokens = request.padded_len - record.device_hit_tokens - record.host_hit_tokens
        quota = max(self.allocator.available_size() - self._reserve_tokens(new_tokens), 0)
        load_request = LoadBackRequest(
            rid=f"sim-{record.index}", last_node=match.last_device_node,
            kv_rotation_base=cache.rotation_base_of(match.best_match_node),
        )
        num_loaded, last_node = cache.init_load_back(
            InitLoadBackParams(
                best_match_node=match.best_match_node, host_hit_length=record.host_hit_tokens,
                mem_quota=quota, req=load_request,
            )
        )
        cache.ready_to_load_host_cache()
        loaded = _EMPTY
        if num_loaded:
            loaded = cache.path_device_indices(last_node)[record.device_hit_tokens :].to(torch.int64)
        return loaded, last_node

    def _alloc_rest(self, request: RequestInFlight, hit: PrefixHit, prefix: torch.Tensor) -> Optional[NewPages]:
        prefix_len = int(prefix.numel())
        new_len = request.padded_len - prefix_len
        base = self.cache.rotation_base_of(hit.last_node) if prefix_len else None
        if new_len <= 0:
            return NewPages(locs=_EMPTY, rotation_base=base)
        request.record.device_tokens_evicted += self._make_room(new_len)
        last_loc = int(prefix[-1]) if prefix_len else -1
        new, base = self._alloc(prefix_len, request.padded_len, last_loc, base)
        return None if new is None else NewPages(locs=new.to(torch.int64), rotation_base=base)

    def _insert(self, request: RequestInFlight, hit: PrefixHit, prefix: torch.Tensor, new: NewPages) -> None:
        prefix_len, key_len = int(prefix.numel()), request.key_len
        locs = torch.cat([prefix, new.locs])
        tree_owned = prefix_len  # the tree owns [0, tree_owned) of the request's locs
        if key_len > prefix_len:
            result = self.cache.insert(
                InsertParams(
                    key=RadixKey(array("q", request.tokens[:key_len])), value=locs[:key_len].clone(),
                    rotation_base=new.rotation_base, prev_prefix_len=prefix_len,
                )
            )
            if not result.rotation_tail_declined:  # declined: the request keeps its own pages
                # The tree freed what it already held (between prev_prefix_len and its match).
                request.record.duplicate_tokens_freed = max(int(result.prefix_len) - prefix_len, 0)
                tree_owned = key_len
        if request.padded_len > tree_owned:
            self._release_request(request, locs, tree_owned, new.rotation_base, hit.last_node)

    def _release_request(
        self, request: RequestInFlight, locs: torch.Tensor, tree_owned: int, rotation_base: Optional[int],
        last_node: Any,
    ) -> None:
        """The scheduler's release of the request, its insert done: upstream's
        ``release_kv_cache`` frees ``[tree_owned, padded_len)``, the pages the
        request alone holds (the same calls on both copy paths)."""
        if locs.numel() > self.requests.pool.max_context_len:
            self.requests.grow(locs.numel())
        reads = self._totals.device_index_host_reads
        req = self.requests.admit(
            f"sim-{request.record.index}", request.tokens, locs, protected_len=tree_owned,
            rotation_base=rotation_base, last_node=last_node,
        )
        self.requests.release(req, checkpoint=False)
        self._totals.request_free_reads += self._totals.device_index_host_reads - reads

    def _release(self, hit: PrefixHit) -> None:
        self.cache.unlock(hit.lock)

    # ---- end of run ---------------------------------------------------------
    def _host_slots(self) -> tuple[int, int]:
        """(logical host slots in use, logical host slots) of the KV host pool."""
        slots = self.cache.cache_controller.mem_pool_host.anchor_entry.host_pool._slots
        return slots.size - slots.aggregate_free_size(), slots.size

    def _device_tokens_in_use(self) -> int:
        """Logical device tokens allocated (every owner class's free pages counted)."""
        return int(self.allocator.size - self.allocator.aggregate_free_size())

    def _host_class_free_pages(self) -> list[int]:
        """Free host pages of each owner class (the sharded slot allocator's
        per-class lists: class r is the pages rank r holds)."""
        slots = self.cache.cache_controller.mem_pool_host.anchor_entry.host_pool._slots
        return list(slots.class_free_page_counts())

    def host_slots_in_use(self) -> int:
        """Physical host slots this rank holds: its own class's pages in use."""
        rank = self.stack.cp_rank
        return (self._host_class_pages[rank] - self._host_class_free_pages()[rank]) * self.page_size

    def _root(self) -> Any:
        return self.cache.tree_core.root_node

    def _device_tokens_in_tree(self) -> int:
        return sum(len(n.component(_FULL).value) for n in self._nodes() if not n.evicted)

    def tree_digest(self) -> str:
        """Hash of the tree's shape and logical state: keys, logical device
        locs, logical host slots (mirrored on every rank under sharding),
        evicted / backed up, rotation base, locks."""
        rows = []

        def walk(node: Any, path: tuple) -> None:
            children = sorted(node.children.values(), key=lambda c: tuple(c.key.token_ids))
            for i, child in enumerate(children):
                data = child.component(_FULL)
                value = () if data.value is None else tuple(data.value.tolist())
                host = () if data.host_value is None else tuple(data.host_value.tolist())
                here = path + (i,)
                rows.append((here, tuple(child.key.token_ids), value, host, child.evicted, child.backuped,
                             child.rotation_base, data.lock_ref))
                walk(child, here)

        walk(self.cache.tree_core.root_node, ())
        return hashlib.sha256(repr(rows).encode()).hexdigest()[:16]

    def invariant_violations(self) -> list[str]:
        """No leaks with no request in flight, owners preserved, acks consumed."""
        out = []
        P = self.page_size
        nodes = self._nodes()
        host_in_use = self._host_slots()[0]
        host_in_tree = sum(len(n.component(_FULL).host_value) for n in nodes if n.backuped)
        if host_in_tree != host_in_use:
            out.append(f"logical host slots in use {host_in_use} != held by tree nodes {host_in_tree}")
        device_in_use = self._device_tokens_in_use()
        device_in_tree = self._device_tokens_in_tree()
        if device_in_tree != device_in_use:
            out.append(f"device tokens in use {device_in_use} != held by tree nodes {device_in_tree}")
        for node in nodes:
            data = node.component(_FULL)
            if data.value is not None and data.host_value is not None:
                device_owners = self.placement.owner_of(data.value[::P].to(torch.int64).cpu())
                host_owners = self.placement.owner_of(data.host_value[::P].to(torch.int64))
                if not torch.equal(device_owners, host_owners):
                    out.append(f"node {node.id}: host page owners {host_owners.tolist()} != device {device_owners.tolist()}")
        return out + self._leftovers([n.id for n in nodes if n.component(_FULL).lock_ref != 0])

    def totals(self) -> EngineTotals:
        totals = replace(
            self._totals, host_slot_capacity=self._host_class_pages[self.stack.cp_rank] * self.page_size,
            tree_digest=self.tree_digest(), invariant_violations=self.invariant_violations(),
        )
        self._library_counters(totals)
        self._l3_totals(totals)
        return totals
