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
* Prefetch (:meth:`L3Cache.prefetch`, called alike on every rank
  for a request whose match ends before its whole pages do, when that
  match ends at the root or at a node whose host copy is final).
"""

from __future__ import annotations

import logging
from typing import Any, Hashable, Optional

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sglang_cp_hicache.l3.prefetch import chain_hashes
from sglang_cp_hicache.l3.rank import RankL3
from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.sglang_0518.l3_port import path_tokens, plain_key

logger = logging.getLogger(__name__)

__all__ = ["L3Cache"]


class L3Cache:
    """L3 write and prefetch of one CP cache (``rank_l3`` None: L3 is off).

    ``tree``: the SGLang cache (its tree, ``match_prefix`` and write-through
    records are read from it, nothing of this library)."""

    def __init__(self, tree: Any, placement: CpPlacement, rank_l3: Optional[RankL3]) -> None:
        self.tree = tree
        self.placement = placement
        self.rank_l3 = rank_l3

    def reset(self) -> None:
        """The lookups go with the tree and host pool (their I/O writes no more)."""
        if self.rank_l3 is not None:
            self.rank_l3.prefetcher.reset()

    # ---- host -> L3 ------------------------------------------------------------
    def store_acked(self, ack_id: int) -> None:
        """Store the nodes of write ``ack_id`` (its ack is being consumed:
        their host copy is final)."""
        ongoing = self.tree.ongoing_write_through
        if self.rank_l3 is not None and ack_id in ongoing:
            _, _, publish_nodes = ongoing[ack_id]
            for node in publish_nodes:
                self._store_node(node)

    def _store_node(self, node: TreeNode) -> None:
        """Store this rank's pages of ``node`` (its host copy is final)."""
        meta = node.cp_hicache
        if meta is None or not plain_key(node.key) or meta.token_owners is None:
            return
        P, tier, rank = self.placement.page_size, self.rank_l3.tier, self.placement.cp_rank
        tokens = path_tokens(node)
        first = (len(tokens) - meta.logical_len) // P
        owners = meta.token_owners[::P].tolist()
        try:
            hashes, parent = chain_hashes(tier, tokens, first)
        except Exception:  # L3 is a cache: a failed write is a later miss, never an error
            logger.exception("sglang-cp-hicache L3: hashing node %d failed on cp_rank %d", node.id, rank)
            tier.counters.add(write_failures=sum(o == rank for o in owners))
            return
        self.rank_l3.writer.write(hashes, owners, meta.host_indices[::P].tolist(), parent)

    # ---- L3 -> host ------------------------------------------------------------------
    def prefetch(self, key: RadixKey, rid: Optional[Hashable] = None) -> int:
        """Look the pages of ``key`` past its cached prefix up in L3 (call it
        alike on every rank). Returns the pages looked up (the same on every
        rank; 0: nothing to do). Two step all-reduces follow: the first
        agrees on the pages present on their owners (nothing allocated or
        evicted before), the second on the pages fetched and verified; then
        a host-only node of exactly those pages is in the tree. ``rid``: the
        scheduler's request waiting on it."""
        found = self._lookup_target(key)
        if found is None:
            return 0
        anchor, chain = found
        plan = self.rank_l3.port.plan(anchor, chain)  # a hashing failure is this rank's "miss from here"
        anchor.protect_host()  # the chain's parent stays until the lookup settles
        self.rank_l3.prefetcher.start(plan, rid)
        return plan.num_pages

    def _lookup_target(self, key: RadixKey):
        """(anchor, chain key) of a prefetch, or None: the whole pages of
        ``key`` past the cached prefix, when that prefix ends at a node whose
        host copy is final (or the root) and no lookup hangs there yet."""
        tree, P = self.tree, self.placement.page_size
        if self.rank_l3 is None or tree.is_eagle or not plain_key(key):
            return None
        match = tree.match_prefix(MatchPrefixParams(key=key))
        anchor = match.last_host_node
        matched = len(match.device_indices) + match.host_hit_length
        if len(path_tokens(anchor)) != matched:
            return None  # the deepest matched node has no final host copy yet
        if anchor is not tree.root_node and (not anchor.backuped or anchor.write_through_pending_id is not None):
            return None
        whole = (len(key) - matched) // P * P
        if whole <= 0:
            return None
        chain = key[matched : matched + whole]
        if self.rank_l3.prefetcher.hangs_at(anchor, tuple(chain.token_ids[:P])):
            return None
        return anchor, chain

    # ---- the step's MIN (called by the step protocol) -----------------------------------
    def words(self) -> list[int]:
        return self.rank_l3.prefetcher.words() if self.rank_l3 is not None else []

    def commit(self, agreed: list[int]) -> None:
        if self.rank_l3 is not None:
            self.rank_l3.prefetcher.commit(agreed)

    def abandon(self, error: BaseException) -> Exception:
        return self.rank_l3.prefetcher.abandon(error)

    # ---- the scheduler's step and admin calls ------------------------------------------------
    def publish_metrics(self) -> None:
        """This step's L3 figures into the metrics (--enable-metrics)."""
        if self.rank_l3 is not None:
            self.rank_l3.publish_metrics()

    def clear(self) -> bool:
        """``clear_hicache_storage``: remove every object of this deployment's
        L3 namespaces (alike on every rank, see :meth:`RankL3.clear`); True
        when this rank's pass left none it could see behind."""
        if self.rank_l3 is None:
            logger.warning("Hierarchical cache storage backend is not enabled.")
            return False
        return self.rank_l3.clear().ok

    def wait_io(self, timeout: Optional[float] = None) -> bool:
        """Block until this rank's L3 I/O is done: its lookups' reads (so its
        next words are ready) and its writes; False if ``timeout`` ran out first."""
        return self.rank_l3 is None or self.rank_l3.wait_io(timeout)
