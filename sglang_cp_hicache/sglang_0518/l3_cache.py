"""L3 in the CP cache's step: write a node's owned pages once its host
backup is final, restore a chain from L3 as a host-only node.

The protocol is the shared one (:mod:`sglang_cp_hicache.l3.prefetch`:
query -> MIN -> fetch -> MIN -> insert, deadlines, joins, aborts); this
release's side of it is :class:`~.l3_port.L3Port0518`, and its words ride
the step's MIN all-reduce (:mod:`.step_protocol`, one word per pending
lookup, the same count on every rank). No collective of its own, no L3
membership state:

* Write: when a node's write-through ack is consumed (every rank consumes
  the same acks, and only acks of writes no rank took back), each rank
  copies the pages of the node it owns out of its host pools and stores
  them on its L3 write threads. A failed put leaves that page absent
  (objects are renamed into place whole) or refused by its envelope; a
  later lookup decides from what each owner finds.
* Prefetch (:meth:`L3CacheMixin.l3_prefetch`, called alike on every rank
  for a request whose match ends before its whole pages do, when that
  match ends at the root or at a node whose host copy is final).
"""

from __future__ import annotations

import logging
from typing import Hashable, Optional

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sglang_cp_hicache.l3.prefetch import chain_hashes
from sglang_cp_hicache.l3.rank import RankL3
from sglang_cp_hicache.policy_0518.metadata import CpHiCacheNodeMetadata
from sglang_cp_hicache.sglang_0518.l3_port import insert_host_node, path_tokens, plain_key

logger = logging.getLogger(__name__)

__all__ = ["L3CacheMixin"]


class L3CacheMixin:
    """L3 write and prefetch, for :class:`CpHiRadixCache` (``cp_l3`` None: off)."""

    cp_l3: Optional[RankL3]

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
        if meta is None or not plain_key(node.key) or meta.token_owners is None:
            return
        P, tier = self.page_size, self.cp_l3.tier
        tokens = path_tokens(node)
        first = (len(tokens) - meta.logical_len) // P
        owners = meta.token_owners[::P].tolist()
        try:
            hashes, parent = chain_hashes(tier, tokens, first)
        except Exception:  # L3 is a cache: a failed write is a later miss, never an error
            logger.exception("cp-hicache L3: hashing node %d failed on cp_rank %d", node.id, self.cp_placement.cp_rank)
            tier.counters.add(write_failures=sum(o == self.cp_placement.cp_rank for o in owners))
            return
        self.cp_l3.writer.write(hashes, owners, meta.host_indices[::P].tolist(), parent)

    # ---- L3 -> host ------------------------------------------------------------------
    def l3_prefetch(self, key: RadixKey, rid: Optional[Hashable] = None) -> int:
        """Look the pages of ``key`` past its cached prefix up in L3 (call it
        alike on every rank). Returns the pages looked up (the same on every
        rank; 0: nothing to do). Two step all-reduces follow: the first
        agrees on the pages present on their owners (nothing allocated or
        evicted before), the second on the pages fetched and verified; then
        a host-only node of exactly those pages is in the tree. ``rid``: the
        scheduler's request waiting on it."""
        found = self._l3_lookup_target(key)
        if found is None:
            return 0
        anchor, chain = found
        plan = self.cp_l3.port.plan(anchor, chain)  # a hashing failure is this rank's "miss from here"
        anchor.protect_host()  # the chain's parent stays until the lookup settles
        self.cp_l3.prefetcher.start(plan, rid)
        return plan.num_pages

    def _l3_lookup_target(self, key: RadixKey):
        """(anchor, chain key) of a prefetch, or None: the whole pages of
        ``key`` past the cached prefix, when that prefix ends at a node whose
        host copy is final (or the root) and no lookup hangs there yet."""
        if self.cp_l3 is None or self.is_eagle or not plain_key(key):
            return None
        match = self.match_prefix(MatchPrefixParams(key=key))
        anchor = match.last_host_node
        matched = len(match.device_indices) + match.host_hit_length
        if len(path_tokens(anchor)) != matched:
            return None  # the deepest matched node has no final host copy yet
        if anchor is not self.root_node and (not anchor.backuped or anchor.write_through_pending_id is not None):
            return None
        whole = (len(key) - matched) // self.page_size * self.page_size
        if whole <= 0:
            return None
        chain = key[matched : matched + whole]
        if self.cp_l3.prefetcher.hangs_at(anchor, tuple(chain.token_ids[: self.page_size])):
            return None
        return anchor, chain

    def _l3_insert_host_node(self, anchor: TreeNode, key: RadixKey, meta: CpHiCacheNodeMetadata) -> None:
        insert_host_node(self, anchor, key, meta)

    # ---- the step's MIN (called by the step protocol) -----------------------------------
    def _l3_local_words(self) -> list[int]:
        return self.cp_l3.prefetcher.words() if self.cp_l3 is not None else []

    def _l3_commit(self, agreed: list[int]) -> None:
        if self.cp_l3 is not None:
            self.cp_l3.prefetcher.commit(agreed)

    def _l3_abandon(self, error: BaseException) -> Exception:
        return self.cp_l3.prefetcher.abandon(error)

    # ---- the scheduler's step and admin calls ------------------------------------------------
    def check_hicache_events(self) -> None:
        super().check_hicache_events()
        if self.cp_l3 is not None:  # this step's L3 figures into the metrics (--enable-metrics)
            self.cp_l3.publish_metrics()

    def clear_storage_backend(self) -> bool:
        """``clear_hicache_storage``: remove every object of this deployment's
        L3 namespaces (alike on every rank, see :meth:`RankL3.clear`); True
        when this rank's pass left none it could see behind."""
        if self.cp_l3 is None:
            logger.warning("Hierarchical cache storage backend is not enabled.")
            return False
        return self.cp_l3.clear().ok

    def l3_wait_io(self, timeout: Optional[float] = None) -> bool:
        """Block until this rank's L3 I/O is done: its lookups' reads (so its
        next words are ready) and its writes; False if ``timeout`` ran out first."""
        return self.cp_l3 is None or self.cp_l3.wait_io(timeout)
