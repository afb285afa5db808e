"""The L3 prefetch protocol under CP, once for every SGLang release.

A prefetch restores the whole pages of a chain past a request's cached
prefix from L3 into the host tier, as one host-only node. Every rank runs the
same protocol on the same lookups in the same order; what a rank cannot know
about the others (its own I/O, its own objects) reaches them only as one
word per lookup inside the MIN all-reduce its release already runs each
step (no collective of its own):

1. **query** (:meth:`L3Prefetcher.start`): the pages' owners are fixed
   (rank-identical), each rank checks on an I/O thread that the KV and
   indexer objects of its own pages exist; its word is the index of its
   first own page missing (pages of other owners count as present).
2. the step's **MIN** of the query words: ``n`` pages present on their
   owners. Nothing is allocated or evicted before it: a miss costs no room.
3. **fetch**: host room for the ``n`` pages is taken alike on every rank
   (the release's rule), each rank reads, verifies and copies its own pages
   into its host rows on an I/O thread; its word is its local usable prefix.
4. the next **MIN**: ``m`` pages verified on their owners; every rank
   inserts a host-only node of exactly ``m`` pages and gives back the rest.

A lookup whose I/O is still running answers :data:`NOT_READY`, so the MIN is
NOT_READY on every rank and every rank waits alike -- until that I/O passes
its **deadline**: then the rank cancels it and answers 0, "miss from here",
and every rank settles the lookup in that step. A lookup every waiting
request of which was aborted answers 0 at once, whatever its I/O is doing.
A cancelled I/O job never writes host memory again (:mod:`.workers`), so
what a settled lookup held (host rows, room, the anchor) goes back at once.
A request arriving while a lookup of the same chain is pending waits on it
(joined). A failed MIN (a rank died) abandons every pending lookup, giving
back what it holds and inserting nothing.

The release's side -- the owners, the anchor, host room and slots, the
insert, the scheduler's bookkeeping -- is an :class:`L3Port`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Hashable, Optional, Protocol

from sglang_cp_hicache.l3.host_tier import HostL3Tier
from sglang_cp_hicache.l3.location import L3Timeouts
from sglang_cp_hicache.l3.workers import L3Job, L3Workers

__all__ = [
    "NOT_READY", "chain_hashes", "chain_hashes_or_none", "path_length", "path_tokens", "plain_key", "ChainPlan",
    "CpL3PrefetchAborted", "L3Lookup", "L3Port", "L3Prefetcher", "Stage", "Waiters",
]

logger = logging.getLogger(__name__)

#: A rank's word while its I/O for a lookup still runs, before its deadline
#: (every real word is a page count >= 0, so the MIN stays NOT_READY while
#: any rank waits).
NOT_READY = -1


def path_tokens(node: Any) -> list[int]:
    """Token ids from the root to the end of ``node`` (a radix tree node of
    either release: ``parent``, ``key.token_ids``)."""
    parts = []
    while node is not None and node.parent is not None:
        parts.append(list(node.key.token_ids[: len(node.key)]))
        node = node.parent
    return [t for part in reversed(parts) for t in part]


def path_length(node: Any) -> int:
    """How many tokens :func:`path_tokens` would give, without copying them."""
    n = 0
    while node is not None and node.parent is not None:
        n += len(node.key)
        node = node.parent
    return n


def chain_hashes(tier: HostL3Tier, tokens: list[int], first_page: int) -> tuple[list[str], Optional[str]]:
    """The page hashes of ``tokens`` from page ``first_page`` on, and the
    hash of the page before (None when the chain starts at the root)."""
    hashes = tier.page_hashes(tokens)
    return hashes[first_page:], hashes[first_page - 1] if first_page > 0 else None


def chain_hashes_or_none(tier: HostL3Tier, tokens: list[int], first_page: int) -> tuple[Optional[list[str]], Optional[str]]:
    """:func:`chain_hashes`, or ``(None, None)`` if this rank cannot compute
    them. SGLang's hasher is a native extension compiled on first use: a
    failure there is this rank's alone, so it must not decide whether a
    lookup exists (every rank must have the same lookups)."""
    try:
        return chain_hashes(tier, tokens, first_page)
    except Exception:
        logger.exception("sglang-cp-hicache L3: hashing a chain failed on cp_rank %d", tier.placement.cp_rank)
        return None, None


def plain_key(key: Any) -> bool:
    """Keys L3 handles: plain token ids. An ``extra_key`` (a LoRA adapter)
    or a cache salt names another namespace of pages, and bigram (EAGLE)
    keys hash differently: those stay out of L3."""
    return key.extra_key is None and key.cache_salt is None and not key.is_bigram


class CpL3PrefetchAborted(RuntimeError):
    """The step's MIN all-reduce failed (a CP rank died or left) while L3
    lookups were pending: none is inserted on this rank, and what they held
    was given back."""


class Stage(str, Enum):
    QUERY = "query"
    FETCH = "fetch"


@dataclass
class Waiters:
    """The requests waiting on one lookup. ``asker``: the request that
    started it (the restored tokens are its storage hit); ``rids``: every
    request still waiting; ``dropped``: every one of them was aborted."""

    asker: Hashable
    rids: set[Hashable]
    dropped: bool = False


@dataclass
class ChainPlan:
    """What a lookup restores, decided alike on every rank by the release.

    ``anchor``: the node the chain hangs from (the release's handle);
    ``key``: the chain's key, whole pages, sliceable by tokens; ``first_page``:
    its first page's token ids (duplicate lookups are joined on it);
    ``owners`` / ``hashes``: per page -- ``hashes`` None when this rank
    could not compute them (a local failure: it answers 0, and the lookup
    still counts, so every rank has the same lookups); ``release``: the
    release's own state (an anchor lock, a rotation base, ...)."""

    anchor: Any
    key: Any
    first_page: tuple[int, ...]
    hashes: Optional[list[str]]
    owners: list[int]
    release: Any = None
    parent: Optional[str] = None  # the page hash before the chain's first page (None: the root)

    @property
    def num_pages(self) -> int:
        return len(self.owners)


@dataclass
class L3Lookup:
    """A chain being looked up, the same on every rank except ``jobs``,
    ``word`` and ``room`` (this rank's I/O, answer and host rows). The
    query is one job; a fetch is one job per own page, in flight at once."""

    stage: Stage
    plan: ChainPlan
    pages: int  # pages this stage covers (the query: the chain; the fetch: the agreed ones)
    waiters: Optional[Waiters]
    jobs: list[L3Job] = field(default_factory=list)
    page_indices: list[int] = field(default_factory=list)  # the fetch: each job's page in the chain
    word: Optional[int] = None  # this rank's answer once known
    room: Any = None  # the fetch's host room (the release's)
    started: float = field(default_factory=time.monotonic)

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancel()


class L3Port(Protocol):
    """A release's side of the protocol (calls on the scheduler thread)."""

    def still_hangs(self, plan: ChainPlan) -> bool:
        """The chain can still be inserted under its anchor (same on every rank)."""
        ...

    def take_room(self, plan: ChainPlan, pages: int) -> Any:
        """Host room for the first ``pages`` pages, decided alike on every
        rank; None: there is none (no rank fetches). The room's
        ``own_slots`` are this rank's host slots of its own pages in chain
        order, or None after a local failure (this rank answers 0)."""
        ...

    def settle(self, plan: ChainPlan, pages: int, room: Any) -> int:
        """Insert the first ``pages`` pages (0: none) as a host-only node and
        give back the rest of ``room`` (None: no room taken); returns the
        tokens inserted."""
        ...

    def release_anchor(self, plan: ChainPlan) -> None:
        """The anchor may go (its protection taken at :meth:`L3Prefetcher.start`)."""
        ...

    def report(self, plan: ChainPlan, asker: Hashable, tokens: int) -> None:
        """The scheduler's record of the asker's storage hit."""
        ...


class L3Prefetcher:
    """Every pending lookup of one rank, and the requests waiting on them."""

    def __init__(self, tier: HostL3Tier, port: L3Port, workers: L3Workers, timeouts: L3Timeouts) -> None:
        self.tier = tier
        self.port = port
        self.workers = workers
        self.timeouts = timeouts
        self.pending: list[L3Lookup] = []
        self.waiting: dict[Hashable, Waiters] = {}

    @property
    def counters(self):
        return self.tier.counters

    # ---- requests ------------------------------------------------------------------
    def is_waiting(self, rid: Hashable) -> bool:
        return rid in self.waiting

    def join(self, anchor: Any, first_page: tuple[int, ...], rid: Hashable) -> bool:
        """Wait on a lookup pending under ``anchor`` for the same first page
        (one chain can hang there); False if there is none."""
        for lookup in self.pending:
            waiters = lookup.waiters
            if waiters is None or waiters.dropped or lookup.plan.anchor != anchor:
                continue
            if lookup.plan.first_page != first_page:
                continue
            waiters.rids.add(rid)
            self.waiting[rid] = waiters
            self.counters.add(joined_requests=1)
            return True
        return False

    def hangs_at(self, anchor: Any, first_page: tuple[int, ...]) -> bool:
        """A lookup of a chain starting with ``first_page`` is pending under
        ``anchor`` (only one such chain can hang there)."""
        return any(lookup.plan.anchor == anchor and lookup.plan.first_page == first_page for lookup in self.pending)

    def start(self, plan: ChainPlan, rid: Optional[Hashable] = None) -> None:
        """Look ``plan`` up (call alike on every rank). The release has
        protected its anchor; :meth:`commit` releases it when the lookup
        settles. ``rid``: the request waiting on it (None: a direct call)."""
        waiters = None if rid is None else Waiters(rid, {rid})
        lookup = L3Lookup(Stage.QUERY, plan, plan.num_pages, waiters)
        try:
            if plan.hashes is None:
                raise RuntimeError("this rank could not hash the chain")
            lookup.jobs.append(self.workers.submit(
                self._query_job, plan.hashes, plan.owners, plan.parent,
                timeout_s=self.timeouts.for_tokens(plan.num_pages * self.tier.page_size),
                what=f"L3 query of {plan.num_pages} pages",
            ))
        except Exception:  # the group hears of it as a present prefix of 0
            logger.exception("sglang-cp-hicache L3: query failed on cp_rank %d", self.tier.placement.cp_rank)
            lookup.word = 0
        self.pending.append(lookup)
        if waiters is not None:
            self.waiting[rid] = waiters
        self.counters.add(prefetches=1)

    def abort(self, rid: Hashable) -> None:
        """Forget an aborted request's wait; a lookup no request waits on any
        more answers 0 at the next MIN (it stays pending until then: the
        count of words stays the same on every rank)."""
        waiters = self.waiting.pop(rid, None)
        if waiters is None:
            return
        waiters.rids.discard(rid)
        if not waiters.rids:
            waiters.dropped = True

    # ---- the step's MIN -------------------------------------------------------------
    def words(self) -> list[int]:
        """This rank's word for every pending lookup (one each, in order)."""
        now = time.monotonic()
        return [self._word(lookup, now) for lookup in self.pending]

    def _word(self, lookup: L3Lookup, now: float) -> int:
        if lookup.waiters is not None and lookup.waiters.dropped:
            self._give_up(lookup)  # whatever its I/O is doing
            return 0
        if lookup.word is not None:
            return lookup.word
        if all(job.done() for job in lookup.jobs):
            lookup.word = self._outcome(lookup)
        elif any(job.overdue(now) for job in lookup.jobs):
            self._give_up(lookup)
            self.counters.add(timeouts=1)
            late = next(job for job in lookup.jobs if job.overdue(now))
            logger.warning(
                "sglang-cp-hicache L3: %s on cp_rank %d passed its %.1f s deadline; answering a miss from here",
                late.what, self.tier.placement.cp_rank, late.deadline - lookup.started,
            )
        else:
            return NOT_READY
        return lookup.word

    def _outcome(self, lookup: L3Lookup) -> int:
        """A query: its present prefix. A fetch: the first own page whose
        job failed (missing, refused, raised), else every page."""
        rank = self.tier.placement.cp_rank
        try:
            if lookup.stage is Stage.QUERY:
                return max(0, int(lookup.jobs[0].result()))
            for index, job in zip(lookup.page_indices, lookup.jobs):
                if not job.result():
                    return index
            return lookup.pages
        except Exception:  # the group hears of it as a prefix of 0
            logger.exception("sglang-cp-hicache L3: %s of %d pages failed on cp_rank %d", lookup.stage.value,
                             lookup.pages, rank)
            return 0

    @staticmethod
    def _give_up(lookup: L3Lookup) -> None:
        lookup.cancel()
        lookup.word = 0

    def commit(self, agreed: list[int]) -> None:
        """Act on the MIN of :meth:`words`, every rank alike."""
        pending, self.pending = self.pending, []
        if len(agreed) != len(pending):
            raise RuntimeError(f"L3: {len(agreed)} agreed values for {len(pending)} pending lookups")
        for lookup, pages in zip(pending, agreed):
            if pages == NOT_READY:  # some rank's I/O still runs: every rank waits alike
                self.pending.append(lookup)
                continue
            if pages < 0 or pages > lookup.pages:
                raise RuntimeError(f"L3: agreed {pages} pages for a {lookup.stage.value} of {lookup.pages}")
            if lookup.waiters is not None and lookup.waiters.dropped:
                pages = 0
            if not self.port.still_hangs(lookup.plan):
                pages = 0
            if lookup.stage is Stage.QUERY and pages > 0 and self._start_fetch(lookup, pages):
                continue  # the anchor stays protected for the fetch
            restored = 0
            if lookup.stage is Stage.FETCH:
                restored = self._settle(lookup, pages)
            self.port.release_anchor(lookup.plan)
            self._release_waiters(lookup, restored)

    def _start_fetch(self, query: L3Lookup, pages: int) -> bool:
        room = self.port.take_room(query.plan, pages)
        if room is None:  # identical on every rank
            return False
        fetch = L3Lookup(Stage.FETCH, query.plan, pages, query.waiters, room=room)
        plan, rank = query.plan, self.tier.placement.cp_rank
        if room.own_slots is None:
            fetch.word = 0  # a local failure: the group hears of it as a usable prefix of 0
        else:
            try:
                kv_keys, idx_keys = self.tier.chain_keys(plan.hashes[:pages], plan.parent)
                mine = [i for i, o in enumerate(plan.owners[:pages]) if o == rank]
                if len(mine) != len(room.own_slots):
                    raise RuntimeError(f"{len(room.own_slots)} host slots for {len(mine)} own pages")
                timeout_s = self.timeouts.for_tokens(pages * self.tier.page_size)
                for index, slot in zip(mine, room.own_slots):  # every own page in flight at once
                    fetch.jobs.append(self.workers.submit(
                        self._page_job, kv_keys[index], idx_keys[index], slot, timeout_s=timeout_s,
                        what=f"L3 fetch of {pages} pages",
                    ))
                    fetch.page_indices.append(index)
                if not mine:
                    fetch.word = pages  # nothing of its own to read: the others judge theirs
            except Exception:
                logger.exception("sglang-cp-hicache L3: fetch failed on cp_rank %d", rank)
                fetch.cancel()
                fetch.word = 0
        self.pending.append(fetch)
        return True

    def _settle(self, lookup: L3Lookup, pages: int) -> int:
        lookup.cancel()  # settled: its host rows are given back now
        tokens = self.port.settle(lookup.plan, pages, lookup.room)
        if tokens:
            rank = self.tier.placement.cp_rank
            self.counters.add(
                restored_nodes=1, restored_tokens=tokens,
                restored_pages=sum(o == rank for o in lookup.plan.owners[: tokens // self.tier.page_size]),
            )
        return tokens

    def _release_waiters(self, lookup: L3Lookup, restored_tokens: int) -> None:
        """The waiting requests may go on (the same step on every rank)."""
        waiters = lookup.waiters
        if waiters is None:
            return
        for rid in waiters.rids:
            if self.waiting.get(rid) is waiters:
                del self.waiting[rid]
        if waiters.asker in waiters.rids and restored_tokens > 0:
            self.port.report(lookup.plan, waiters.asker, restored_tokens)

    def abandon(self, error: BaseException) -> CpL3PrefetchAborted:
        """The MIN carrying the words failed: the peers' words are unknown,
        so nothing is inserted; give back what every pending lookup holds and
        release its requests. Returns the exception to raise."""
        pending, self.pending = self.pending, []
        rank = self.tier.placement.cp_rank
        what = ", ".join(f"{p.stage.value} of {p.pages} pages" for p in pending)
        logger.error(
            "sglang-cp-hicache L3: the step all-reduce failed on cp_rank %d with %d L3 lookup(s) pending (%s); "
            "none is inserted, what they held is given back: %r", rank, len(pending), what, error,
        )
        for lookup in pending:
            lookup.cancel()
            if lookup.stage is Stage.FETCH:
                self.port.settle(lookup.plan, 0, lookup.room)
            self.port.release_anchor(lookup.plan)
            self._release_waiters(lookup, 0)
        return CpL3PrefetchAborted(
            f"CP step all-reduce failed with {len(pending)} L3 lookup(s) pending on cp_rank {rank} "
            f"(a CP rank died or left the group?); none was inserted, their host slots, room and "
            f"anchors were given back: {error!r}"
        )

    def reset(self) -> None:
        """The cache was cleared (alike on every rank): the lookups go with
        the tree and host pools they referred to; their I/O writes nothing more."""
        for lookup in self.pending:
            lookup.cancel()
        self.pending = []
        self.waiting = {}

    def wait_io(self, timeout: Optional[float] = None) -> bool:
        """Block until this rank's lookup I/O is done (tests and tools: so its
        next words are ready); False if ``timeout`` ran out first."""
        return self.workers.wait([job for lookup in self.pending for job in lookup.jobs], timeout)

    # ---- the I/O jobs (worker threads) ------------------------------------------------
    def _query_job(self, job: L3Job, hashes: list[str], owners: list[int], parent: Optional[str]) -> int:
        return self.tier.query_pages(hashes, owners, parent)

    def _page_job(self, job: L3Job, kv_key: str, idx_key: str, slot: int) -> bool:
        return self.tier.read_page(kv_key, idx_key, slot, job.publish)

