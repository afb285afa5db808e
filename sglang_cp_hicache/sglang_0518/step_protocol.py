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
and none wider than SGLang's. The take-backs themselves belong to the
write-through and the load-back; this module decides when.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from sglang_cp_hicache.l3.prefetch import CpL3PrefetchAborted
from sglang_cp_hicache.sglang_0518.l3_cache import L3Cache
from sglang_cp_hicache.sglang_0518.load_back import LoadBack
from sglang_cp_hicache.sglang_0518.step_status import StepStatus, Vote
from sglang_cp_hicache.sglang_0518.write_through import WriteThrough

__all__ = ["CpHiCacheTransferError", "CpL3PrefetchAborted", "StepProtocol"]


class CpHiCacheTransferError(RuntimeError):
    """A CP HiCache copy failed on some rank; every rank rolled back and raises."""


@dataclass(eq=False, repr=False)  # identity, not contents; the tree is too big to print
class StepProtocol:
    """The step's all-reduce and the take-backs of one CP cache.

    ``tree``: the SGLang cache (its ack queues, ``_count_ready_acks`` and
    ``_all_reduce`` are read from it, nothing of this library); ``status``:
    this rank's failures since the last step; ``writes`` / ``loads``: what
    is in flight and takes itself back; ``l3``: the lookups whose words ride
    the same all-reduce."""

    tree: Any
    status: StepStatus
    writes: WriteThrough
    loads: LoadBack
    l3: L3Cache

    # ---- SGLang's entry points: every one reaches exchange -----------------
    def ready_counts(self) -> tuple[int, int, tuple[int, ...]]:
        """SGLang's ``_sync_hicache_ready_counts``."""
        tree = self.tree
        ctrl = tree.cache_controller
        storage = (
            (ctrl.prefetch_hit_queue.qsize(), ctrl.ack_backup_queue.qsize(), ctrl.host_mem_release_queue.qsize())
            if tree.enable_storage else ()
        )
        counts = [tree._count_ready_acks(ctrl.ack_write_queue), tree._count_ready_acks(ctrl.ack_load_queue), *storage]
        counts = self.exchange(counts)
        return counts[0], counts[1], tuple(counts[2:])

    def write_finish_count(self) -> int:
        """The write acks every rank may consume (``writing_check``'s count)."""
        tree = self.tree
        ready = tree._count_ready_acks(tree.cache_controller.ack_write_queue) if tree.pp_rank == 0 else 0
        return self.exchange([ready])[0]

    def load_finish_count(self) -> int:
        """The load acks every rank may consume (``loading_check``'s count);
        the load count sits where ``exchange`` expects the write count."""
        tree = self.tree
        ready = tree._count_ready_acks(tree.cache_controller.ack_load_queue) if tree.pp_rank == 0 else 0
        return self.exchange([0, ready])[1]

    # ---- the all-reduce ------------------------------------------------------
    def exchange(self, counts: list[int]) -> list[int]:
        """SGLang's MIN all-reduce of ready-ack counts, with this rank's step
        status folded into the two count words (no extra word: see
        ``step_status``); every rank then takes back the same failed writes
        and load-backs before any ack is consumed. ``counts``: write acks,
        then load acks, then SGLang's storage counts (passed through).
        Pending L3 prefetches ride as extra words and are settled first
        (:mod:`.l3_cache`). Returns the counts every rank may consume."""
        n = len(counts)
        status = self.status
        write_acks, load_acks = counts[0], counts[1] if n > 1 else 0
        # Only a failed write needs the oldest in-flight one (its cut's origin).
        first = self.writes.first_seq() if status.write is not None else None
        # One word per pending L3 prefetch (the same count on every rank):
        # this rank's usable prefix; the MIN is what every rank restores.
        l3_words = self.l3.words()
        vec = torch.tensor([*status.words(write_acks, load_acks, first), *counts[2:], *l3_words], dtype=torch.int64)
        try:
            self.tree._all_reduce(vec, torch.distributed.ReduceOp.MIN)
        except Exception as exc:
            if not l3_words:
                raise
            # A peer died or left between two MINs of an L3 prefetch: nothing
            # of it is inserted here, and what this rank holds for it goes back.
            raise self.l3.abandon(exc) from exc
        reduced = vec.tolist()
        cut = len(reduced) - len(l3_words)
        reduced, l3_agreed = reduced[:cut], reduced[cut:]
        self.l3.commit(l3_agreed)
        step = status.read(reduced)
        mine_write, mine_load = status.clear()
        out = [step.write_acks, step.load_acks, *reduced[2:]][: max(n, 1)]
        write, load = step.write, step.load
        if write.ok and load.ok:
            return out
        first = self.writes.first_seq()
        if Vote.FAILED in (write.vote, load.vote):
            # Every rank raises: every write and load-back whose ack is not
            # consumed goes, so each rank is as it was before them.
            self.writes.take_back(0, first)
            self.loads.take_back()
            error = self._own_error(mine_write, mine_load)
            what = "backup" if write.vote == Vote.FAILED else "load-back"
            raise CpHiCacheTransferError(
                f"CP HiCache {what} failed on a CP rank; every rank took back every write and "
                f"load-back in flight (this rank: {error!r})"
            ) from error
        if not write.ok:  # REFUSED: from the first refused write on, quietly
            self.writes.take_back(write.cut, first)
        if not load.ok:
            self.loads.take_back()
        return out

    @staticmethod
    def _own_error(mine_write, mine_load) -> Optional[BaseException]:
        """This rank's own copy or allocation error (the raise's cause), if any."""
        errors = [f.error for f in (mine_write, mine_load) if f is not None and f.vote == Vote.FAILED]
        return next((e for e in errors if e is not None), None)
