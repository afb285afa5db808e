"""L3 on the KV-sharded DSA cache (SGLang 0.5.23), driven by SGLang's scheduler.

SGLang's own storage controller stays off (the stack is built without a
storage backend: its threads would write rank-local rows under logical slots
and key objects by rank). :class:`L3Driver` instead serves, on the cache
instance, the calls SGLang's scheduler makes when ``--hicache-storage-backend``
is set, with the library's protocol -- no collective of its own:

* ``prefetch_from_storage`` (a request arrives, alike on every rank): the
  whole pages past the matched prefix, when that prefix ends at the root or
  at a node whose host copy is final. The owners are the chain's rotation
  phase (the anchor's rotation base + its depth in pages; a root anchor
  starts a chain on the least-full host class), identical on every rank.
  Each rank checks that the KV and indexer objects of its own pages exist.
* ``check_hicache_events`` (every step): the local prefixes of the pending
  lookups ride the MIN all-reduce of ready acks SGLang already runs (one
  word per pending lookup, the same count on every rank). A *query* agreed
  on ``n`` present pages becomes a *fetch*: host room for ``n`` pages of the
  chain's classes (owner-aware, alike on every rank), logical host slots
  from the chain's phase, and each rank fetches, verifies and copies its own
  pages to their local rows. A fetch agreed on ``m`` verified pages becomes
  one host-only node of exactly ``m`` pages (``insert_host``, rotation base
  stamped); the slots past it are freed. A local failure of any kind is a
  local prefix of 0: the chain is restored nowhere.
* ``check_prefetch_progress`` is False while a request's lookup is pending;
  then ``pop_prefetch_loaded_span`` reports the restored span (upstream's
  own bookkeeping), and the normal load-back brings the node to the device.
* ``release_aborted_request``: the lookup finishes anyway (the count stays
  rank-identical), but reports no span.
* Write: when a node's write-through ack is consumed (every rank consumes
  the same acks), each rank stores the pages of the node it owns. A failed
  put is logged and counted; nothing records "in L3".

Keys with an ``extra_key`` or cache salt, and EAGLE bigram keys, stay out of L3.
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from sglang_cp_hicache.l3.plan import interleaved_owners
from sglang_cp_hicache.sglang_0523.l3_tier import L3Tier

logger = logging.getLogger(__name__)

__all__ = ["CpL3LookupAborted", "L3Driver", "L3Lookup"]

_MIN = torch.distributed.ReduceOp.MIN


class CpL3LookupAborted(RuntimeError):
    """The step's MIN all-reduce failed (a CP rank died or left) while L3
    lookups were pending: none is inserted on this rank."""


@dataclass
class L3Lookup:
    """A chain looked up in L3, waiting for a step's MIN. Identical on every
    rank except ``usable`` (this rank's local prefix)."""

    stage: str  # "query" or "fetch"
    handle: Any  # the request's CacheRequestHandle
    anchor_id: Any
    anchor_lock: Any  # DecLockRefParams of the anchor's host lock
    key: Any  # RadixKey of the chain (whole pages)
    hashes: list[str]
    rotation_base: int  # the chain's base (stamped on the inserted node)
    phase: int  # page-interleave phase of the chain's first page
    owners: list[int]
    storage_start: int  # tokens before the chain
    usable: int
    slots: Optional[torch.Tensor] = None  # logical host slots of the fetch (mirrored)
    aborted: bool = False

    def abort(self) -> None:
        """It settles anyway (the count stays alike), reporting no span."""
        self.aborted = True


def _path_tokens(node: Any) -> list[int]:
    parts = []
    while node is not None and node.parent is not None:
        parts.append(list(node.key.token_ids[: len(node.key)]))
        node = node.parent
    return [t for part in reversed(parts) for t in part]


def _plain(key: Any) -> bool:
    return key.extra_key is None and key.cache_salt is None and not key.is_bigram


@dataclass
class _Riding:
    """The words of this step's lookups, put on the ready-ack all-reduce."""

    words: list[int] = field(default_factory=list)
    agreed: Optional[list[int]] = None
    active: bool = False

    def stop(self) -> None:
        self.active = False

    def settle(self, agreed: list[int]) -> None:
        self.active, self.agreed = False, agreed


class L3Driver:
    """Serves the scheduler's storage calls on one cache instance."""

    def __init__(self, cache: Any, tier: L3Tier) -> None:
        self.cache = cache
        self.tier = tier
        self.layout = tier.layout
        self.pending: list[L3Lookup] = []
        self._riding = _Riding()
        self._upstream: dict[str, Callable[..., Any]] = {}

    # ---- installation --------------------------------------------------------
    _REPLACED = ("prefetch_from_storage", "check_prefetch_progress", "release_aborted_request",
                 "check_hicache_events", "_sync_hicache_ready_counts", "_all_reduce", "_finish_write_through_ack",
                 "reset")

    def install(self) -> None:
        """Shadow the cache's methods on the instance (upstream's are kept and called)."""
        for name in self._REPLACED:
            self._upstream[name] = getattr(self.cache, name)
            setattr(self.cache, name, getattr(self, name))

    @property
    def counters(self) -> Any:
        return self.tier.counters

    def reset(self) -> None:
        """A cache reset (flush, alike on every rank) clears the tree and the
        host pools: pending lookups go with them (their anchor locks and host
        slots no longer exist)."""
        self._upstream["reset"]()
        self.pending = []
        self._riding = _Riding()

    # ---- host -> L3 --------------------------------------------------------------
    def _finish_write_through_ack(self, ack_id: int) -> None:
        pending = self.cache.ongoing_write_through.get(ack_id)
        nodes = [] if pending is None else [self.cache.tree_core.node_by_id(i) for i in pending.publish_node_ids]
        self._upstream["_finish_write_through_ack"](ack_id)
        for node in nodes:
            self._store_node(node)

    def _store_node(self, node: Any) -> None:
        """Store this rank's pages of ``node`` (its host copy is final)."""
        host = self._host_value(node)
        if host is None or not _plain(node.key) or len(host) == 0:
            return
        P = self.tier.page_size
        try:
            tokens = _path_tokens(node)
            first = (len(tokens) - len(node.key)) // P
            hashes = self.tier.page_hashes(tokens)[first:]
            firsts = host[::P].to(torch.int64)
            owners = self.layout.owner_of(firsts).tolist()
            mine = [int(s) for s, o in zip(firsts.tolist(), owners) if o == self.layout.cp_rank]
            self.tier.store_pages(hashes, owners, mine)
        except Exception:  # L3 is a cache: a failed write is a later miss, never an error
            logger.exception("cp-hicache L3: storing node %s failed on cp_rank %d", node.id, self.layout.cp_rank)
            self.counters.write_failures += 1

    def _host_value(self, node: Any) -> Optional[torch.Tensor]:
        return node.component_data[ComponentType.FULL].host_value

    # ---- L3 -> host: the query (the scheduler's prefetch_from_storage) ----------------
    def prefetch_from_storage(
        self, request: Any, last_host_node_id: Any, new_input_tokens: Any, last_hash: Optional[str] = None,
        prefix_keys: Optional[list[str]] = None, matched_prefix_tokens: Optional[list[int]] = None,
        extra_key: Optional[str] = None, cache_salt: Optional[str] = None, storage_hit_end: Optional[int] = None,
    ) -> None:
        """Look the request's pages past its matched prefix up in L3 (called
        alike on every rank). Returns None: no pipeline-parallel ticket."""
        core = self.cache.tree_core
        if extra_key is not None or cache_salt is not None or core.is_eagle:
            return None
        if any(p.handle == request for p in self.pending):
            return None
        P, N = self.tier.page_size, self.layout.cp_size
        whole = len(new_input_tokens) // P * P
        if whole <= 0 or whole < int(getattr(self.cache, "prefetch_threshold", 0) or 0):
            return None
        anchor = core.node_by_id(last_host_node_id)
        start = len(matched_prefix_tokens or [])
        if not self._can_hang(anchor, start, new_input_tokens[:P]):
            return None
        if anchor is core.root_node:
            base = self._host_slots().least_full_class()
        else:
            base = anchor.rotation_base
            if base is None:
                return None
        phase = base + start // P
        key = RadixKey(array("q", new_input_tokens[:whole]))
        owners = interleaved_owners(phase, whole // P, N)
        usable, hashes = 0, []
        try:
            hashes = self.tier.page_hashes(list(matched_prefix_tokens or []) + list(key.token_ids))[start // P :]
            usable = self.tier.query_pages(hashes, owners)
        except Exception:  # the group hears of it as a present prefix of 0
            logger.exception("cp-hicache L3: query failed on cp_rank %d", self.layout.cp_rank)
        lock = self.cache.inc_host_lock_ref(last_host_node_id).to_dec_params()
        self.pending.append(L3Lookup("query", request, last_host_node_id, lock, key, hashes, base, phase,
                                     owners, start, usable))
        self.counters.prefetches += 1
        return None

    def _can_hang(self, anchor: Any, depth: int, first_page: Any) -> bool:
        """A chain can hang under ``anchor`` at ``depth`` tokens: the anchor is
        the root or a node whose host copy is final, it ends exactly there,
        and it has no child for the chain's first page yet."""
        core = self.cache.tree_core
        if anchor is not core.root_node:
            if anchor.parent is None or not anchor.backuped or anchor.write_through_pending_id is not None:
                return False
        if len(_path_tokens(anchor)) != depth:
            return False
        return tuple(first_page) not in {tuple(c.key.token_ids[: self.tier.page_size]) for c in anchor.children.values()}

    def _host_slots(self) -> Any:
        return self.cache.cache_controller.mem_pool_host.anchor_entry.host_pool._slots

    def check_prefetch_progress(self, request: Any) -> bool:
        """False while the request's lookup is pending (alike on every rank)."""
        if any(p.handle == request for p in self.pending):
            return False
        return self._upstream["check_prefetch_progress"](request)

    def release_aborted_request(self, request: Any) -> None:
        for p in self.pending:
            if p.handle == request:
                p.abort()
        self._upstream["release_aborted_request"](request)

    # ---- the step's MIN ---------------------------------------------------------------
    def _sync_hicache_ready_counts(self) -> Any:
        self._riding = _Riding(words=[p.usable for p in self.pending], active=bool(self.pending))
        try:
            return self._upstream["_sync_hicache_ready_counts"]()
        finally:
            self._riding.stop()

    def _all_reduce(self, data: torch.Tensor, tp_reduce_op: Any) -> None:
        """Upstream's all-reduce; during the ready-ack sync it carries this
        step's lookup words too (the same count on every rank)."""
        riding = self._riding
        if not riding.active or tp_reduce_op != _MIN or data.dim() != 1:
            return self._upstream["_all_reduce"](data, tp_reduce_op)
        riding.stop()  # one ride per step
        words = torch.tensor(riding.words, dtype=data.dtype)
        both = torch.cat([data, words])
        try:
            self._upstream["_all_reduce"](both, tp_reduce_op)
        except Exception as exc:
            raise self._abandon(exc) from exc
        data.copy_(both[: data.numel()])
        riding.settle([int(v) for v in both[data.numel():].tolist()])

    def check_hicache_events(self) -> None:
        self._upstream["check_hicache_events"]()
        if not self.pending:
            return
        agreed = self._riding.agreed
        if agreed is None:
            # The ready-ack sync did not run this step (a path without it):
            # one MIN of the lookup words, on every rank alike.
            words = torch.tensor([p.usable for p in self.pending], dtype=torch.int64)
            try:
                self.cache._all_reduce_attn_groups(words, _MIN)
            except Exception as exc:
                raise self._abandon(exc) from exc
            agreed = [int(v) for v in words.tolist()]
        self._riding = _Riding()
        self._commit(agreed)

    def _abandon(self, error: BaseException) -> CpL3LookupAborted:
        """The MIN carrying the lookup words failed: the peers' words are
        unknown, so nothing is inserted; this rank gives back what it holds
        for every pending lookup (a fetch's host slots, the anchor's host
        lock). Returns the exception to raise."""
        pending, self.pending = self.pending, []
        self._riding = _Riding()
        rank = self.layout.cp_rank
        logger.error(
            "cp-hicache L3: the step all-reduce failed on cp_rank %d with %d L3 lookup(s) pending (%s); "
            "none is inserted, their host slots and anchor locks are given back: %r",
            rank, len(pending), ", ".join(f"{p.stage} of {len(p.hashes)} pages" for p in pending), error,
        )
        host = self.cache.cache_controller.mem_pool_host
        for p in pending:
            if p.slots is not None and p.slots.numel():
                host.free(p.slots)
            self.cache.dec_host_lock_ref(p.anchor_id, p.anchor_lock)
        return CpL3LookupAborted(
            f"CP step all-reduce failed with {len(pending)} L3 lookup(s) pending on cp_rank {rank} "
            f"(a CP rank died or left the group?); none was inserted, their host slots and anchor "
            f"locks were given back: {error!r}"
        )

    def _commit(self, agreed: list[int]) -> None:
        pending, self.pending = self.pending, []
        if len(agreed) != len(pending):
            raise RuntimeError(f"L3: {len(agreed)} agreed values for {len(pending)} pending lookups")
        for p, pages in zip(pending, agreed):
            if p.stage == "query" and pages > 0 and self._still_hangs(p) and self._start_fetch(p, pages):
                continue  # the anchor stays locked for the fetch
            if p.stage == "fetch":
                self._settle(p, pages if self._still_hangs(p) else 0)
            self.cache.dec_host_lock_ref(p.anchor_id, p.anchor_lock)

    def _still_hangs(self, p: L3Lookup) -> bool:
        anchor = self.cache.tree_core.node_by_id(p.anchor_id)
        return self._can_hang(anchor, p.storage_start, p.key.token_ids[: self.tier.page_size])

    # ---- L3 -> host: the fetch ----------------------------------------------------------
    def _start_fetch(self, query: L3Lookup, pages: int) -> bool:
        """Take host room and logical slots for the ``pages`` agreed present
        (alike on every rank; False: no room), then fetch, verify and copy
        this rank's own pages; the fetch waits for the next step's MIN."""
        P, N = self.tier.page_size, self.layout.cp_size
        start_class = query.phase % N
        room = getattr(self.cache.cache_controller, "cp_host_room", None)
        if room is not None:
            room.make_room(start_class, pages)
        slots = self.cache.cache_controller.mem_pool_host.alloc(pages * P, start_owner=start_class)
        if slots is None:  # identical on every rank: the host allocator is mirrored
            return False
        slots = slots.to("cpu", torch.int64).reshape(-1)
        owners = query.owners[:pages]
        usable = self._fetch_into_host(query.hashes[:pages], owners, slots)
        self.pending.append(L3Lookup(
            "fetch", query.handle, query.anchor_id, query.anchor_lock, query.key[: pages * P],
            query.hashes[:pages], query.rotation_base, query.phase, owners, query.storage_start, usable,
            slots, query.aborted,
        ))
        return True

    def _fetch_into_host(self, hashes: list[str], owners: list[int], slots: torch.Tensor) -> int:
        """This rank's local usable prefix after copying its verified pages;
        a local failure of any kind makes it 0."""
        P, rank = self.tier.page_size, self.layout.cp_rank
        try:
            slot_owners = self.layout.owner_of(slots[::P]).tolist()
            if slot_owners != owners:
                raise RuntimeError(f"host slots of owners {slot_owners} for a chain of owners {owners}")
            fetched = self.tier.fetch_pages(hashes, owners)
            for index, (kv, idx) in sorted(fetched.pages.items()):
                if owners[index] == rank:
                    self.tier.fill_host(int(slots[index * P]), kv, idx)
            return fetched.usable
        except Exception:  # the group hears of it as a usable prefix of 0
            logger.exception("cp-hicache L3: fetch failed on cp_rank %d", rank)
            return 0

    def _settle(self, p: L3Lookup, pages: int) -> None:
        """Insert the agreed ``pages`` as one host-only node; free the rest."""
        P, rank = self.tier.page_size, self.layout.cp_rank
        host = self.cache.cache_controller.mem_pool_host
        kept = pages * P
        if kept:
            result = self.cache.tree_core.insert_host(p.anchor_id, p.key[:kept], p.slots[:kept], p.hashes[:pages])
            node_id = getattr(result, "inserted_host_node", None)
            node = None if node_id is None else self.cache.tree_core.node_by_id(node_id)
            if node is None or getattr(result, "host_insert_dropped", False) or node.parent.id != p.anchor_id:
                kept = 0
                logger.warning("cp-hicache L3: chain of %d pages could not hang under node %s", pages, p.anchor_id)
            else:
                node.rotation_base = p.rotation_base
                self.counters.restored_nodes += 1
                self.counters.restored_tokens += kept
                self.counters.restored_pages += sum(o == rank for o in p.owners[:pages])
                if not p.aborted:
                    self.cache.prefetch_loaded_tokens_by_reqid[p.handle] = kept
                    self.cache.prefetch_loaded_storage_start_by_reqid[p.handle] = p.storage_start
        if p.slots is not None and p.slots.numel() > kept:
            host.free(p.slots[kept:])
