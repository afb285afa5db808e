"""Host -> L3 writes of one rank, off the scheduler thread, bounded.

A node's own pages are copied out of the host pools on the scheduler thread
(its host slots may hold other pages by the time the write runs) and stored
by an I/O thread. Nothing waits for a write and nothing records "in L3": a
write that fails, or is dropped, is a later miss, never an error. Writes are
dropped rather than queued without bound: a write is dropped while
:data:`MAX_QUEUED_PAGES` pages wait. A write still running past its deadline
(hung storage) keeps its thread, and a spare thread takes its place
(:mod:`.workers`), so later writes and reads go on.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from sglang_cp_hicache.l3.host_tier import HostL3Tier
from sglang_cp_hicache.l3.location import L3Timeouts
from sglang_cp_hicache.l3.workers import L3Job, L3Workers

__all__ = ["L3Writer", "MAX_QUEUED_PAGES"]

logger = logging.getLogger(__name__)

#: Own pages copied and waiting to be stored, at most (each holds a page's
#: KV and indexer bytes in memory: 2.44 MiB + 0.5 MiB for DeepSeek-V3.2).
MAX_QUEUED_PAGES = 1024


class L3Writer:
    """Stores this rank's pages of backed-up nodes (see the module doc)."""

    def __init__(self, tier: HostL3Tier, workers: L3Workers, timeouts: L3Timeouts,
                 max_queued_pages: int = MAX_QUEUED_PAGES) -> None:
        self.tier = tier
        self.workers = workers
        self.timeouts = timeouts
        self.max_queued_pages = max_queued_pages
        self._jobs: list[tuple[L3Job, int]] = []  # (job, own pages) not known done

    def write(self, hashes: list[str], owners: list[int], slots: list[int], parent: Optional[str] = None) -> None:
        """Store this rank's pages of a chain whose host copy is final, each
        page on its own I/O job (several in flight at once). ``slots``: the
        host slot of each page this rank owns, in chain order; ``parent``:
        the page hash before the chain's first page (None: the root). Never
        raises: a failure is logged and counted."""
        rank = self.tier.placement.cp_rank
        mine = sum(o == rank for o in owners)
        if mine == 0:
            return
        queued = self._prune()
        if queued + mine > self.max_queued_pages:
            self.tier.counters.add(dropped_writes=mine)
            logger.warning("sglang-cp-hicache L3: %d writes queued on cp_rank %d; dropping a write of %d pages",
                           queued, rank, mine)
            return
        try:
            snap = self.tier.snapshot_pages(hashes, owners, slots, parent)
            keys = self.tier.snapshot_keys(snap)
        except Exception:  # L3 is a cache: a failed write is a later miss, never an error
            logger.exception("sglang-cp-hicache L3: storing %d pages failed on cp_rank %d", mine, rank)
            self.tier.counters.add(write_failures=mine)
            return
        timeout_s = self.timeouts.for_tokens(mine * self.tier.page_size)
        for (kv_key, idx_key), kv, idx in zip(keys, snap.kv, snap.indexer):
            try:
                job = self.workers.submit(self._store_job, kv_key, idx_key, kv, idx, timeout_s=timeout_s,
                                          what="L3 write of a page")
            except Exception:
                logger.exception("sglang-cp-hicache L3: queueing a page write failed on cp_rank %d", rank)
                self.tier.counters.add(write_failures=1)
                continue
            self._jobs.append((job, 1))

    def _prune(self) -> int:
        """Forget finished writes; returns the pages still queued or running."""
        self._jobs = [(job, pages) for job, pages in self._jobs if not job.done()]
        return sum(pages for _, pages in self._jobs)

    def _store_job(self, job: L3Job, kv_key: str, idx_key: str, kv: Any, idx: Any) -> bool:
        try:
            return self.tier.store_page(kv_key, idx_key, kv, idx)
        except Exception:
            logger.exception("sglang-cp-hicache L3: storing %s failed on cp_rank %d", kv_key, self.tier.placement.cp_rank)
            self.tier.counters.add(write_failures=1)
            return False

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until every write is done; False if ``timeout`` ran out first."""
        return self.workers.wait([job for job, _ in self._jobs], timeout)
