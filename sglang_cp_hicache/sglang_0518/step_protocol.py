"""The step protocol of the CP cache: SGLang's per-step MIN all-reduce of
ready acks, with this rank's step status folded into the two count words.

Every decision the cache takes is identical on every rank; what a rank
cannot know about the others is a local failure (a host allocation short, a
copy that raised, a device allocation that failed). Each rank folds its
failures since the last step into the ack counts (:mod:`.step_status`);
after the reduce every rank takes back the same writes and load-backs,
before any ack is consumed. A step that raises (a copy or allocation
failed somewhere) takes back every write and load-back whose ack is not
consumed, with what the step built on the restored nodes, so each rank is
as it was before them; a refused host allocation alone takes back the
writes from the first refused one on, quietly. No collective of its own,
and none wider than SGLang's.
"""

from __future__ import annotations

from typing import Optional

import torch
from sglang.srt.mem_cache.radix_cache import TreeNode

from sglang_cp_hicache.l3.prefetch import CpL3PrefetchAborted
from sglang_cp_hicache.sglang_0518.load_back import LoadBackRecord
from sglang_cp_hicache.sglang_0518.step_status import Vote
from sglang_cp_hicache.sglang_0518.transfer_adapter import WriteState
from sglang_cp_hicache.sglang_0518.write_through import InflightWrite

__all__ = ["CpHiCacheTransferError", "CpL3PrefetchAborted", "StepProtocolMixin"]


class CpHiCacheTransferError(RuntimeError):
    """A CP HiCache copy failed on some rank; every rank rolled back and raises."""


class StepProtocolMixin:
    """The step's all-reduce and the take-backs, for :class:`CpHiRadixCache`."""

    # ---- SGLang's entry points: every one reaches _exchange ---------------
    def _sync_hicache_ready_counts(self):
        ctrl = self.cache_controller
        storage = (
            (ctrl.prefetch_hit_queue.qsize(), ctrl.ack_backup_queue.qsize(), ctrl.host_mem_release_queue.qsize())
            if self.enable_storage else ()
        )
        counts = [self._count_ready_acks(ctrl.ack_write_queue), self._count_ready_acks(ctrl.ack_load_queue), *storage]
        counts = self._exchange(counts)
        return counts[0], counts[1], tuple(counts[2:])

    def writing_check(self, write_back: bool = False, finish_count: Optional[int] = None):
        if finish_count is None and not write_back:
            ready = self._count_ready_acks(self.cache_controller.ack_write_queue) if self.pp_rank == 0 else 0
            finish_count = self._exchange([ready])[0]
        return super().writing_check(write_back=write_back, finish_count=finish_count)

    def loading_check(self, finish_count: Optional[int] = None):
        self._retire_loads()
        if finish_count is None:
            ready = self._count_ready_acks(self.cache_controller.ack_load_queue) if self.pp_rank == 0 else 0
            # the load count sits where _exchange expects the write count
            finish_count = self._exchange_loads(ready)
        super().loading_check(finish_count=finish_count)
        self._retire_loads()

    def _exchange_loads(self, ready: int) -> int:
        counts = self._exchange([0, ready])
        return counts[1]

    def _retire_loads(self) -> None:
        """Forget load-backs whose acks SGLang consumed."""
        self._inflight_loads = [r for r in self._inflight_loads if r.last_node.id in self.ongoing_load_back]

    # ---- the all-reduce ------------------------------------------------------
    def _exchange(self, counts: list[int]) -> list[int]:
        """SGLang's MIN all-reduce of ready-ack counts, with this rank's step
        status folded into the two count words (no extra word: see
        ``step_status``); every rank then takes back the same failed writes
        and load-backs before any ack is consumed. ``counts``: write acks,
        then load acks, then SGLang's storage counts (passed through).
        Pending L3 prefetches ride as extra words and are settled first
        (:mod:`.l3_cache`). Returns the counts every rank may consume."""
        n = len(counts)
        write_acks, load_acks = counts[0], counts[1] if n > 1 else 0
        # Only a failed write needs the oldest in-flight one (its cut's origin).
        first = self._first_inflight_write_seq() if self._step_status.write is not None else None
        # One word per pending L3 prefetch (the same count on every rank):
        # this rank's usable prefix; the MIN is what every rank restores.
        l3_words = self._l3_local_words()
        vec = torch.tensor(
            [*self._step_status.words(write_acks, load_acks, first), *counts[2:], *l3_words], dtype=torch.int64
        )
        try:
            self._all_reduce(vec, torch.distributed.ReduceOp.MIN)
        except Exception as exc:
            if not l3_words:
                raise
            # A peer died or left between two MINs of an L3 prefetch: nothing
            # of it is inserted here, and what this rank holds for it goes back.
            raise self._l3_abandon(exc) from exc
        reduced = vec.tolist()
        cut = len(reduced) - len(l3_words)
        reduced, l3_agreed = reduced[:cut], reduced[cut:]
        self._l3_commit(l3_agreed)
        step = self._step_status.read(reduced)
        mine_write, mine_load = self._step_status.clear()
        out = [step.write_acks, step.load_acks, *reduced[2:]][: max(n, 1)]
        write, load = step.write, step.load
        if write.ok and load.ok:
            return out
        first = self._first_inflight_write_seq()
        if Vote.FAILED in (write.vote, load.vote):
            # Every rank raises: every write and load-back whose ack is not
            # consumed goes, so each rank is as it was before them.
            self._take_back_writes(0, first)
            self._take_back_loads()
            error = self._own_error(mine_write, mine_load)
            what = "backup" if write.vote == Vote.FAILED else "load-back"
            raise CpHiCacheTransferError(
                f"CP HiCache {what} failed on a CP rank; every rank took back every write and "
                f"load-back in flight (this rank: {error!r})"
            ) from error
        if not write.ok:  # REFUSED: from the first refused write on, quietly
            self._take_back_writes(write.cut, first)
        if not load.ok:
            self._take_back_loads()
        return out

    @staticmethod
    def _own_error(mine_write, mine_load) -> Optional[BaseException]:
        """This rank's own copy or allocation error (the raise's cause), if any."""
        errors = [f.error for f in (mine_write, mine_load) if f is not None and f.vote == Vote.FAILED]
        return next((e for e in errors if e is not None), None)

    def _first_inflight_write_seq(self) -> Optional[int]:
        """Sequence number of the oldest write whose ack is not consumed
        (the same on every rank: the same writes, the same acks consumed)."""
        return min((r.seq for r in self._inflight_writes.values()), default=None)

    # ---- taking writes back ----------------------------------------------------
    def _take_back_writes(self, cut: int, first_seq: Optional[int]) -> None:
        """Undo every in-flight write from position ``cut`` on (newest
        first): later writes may be children of it."""
        if first_seq is None:
            return
        doomed = [(a, r) for a, r in self._inflight_writes.items() if r.seq - first_seq >= cut]
        for ack_id, record in reversed(doomed):
            del self._inflight_writes[ack_id]
            self._undo_write(ack_id, record)

    def _undo_write(self, ack_id: int, record: InflightWrite) -> None:
        """Take one in-flight write back on this rank (before its ack is consumed)."""
        lock_node, _, publish_nodes = self.ongoing_write_through.pop(ack_id)
        if record.pending.state is WriteState.STARTED:
            record.pending.undo()  # waits for the copy, drops the ack, frees the host slots
        for n in publish_nodes:  # the node, or its pieces if it was split since
            n.write_through_pending_id = None
            n.cp_hicache = None
            n.host_len = 0
            self._update_host_leaf_status(n)
        self._ledger.release(record.need)
        self.dec_lock_ref(lock_node)
        self.cp_counters.write_backups -= 1
        self.cp_counters.write_failures += 1

    # ---- taking load-backs back -------------------------------------------------
    def _take_back_loads(self) -> None:
        """Undo every load-back whose ack has not been consumed (a failed
        load may share a merged copy, and its ack, with the others), newest
        first, with everything the step built on the restored nodes."""
        records, self._inflight_loads = self._inflight_loads, []
        queue = self.cache_controller.ack_load_queue
        for ack in queue:
            ack.finish_event.synchronize()
        queue.clear()
        # Loads queued but not started (their batch was dropped) go too: a
        # later start would copy into pages freed here.
        self.cp_transfer.take_back_loads([r.load for r in records if r.load is not None])
        for record in reversed(records):
            if record.last_node.id in self.ongoing_load_back:
                self._undo_load_back(record)
        allocator = self.token_to_kv_pool_allocator
        if records:
            allocator.rewind_rr_cursor(records[0].rr_cursor)
        self._load_shadow = [0] * self.cp_placement.cp_size
        # A rank whose allocation failed never took the pages the others just
        # freed: the free SETS agree, the lists may not. Sorting every free
        # list makes the allocators identical again.
        allocator.merge_and_sort_free()

    def _undo_load_back(self, record: LoadBackRecord) -> None:
        """Evict the restored nodes again -- every piece of them, since a
        request may have split them -- after removing what the step built
        below them (new leaves, recomputed nodes): an evicted node keeps no
        node on the device below it. The same nodes on every rank (the tree
        is the same); each frees the pages it holds through its mirror."""
        self.ongoing_load_back.pop(record.last_node.id, None)
        self.dec_lock_ref(record.last_node)
        if record.load is None:  # the sizes this rank counted without restoring
            self.evictable_size_ -= record.tokens
        pieces = self._restored_pieces(record)
        ids = {id(p) for p in pieces}
        for piece in pieces:  # deepest first
            for child in list(piece.children.values()):
                if id(child) not in ids:
                    self._remove_built_on(child)
        for piece in pieces:
            if not piece.evicted:
                self._evict_backuped(piece)
        self.cp_counters.load_backs -= 1
        self.cp_counters.load_back_tokens -= record.tokens

    def _restored_pieces(self, record: LoadBackRecord) -> list:
        """The nodes now holding the restored chain, deepest first: from the
        last restored node up to the node it hangs from (a split puts the
        new prefix node between them; the split node keeps the suffix)."""
        pieces, node = [], record.last_node
        while node is not record.ancestor:
            if node is None or node is self.root_node:
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
                self._evict_backuped(n)
            else:
                self._evict_regular(n)
