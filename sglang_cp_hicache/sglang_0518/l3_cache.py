"""L3 in the CP cache's step: write a node's owned pages once its host
backup is final, restore a chain from L3 as host-only nodes.

No collective of its own, no L3 membership state:

* Write: when a node's write-through ack is consumed (every rank consumes
  the same acks, and only acks of writes no rank took back), each rank
  copies the pages of the node it owns out of its host pools and stores
  them on the L3 worker thread. A failed
  put leaves that page absent (objects are renamed into place whole) or,
  if anything is left, refused by its envelope; no rank records "in L3", so
  nothing can disagree: a later prefetch decides from what each owner finds.
* Prefetch (:meth:`L3CacheMixin.l3_prefetch`, called alike on every rank
  for a request whose match ends before its whole pages do): the owners of
  the pages to restore are chosen from the host ledger (identical on every
  rank). Query: each rank checks which of its own pages exist; its present
  prefix rides the step's MIN all-reduce (:mod:`.step_protocol`, one word
  per pending prefetch, the same count on every rank) -- nothing is
  allocated or evicted for a miss. Fetch: for the agreed pages every rank
  takes host room (the ledger decides alike), takes host slots for its own
  pages, fetches and verifies them, copies them into its host pools and
  records its local usable prefix, which rides the next step's MIN; then
  every rank inserts a host-only node of exactly the agreed pages and frees
  its slots past it, and the normal load-back restores the node to the
  device. A local failure (host allocation, I/O, a raised copy) is a local
  prefix of 0, so the group restores nothing of that chain.

The query's existence checks, the fetch's reads, checks and host copies and
the writes run on a worker thread (:mod:`.l3_io`, one per cache, in order:
a rank's read starts after its earlier writes); until a rank's job is done its word
is NOT_READY, so the MIN keeps every rank waiting alike (a prefetch takes two
steps at least, more while I/O runs). Host slots are taken on the scheduler
thread before the fetch job starts, so they are the job's alone.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Optional

import torch
from sglang.srt.disaggregation.kv_events import StorageMedium
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sglang_cp_hicache.policy_0518.metadata import CpHiCacheNodeMetadata
from sglang_cp_hicache.policy_0518.node_state import set_host_state
from sglang_cp_hicache.sglang_0518.l3_io import NOT_READY, L3Io
from sglang_cp_hicache.sglang_0518.l3_tier import L3Snapshot, L3Tier, balanced_owners
from sglang_cp_hicache.sglang_0518.tree_node import CpTreeNode

logger = logging.getLogger(__name__)

__all__ = ["L3CacheMixin", "L3Prefetch", "L3Ticket"]

_EMPTY = torch.empty((0,), dtype=torch.int64)


@dataclass
class L3Ticket:
    """The requests waiting on one prefetch (SGLang's scheduler holds them
    until it settles). ``asker``: the request that started it (the restored
    tokens are counted as its storage hit); ``rids``: every request still
    waiting. ``dropped``: every waiting request was aborted -- the prefetch
    then votes 0 in the next MIN, so every rank restores nothing of it."""

    asker: str
    rids: set[str]
    dropped: bool = False
    settled: bool = False
    loaded_tokens: int = 0


@dataclass
class L3Prefetch:
    """A chain looked up in L3, waiting for the step's MIN: first its
    ``query`` (which own pages exist), then its ``fetch`` (host slots taken,
    own pages verified and copied). Identical on every rank except ``slots``
    (this rank's host slots, one per token of its own pages, chain order),
    ``job`` (its I/O on the worker thread) and ``usable`` (its local
    usable prefix, known once the job is done)."""

    stage: str  # "query" or "fetch"
    anchor: TreeNode  # the backed-up node (or root) the chain hangs from
    key: RadixKey  # the chain's tokens (whole pages)
    hashes: list[str]
    owners: list[int]
    usable: Optional[int]  # None while the job runs
    need: Optional[list[int]] = None  # ledger charge, tokens per rank (fetch)
    slots: Optional[torch.Tensor] = None
    ticket: Optional[L3Ticket] = None  # the scheduler's requests waiting on it (None: a direct call)
    job: Optional[Future] = None


def _path_tokens(node: TreeNode) -> list[int]:
    """Token ids from the root to the end of ``node``."""
    parts = []
    while node is not None and node.parent is not None:
        parts.append(list(node.key.token_ids[: len(node.key)]))
        node = node.parent
    return [t for part in reversed(parts) for t in part]


def _plain(key: RadixKey) -> bool:
    """Keys L3 handles: plain token ids. An ``extra_key`` (e.g. a LoRA) or a
    cache salt may change the bytes or the namespace, and bigram keys hash
    differently: those stay out of L3."""
    return key.extra_key is None and key.cache_salt is None and not key.is_bigram


class L3CacheMixin:
    """L3 write and prefetch, for :class:`CpHiRadixCache` (``cp_l3`` None: off)."""

    cp_l3: Optional[L3Tier]
    cp_l3_io: L3Io

    # ---- host -> L3 ------------------------------------------------------------
    def _finish_write_through_ack(self, ack_id: int, *, release_lock: bool) -> None:
        if self.cp_l3 is not None and ack_id in self.ongoing_write_through:
            _, _, publish_nodes = self.ongoing_write_through[ack_id]
            for node in publish_nodes:
                self._l3_store_node(node)
        super()._finish_write_through_ack(ack_id, release_lock=release_lock)

    def _l3_store_node(self, node: TreeNode) -> None:
        """Store this rank's pages of ``node`` (its host copy is final)."""
        meta = node.cp_hicache
        if meta is None or not _plain(node.key) or meta.token_owners is None:
            return
        P = self.page_size
        tokens = _path_tokens(node)
        first = (len(tokens) - meta.logical_len) // P
        owners = meta.token_owners[::P].tolist()
        try:
            hashes = self.cp_l3.page_hashes(tokens)[first:]
            # Copied now: once the node is evicted its host slots hold other pages.
            snap = self.cp_l3.snapshot_pages(hashes, owners, meta.host_indices[::P].tolist())
        except Exception:  # L3 is a cache: a failed write is a later miss, never an error
            self._l3_write_failed(node.id, owners)
            return
        self._l3_writes = [j for j in self._l3_writes if not j.done()]
        self._l3_writes.append(self.cp_l3_io.submit(self._l3_store_job, node.id, snap))

    def _l3_store_job(self, node_id: int, snap: L3Snapshot) -> int:
        """Store a node's snapshot (on the worker thread); never raises."""
        try:
            return self.cp_l3.store_snapshot(snap)
        except Exception:
            self._l3_write_failed(node_id, snap.owners)
            return 0

    def _l3_write_failed(self, node_id: int, owners: list[int]) -> None:
        rank = self.cp_layout.cp_rank
        logger.exception("cp-hicache L3: storing node %d failed on cp_rank %d", node_id, rank)
        self.cp_l3.counters.write_failures += sum(o == rank for o in owners)

    # ---- L3 -> host: the query ----------------------------------------------------
    def l3_prefetch(self, key: RadixKey, ticket: Optional[L3Ticket] = None) -> int:
        """Look the pages of ``key`` past its cached prefix up in L3 (call it
        alike on every rank). Returns the pages looked up (the same on every
        rank; 0: nothing to do). Two step all-reduces follow: the first
        agrees on the pages present on their owners (nothing allocated or
        evicted before), the second on the pages fetched and verified; then
        a host-only node of exactly those pages is in the tree. ``ticket``:
        the scheduler's requests waiting on it, settled with the result."""
        found = self._l3_lookup_target(key)
        if found is None:
            return 0
        anchor, chain = found
        P = self.page_size
        tokens = _path_tokens(anchor) + list(chain.token_ids[: len(chain)])
        num_pages = len(chain) // P
        owners = balanced_owners(self._ledger.used, num_pages, P)
        usable, hashes, job = None, [], None
        try:
            hashes = self.cp_l3.page_hashes(tokens)[-num_pages:]
            job = self.cp_l3_io.submit(self.cp_l3.query_pages, hashes, owners)  # existence checks: I/O
        except Exception:  # the group hears of it as a present prefix of 0
            logger.exception("cp-hicache L3: query failed on cp_rank %d", self.cp_layout.cp_rank)
            usable = 0
        anchor.protect_host()  # the chain's parent stays until the chain is settled
        self._l3_pending.append(
            L3Prefetch("query", anchor, chain, hashes, owners, usable, ticket=ticket, job=job)
        )
        self.cp_l3.counters.prefetches += 1
        return num_pages

    def _l3_lookup_target(self, key: RadixKey):
        """(anchor, chain key) of a prefetch, or None: the whole pages of
        ``key`` past the cached prefix, when that prefix ends at a node whose
        host copy is final (or the root) and no prefetch hangs there yet."""
        if self.cp_l3 is None or self.is_eagle or not _plain(key):
            return None
        match = self.match_prefix(MatchPrefixParams(key=key))
        anchor = match.last_host_node
        matched = len(match.device_indices) + match.host_hit_length
        if len(_path_tokens(anchor)) != matched:
            return None  # the deepest matched node has no final host copy yet
        if anchor is not self.root_node and (not anchor.backuped or anchor.write_through_pending_id is not None):
            return None
        if any(p.anchor is anchor for p in self._l3_pending):
            return None
        whole = (len(key) - matched) // self.page_size * self.page_size
        if whole <= 0:
            return None
        return anchor, key[matched : matched + whole]

    # ---- the step's MIN ---------------------------------------------------------------
    def _l3_local_words(self) -> list[int]:
        return [self._l3_word(p) for p in self._l3_pending]

    def _l3_word(self, p: L3Prefetch) -> int:
        """NOT_READY while this rank's I/O for ``p`` runs (the MIN then keeps
        every rank waiting alike); then its usable prefix. A prefetch every
        waiting request of which was aborted votes 0: the MIN drops it on
        every rank alike, whichever rank saw the abort."""
        if p.usable is None:
            if not p.job.done():
                return NOT_READY
            p.usable = self.cp_l3_io.outcome(p.job, p.stage)
        if p.ticket is not None and p.ticket.dropped:
            return 0
        return p.usable

    def l3_wait_io(self, timeout: Optional[float] = None) -> bool:
        """Block until this rank's L3 I/O is done: its prefetches' reads (so
        its next words are ready) and its writes; False if ``timeout`` ran
        out first."""
        return self.cp_l3_io.wait([*(p.job for p in self._l3_pending), *self._l3_writes], timeout)

    def _l3_commit(self, agreed: list[int]) -> None:
        """Act on what the group agreed, every rank alike: a query agreed on
        ``n`` present pages becomes the fetch of those ``n``; a fetch agreed
        on ``n`` verified pages becomes a host-only node of ``n`` pages."""
        pending, self._l3_pending = self._l3_pending, []
        if len(agreed) != len(pending):
            raise RuntimeError(f"L3: {len(agreed)} agreed values for {len(pending)} pending prefetches")
        for p, pages in zip(pending, agreed):
            if pages == NOT_READY:  # some rank's I/O still runs: every rank waits alike
                self._l3_pending.append(p)
                continue
            if not self._l3_can_hang(p):
                pages = 0
            if p.stage == "query" and pages > 0 and self._l3_start_fetch(p, pages):
                continue  # the anchor stays protected for the fetch
            p.anchor.release_host()
            restored = self._l3_settle(p, pages) if p.stage == "fetch" else 0
            if p.ticket is not None:
                self._l3_settle_ticket(p.ticket, restored)

    def _l3_settle_ticket(self, ticket: L3Ticket, restored_tokens: int) -> None:
        """The waiting requests may go on (the same step on every rank)."""
        ticket.settled = True
        ticket.loaded_tokens = restored_tokens
        for rid in ticket.rids:
            if self._l3_waiting.get(rid) is ticket:
                del self._l3_waiting[rid]
        if ticket.asker in ticket.rids and restored_tokens > 0:
            self.prefetch_loaded_tokens_by_reqid[ticket.asker] = restored_tokens

    def _l3_abandon(self, error: BaseException) -> None:
        """The step's all-reduce failed: give back what this rank holds for
        every pending prefetch (anchor protection, host slots, ledger
        charge), insert nothing, release the waiting requests; logged."""
        pending, self._l3_pending = self._l3_pending, []
        logger.error(
            "cp-hicache L3: the step all-reduce failed on cp_rank %d with %d prefetch(es) pending (%s); "
            "none is inserted, their host slots and ledger charges are given back: %r",
            self.cp_layout.cp_rank, len(pending), ", ".join(f"{p.stage} of {len(p.hashes)} pages" for p in pending),
            error,
        )
        self.cp_l3_io.wait([p.job for p in pending])  # no job may still write into the slots freed here
        for p in pending:
            p.anchor.release_host()
            if p.stage == "fetch":
                self._l3_settle(p, 0)
            if p.ticket is not None:
                self._l3_settle_ticket(p.ticket, 0)

    # ---- L3 -> host: the fetch ----------------------------------------------------------
    def _l3_start_fetch(self, query: L3Prefetch, pages: int) -> bool:
        """Take host room for the ``pages`` agreed present (the ledger decides
        alike on every rank; False: no room), fetch, verify and copy this
        rank's own pages; the fetch waits for the next step's MIN."""
        P, N = self.page_size, self.cp_layout.cp_size
        owners = query.owners[:pages]
        need = [owners.count(r) * P for r in range(N)]
        if not self._ledger.fits(need):
            self._evict_host_for(self._ledger.shortfall(need))
        if not self._ledger.fits(need):  # identical on every rank
            return False
        self._ledger.charge(need)
        hashes = query.hashes[:pages]
        slots, usable, job = self._l3_take_slots(owners), None, None
        if slots is None:
            usable = 0  # the group hears of it as a usable prefix of 0
        else:
            job = self.cp_l3_io.submit(self._l3_fetch_job, hashes, owners, slots)
        self._l3_pending.append(
            L3Prefetch(
                "fetch", query.anchor, query.key[: pages * P], hashes, owners, usable, need, slots, query.ticket,
                job,
            )
        )
        return True

    def _l3_take_slots(self, owners: list[int]) -> Optional[torch.Tensor]:
        """This rank's host slots for its own pages of a chain (on the
        scheduler thread: from now on they are this fetch's alone); None if
        the pool is short or the allocation raised."""
        P, rank = self.page_size, self.cp_layout.cp_rank
        mine = sum(1 for o in owners if o == rank)
        try:
            slots = self.cache_controller.mem_pool_host.alloc(mine * P) if mine else _EMPTY
        except Exception:
            logger.exception("cp-hicache L3: host allocation for a fetch raised on cp_rank %d", rank)
            return None
        if slots is None:
            logger.warning("cp-hicache L3: host pool short on cp_rank %d (ledger said it fits)", rank)
            return None
        return slots.to("cpu", torch.int64).reshape(-1)

    def _l3_fetch_job(self, hashes: list[str], owners: list[int], slots: torch.Tensor) -> int:
        """Fetch, verify and copy this rank's pages into ``slots`` (on the
        worker thread); returns its local usable prefix (a raise counts 0)."""
        P, rank = self.page_size, self.cp_layout.cp_rank
        mine = [i for i, o in enumerate(owners) if o == rank]
        fetched = self.cp_l3.fetch_pages(hashes, owners)
        for j, index in enumerate(mine):
            if index >= fetched.usable:
                break
            kv, idx = fetched.pages[index]
            self.cp_l3.fill_host(int(slots[j * P]), kv, idx)
        return fetched.usable

    def _l3_can_hang(self, p: L3Prefetch) -> bool:
        anchor = p.anchor
        if anchor is not self.root_node and (anchor.parent is None or not anchor.backuped):
            return False
        return p.key.child_key(self.page_size) not in anchor.children

    def _l3_settle(self, p: L3Prefetch, pages: int) -> int:
        """Free this rank's slots and the ledger charge past the agreed
        ``pages`` and insert the host-only node of those; returns its tokens."""
        P, rank = self.page_size, self.cp_layout.cp_rank
        mine = [i for i, o in enumerate(p.owners) if o == rank]
        kept = sum(1 for i in mine if i < pages)
        if p.slots is not None and p.slots.numel() > kept * P:
            self.cache_controller.mem_pool_host.free(p.slots[kept * P :])
        keep_need = [p.owners[:pages].count(r) * P for r in range(self.cp_layout.cp_size)]
        self._ledger.release([a - b for a, b in zip(p.need, keep_need)])
        if pages == 0:
            return 0
        owned = torch.tensor(mine[:kept], dtype=torch.int64)
        positions = (owned[:, None] * P + torch.arange(P)).reshape(-1) if kept else _EMPTY
        token_owners = torch.tensor(p.owners[:pages], dtype=torch.int64).repeat_interleave(P)
        meta = CpHiCacheNodeMetadata._trusted(pages * P, positions, p.slots[: kept * P], token_owners)
        self._l3_insert_host_node(p.anchor, p.key[: pages * P], meta)
        self.cp_l3.counters.restored_pages += kept
        return pages * P

    def _l3_insert_host_node(self, anchor: TreeNode, key: RadixKey, meta: CpHiCacheNodeMetadata) -> None:
        """A host-only node under ``anchor``, as upstream's ``_insert_helper_host``
        builds one, with the CP host state instead of ``host_value``."""
        node = CpTreeNode(priority=anchor.priority)
        node.parent = anchor
        node.key = key
        node.value = None
        set_host_state(node, meta)
        anchor.children[key.child_key(self.page_size)] = node
        self._update_host_leaf_status(node)
        self._update_leaf_status(anchor)
        self._update_host_leaf_status(anchor)
        self._record_store_event(node, medium=StorageMedium.CPU)
        self.cp_l3.counters.restored_nodes += 1
