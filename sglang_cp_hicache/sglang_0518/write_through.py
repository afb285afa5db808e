"""Write-through of the CP cache: back up this rank's pages of a node, and
the CPU page mirror the write path reads instead of the device locs.

A write needs no collective: the host ledger (every rank's host usage,
charged from the node's page owners) decides identically on every rank
whether the node fits and which host nodes to evict first. A local failure
(host allocation short, copy raised) leaves the node looking backed up on
this rank too, so the trees stay identical, and is reported in the step's
all-reduce (:mod:`.step_protocol`), where every rank takes the write back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from sglang.srt.mem_cache.radix_cache import TreeNode

from sglang_cp_hicache.kernels._checks import debug_enabled
from sglang_cp_hicache.policy_0518.node_state import set_host_state
from sglang_cp_hicache.policy_0518.plan import HiCacheWriteFailure, check_pages, page_owner_tokens
from sglang_cp_hicache.sglang_0518.step_status import Vote
from sglang_cp_hicache.sglang_0518.transfer_adapter import PendingWrite, WriteState

logger = logging.getLogger(__name__)

__all__ = ["EMPTY_PAGES", "InflightWrite", "WriteThroughMixin"]

#: The CPU page mirror of a node without device pages (the root).
EMPTY_PAGES = torch.empty((0,), dtype=torch.int64)


@dataclass
class InflightWrite:
    """A write whose ack has not been consumed yet (one ack per write)."""

    seq: int
    pending: PendingWrite
    need: list[int]  # ledger charge, tokens per rank


class WriteThroughMixin:
    """``write_backup`` and the page mirror, for :class:`CpHiRadixCache`."""

    # ---- the CPU page mirror ----------------------------------------------
    def _pages_for(self, value: torch.Tensor, value_pages: Optional[torch.Tensor]) -> torch.Tensor:
        """The CPU mirror of ``value`` (logical pages of its whole pages)."""
        P = self.page_size
        num_pages = len(value) // P
        if value_pages is None:
            self.cp_counters.device_page_reads += 1
            if not self._warned_device_page_read:
                self._warned_device_page_read = True
                logger.warning(
                    "cp-hicache: insert without CpInsertParams.value_pages: reading the node's "
                    "locs back from the device (one sync per insert); pass the allocator's CPU "
                    "page mirror to keep the write path sync-free"
                )
            return value[: num_pages * P : P].to("cpu", torch.int64) // P
        pages = check_pages(value_pages)
        if pages.numel() < num_pages:
            raise ValueError(
                f"value_pages lists {pages.numel()} pages, value has {num_pages} whole pages"
            )
        pages = pages[:num_pages]
        if debug_enabled():  # a sync, on purpose: catch a mirror that lies
            actual = value[: num_pages * P : P].to("cpu", torch.int64) // P
            if not torch.equal(actual, pages):
                raise ValueError("value_pages does not match value's pages")
        return pages

    def cp_prefix_pages(self, node: TreeNode) -> torch.Tensor:
        """CPU mirror of the device locs from the root down to ``node``
        (every node on the path must be on the device)."""
        chunks = []
        while node is not self.root_node:
            if node.evicted:
                raise ValueError(f"node {node.id} is evicted: no device pages to mirror")
            chunks.append(node.cp_pages)
            node = node.parent
        chunks.reverse()
        return torch.cat(chunks) if chunks else EMPTY_PAGES

    # ---- write-through ---------------------------------------------------
    def write_backup(self, node: TreeNode, write_back: bool = False) -> int:
        """Back up this rank's pages of ``node``, with no collective: the
        ledger decides identically on every rank. A local failure (host
        allocation short, copy raised) leaves the node looking backed up
        here too, so the trees stay identical, and is reported in the step's
        all-reduce, where every rank takes the write back."""
        if write_back:
            raise ValueError("CP HiCache supports write_through policies, not write_back")
        # Backed-up nodes form a prefix from the root (as upstream).
        if node.parent is not self.root_node and not node.parent.backuped:
            return 0
        # Owners come from the node's CPU page mirror: no read of node.value.
        pages = node.cp_pages
        need = page_owner_tokens(self.cp_placement, pages)
        if not self._ledger.fits(need):
            self._evict_host_for(self._ledger.shortfall(need))
        if not self._ledger.fits(need):  # identical on every rank: nothing to tell
            self.cp_counters.write_failures += 1
            return 0
        seq, self._write_seq = self._write_seq, self._write_seq + 1
        pending = self._start_write(node, pages, seq)
        set_host_state(node, pending.metadata)
        node.host_value = None
        self._ledger.charge(need)
        self._track_write_through_node(node, len(node.key))
        self._inflight_writes[node.id] = InflightWrite(seq, pending, need)
        self.inc_lock_ref(node)
        self.cp_counters.write_backups += 1
        return len(node.value)

    def _start_write(self, node: TreeNode, pages: torch.Tensor, seq: int) -> PendingWrite:
        """Plan and submit the copy of write ``seq``; on a local failure a
        placeholder (no host slots, same ack) stands in for it and the
        failure waits for the step's all-reduce."""
        extra = self._get_extra_pools()
        pending = None
        try:
            pending = self.cp_transfer.plan_write(node.value, pages, node_id=node.id, **extra)
            if isinstance(pending, HiCacheWriteFailure):
                self._step_status.fail_write(Vote.REFUSED, seq)
                pending = self.cp_transfer.placeholder_write(node.value, pages, node_id=node.id, **extra)
            pending.start()
        except Exception as exc:  # the group hears of it at the step's all-reduce
            self._step_status.fail_write(Vote.FAILED, seq, exc)
            if pending is not None and pending.state is WriteState.PLANNED:
                pending.abort()
            pending = self.cp_transfer.placeholder_write(node.value, pages, node_id=node.id)
        return pending

    def _finish_write_through_ack(self, ack_id: int, *, release_lock: bool) -> None:
        record = self._inflight_writes.pop(ack_id, None)
        if record is not None and record.pending.state is WriteState.STARTED:
            record.pending.keep()
        super()._finish_write_through_ack(ack_id, release_lock=release_lock)
