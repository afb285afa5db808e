"""The step protocol of the CP cache: SGLang's per-step MIN all-reduce of
ready acks, with this rank's step status folded into the two count words.

Every decision the cache takes is identical on every rank; what a rank
cannot know about the others is a local failure (a host allocation short, a
copy that raised, a device allocation that failed). Each rank folds its
first failure since the last step into the ack counts (:mod:`.step_status`);
after the reduce every rank takes back the same writes and load-backs,
before any ack is consumed, and raises on a copy failure. No collective of
its own, and none wider than SGLang's.
"""

from __future__ import annotations

from typing import Optional

import torch
from sglang.srt.disaggregation.kv_events import StorageMedium

from sglang_cp_hicache.sglang_0518.load_back import LoadBackRecord
from sglang_cp_hicache.sglang_0518.step_status import GroupOutcome, Vote
from sglang_cp_hicache.sglang_0518.transfer_adapter import WriteState
from sglang_cp_hicache.sglang_0518.write_through import InflightWrite

__all__ = ["CpHiCacheTransferError", "StepProtocolMixin"]


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
        Returns the counts every rank may consume."""
        n = len(counts)
        write_acks, load_acks = counts[0], counts[1] if n > 1 else 0
        # Only a failed write needs the oldest in-flight one (its cut's origin).
        first = self._first_inflight_write_seq() if self._step_status.write is not None else None
        vec = torch.tensor(
            [*self._step_status.words(write_acks, load_acks, first), *counts[2:]], dtype=torch.int64
        )
        self._all_reduce(vec, torch.distributed.ReduceOp.MIN)
        reduced = vec.tolist()
        step = self._step_status.read(reduced)
        mine_write, mine_load = self._step_status.clear()
        out = [step.write_acks, step.load_acks, *reduced[2:]][: max(n, 1)]
        write, load = step.write, step.load
        if write.ok and load.ok:
            return out
        if not write.ok:
            self._take_back_writes(write, self._first_inflight_write_seq())
        if not load.ok:
            self._take_back_loads()
        if write.vote == Vote.FAILED or load.vote == Vote.FAILED:
            mine = mine_write if write.vote == Vote.FAILED else mine_load
            error = mine.error if mine is not None else None
            what = "backup" if write.vote == Vote.FAILED else "load-back"
            raise CpHiCacheTransferError(
                f"CP HiCache {what} failed on a CP rank; rolled back on every rank "
                f"(this rank: {error!r})"
            ) from error
        return out

    def _first_inflight_write_seq(self) -> Optional[int]:
        """Sequence number of the oldest write whose ack is not consumed
        (the same on every rank: the same writes, the same acks consumed)."""
        return min((r.seq for r in self._inflight_writes.values()), default=None)

    # ---- taking writes back ----------------------------------------------------
    def _take_back_writes(self, outcome: GroupOutcome, first_seq: int) -> None:
        """Undo every in-flight write from the first failed one on (newest
        first): later writes may be children of it."""
        doomed = [(a, r) for a, r in self._inflight_writes.items() if r.seq - first_seq >= outcome.cut]
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
        """Undo every load-back whose ack has not been consumed: a failed
        load may share a merged copy (and its ack) with the others."""
        records, self._inflight_loads = self._inflight_loads, []
        queue = self.cache_controller.ack_load_queue
        for ack in queue:
            ack.finish_event.synchronize()
        queue.clear()
        for record in reversed(records):
            if record.last_node.id in self.ongoing_load_back:
                self._undo_load_back(record)
        # A rank whose allocation failed never took the pages the others just
        # freed: the free SETS agree, the lists may not. Sorting every free
        # list makes the allocators identical again.
        self.token_to_kv_pool_allocator.merge_and_sort_free()

    def _undo_load_back(self, record: LoadBackRecord) -> None:
        self.ongoing_load_back.pop(record.last_node.id, None)
        self.dec_lock_ref(record.last_node)
        for n in reversed(record.nodes):
            self.evictable_size_ -= len(n.value)
            self._record_remove_event(n, medium=StorageMedium.GPU)
            n.value = None
            n.cp_pages = None
            self._update_leaf_status(n)
            self._update_host_leaf_status(n)
            self._update_leaf_status(n.parent)
        self.token_to_kv_pool_allocator.free_mirrored(record.pages)
        self.cp_counters.load_backs -= 1
        self.cp_counters.load_back_tokens -= int(record.device_locs.numel())
