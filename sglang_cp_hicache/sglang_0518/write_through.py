"""Write-through of the CP cache: back up this rank's pages of a node, and
the CPU page mirror the write path reads instead of the device locs.

A write needs no collective: the host ledger (every rank's host usage,
charged from the node's page owners) decides identically on every rank
whether the node fits and which host nodes to evict first. A local failure
(host allocation short, copy raised) leaves the node looking backed up on
this rank too, so the trees stay identical, and is reported in the step's
all-reduce (:mod:`.step_protocol`), where every rank takes the write back
(:meth:`WriteThrough.take_back`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.radix_cache import TreeNode

from sglang_cp_hicache.kernels import debug_enabled
from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.policy_0518.node_state import set_host_state
from sglang_cp_hicache.policy_0518.plan import HiCacheWriteFailure, PageOwners, check_pages, page_owners
from sglang_cp_hicache.sglang_0518.counters import CpHiCacheCounters
from sglang_cp_hicache.sglang_0518.host_tier import HostTier
from sglang_cp_hicache.sglang_0518.step_status import StepStatus, Vote
from sglang_cp_hicache.sglang_0518.transfer_adapter import CpTransferAdapter, PendingWrite, WriteState

logger = logging.getLogger(__name__)

__all__ = ["EMPTY_PAGES", "InflightWrite", "PageMirror", "WriteThrough"]

#: The CPU page mirror of a node without device pages (the root).
EMPTY_PAGES = torch.empty((0,), dtype=torch.int64)


@dataclass
class InflightWrite:
    """A write whose ack has not been consumed yet (one ack per write)."""

    seq: int
    pending: PendingWrite
    need: list[int]  # ledger charge, tokens per rank


class PageMirror:
    """The CPU mirror of a node's device pages, as inserts hand it in."""

    def __init__(self, page_size: int, counters: CpHiCacheCounters) -> None:
        self.page_size = page_size
        self.counters = counters
        self._warned_device_read = False

    def pages_for(self, value: torch.Tensor, value_pages: Optional[torch.Tensor]) -> torch.Tensor:
        """The CPU mirror of ``value`` (logical pages of its whole pages)."""
        P = self.page_size
        num_pages = len(value) // P
        if value_pages is None:
            self.counters.device_page_reads += 1
            if not self._warned_device_read:
                self._warned_device_read = True
                logger.warning(
                    "sglang-cp-hicache: insert without CpInsertParams.value_pages: reading the node's "
                    "locs back from the device (one sync per insert); pass the allocator's CPU "
                    "page mirror to keep the write path sync-free"
                )
            return value[: num_pages * P : P].to("cpu", torch.int64) // P
        self.counters.device_page_reads_avoided += 1
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

    @staticmethod
    def prefix_pages(node: TreeNode, root: TreeNode) -> torch.Tensor:
        """CPU mirror of the device locs from ``root`` down to ``node``
        (every node on the path must be on the device)."""
        chunks = []
        while node is not root:
            if node.evicted:
                raise ValueError(f"node {node.id} is evicted: no device pages to mirror")
            chunks.append(node.cp_pages)
            node = node.parent
        chunks.reverse()
        return torch.cat(chunks) if chunks else EMPTY_PAGES


@dataclass(eq=False, repr=False)  # identity, not contents; the tree is too big to print
class WriteThrough:
    """``write_backup`` of one CP cache and its writes in flight.

    ``tree``: the SGLang cache (its tree, locks and write-through records
    are read from it, nothing of this library); ``host``: the ledger that
    decides room and the host leaves; ``status``: where a local failure
    waits for the step's all-reduce."""

    tree: Any
    placement: CpPlacement
    transfer: CpTransferAdapter
    host: HostTier
    status: StepStatus
    counters: CpHiCacheCounters
    in_flight: dict[int, InflightWrite] = field(default_factory=dict, init=False)  # by ack id (node id at backup)
    _seq: int = field(default=0, init=False)

    def reset(self) -> None:
        self.in_flight = {}

    # ---- write-through ---------------------------------------------------
    def backup(self, node: TreeNode, write_back: bool = False) -> int:
        """Back up this rank's pages of ``node``, with no collective: the
        ledger decides identically on every rank. A local failure (host
        allocation short, copy raised) leaves the node looking backed up
        here too, so the trees stay identical, and is reported in the step's
        all-reduce, where every rank takes the write back."""
        if write_back:
            raise ValueError("CP HiCache supports write_through policies, not write_back")
        tree, ledger = self.tree, self.host.ledger
        # Backed-up nodes form a prefix from the root (as upstream).
        if node.parent is not tree.root_node and not node.parent.backuped:
            return 0
        # Owners come from the node's CPU page mirror (no read of node.value),
        # once: the ledger's charge and the write plan both use them.
        owners = page_owners(self.placement, node.cp_pages)
        need = owners.tokens_per_rank
        if not ledger.fits(need):
            self.host.evict_for(ledger.shortfall(need))
        if not ledger.fits(need):  # identical on every rank: nothing to tell
            self.counters.write_failures += 1
            return 0
        seq, self._seq = self._seq, self._seq + 1
        pending = self._start(node, owners, seq)
        set_host_state(node, pending.metadata)
        node.host_value = None
        ledger.charge(need)
        tree._track_write_through_node(node, len(node.key))
        self.in_flight[node.id] = InflightWrite(seq, pending, need)
        tree.inc_lock_ref(node)
        self.counters.write_backups += 1
        return len(node.value)

    def _start(self, node: TreeNode, owners: PageOwners, seq: int) -> PendingWrite:
        """Plan and submit the copy of write ``seq``; on a local failure a
        placeholder (no host slots, same ack) stands in for it and the
        failure waits for the step's all-reduce."""
        extra = self.tree._get_extra_pools()
        pending = None
        try:
            pending = self.transfer.plan_write(node.value, owners, node_id=node.id, **extra)
            if isinstance(pending, HiCacheWriteFailure):
                self.status.fail_write(Vote.REFUSED, seq)
                pending = self.transfer.placeholder_write(node.value, owners, node_id=node.id, **extra)
            pending.start()
        except Exception as exc:  # the group hears of it at the step's all-reduce
            self.status.fail_write(Vote.FAILED, seq, exc)
            if pending is not None and pending.state is WriteState.PLANNED:
                pending.abort()
            pending = self.transfer.placeholder_write(node.value, owners, node_id=node.id)
        return pending

    def keep(self, ack_id: int) -> None:
        """The write's ack is being consumed: the node keeps its host slots."""
        record = self.in_flight.pop(ack_id, None)
        if record is not None and record.pending.state is WriteState.STARTED:
            record.pending.keep()

    def first_seq(self) -> Optional[int]:
        """Sequence number of the oldest write whose ack is not consumed
        (the same on every rank: the same writes, the same acks consumed)."""
        return min((r.seq for r in self.in_flight.values()), default=None)

    # ---- taking writes back ----------------------------------------------------
    def take_back(self, cut: int, first_seq: Optional[int]) -> None:
        """Undo every in-flight write from position ``cut`` on (newest
        first): later writes may be children of it."""
        if first_seq is None:
            return
        doomed = [(a, r) for a, r in self.in_flight.items() if r.seq - first_seq >= cut]
        for ack_id, record in reversed(doomed):
            del self.in_flight[ack_id]
            self._undo(ack_id, record)

    def _undo(self, ack_id: int, record: InflightWrite) -> None:
        """Take one in-flight write back on this rank (before its ack is consumed)."""
        tree = self.tree
        lock_node, _, publish_nodes = tree.ongoing_write_through.pop(ack_id)
        if record.pending.state is WriteState.STARTED:
            record.pending.undo()  # waits for the copy, drops the ack, frees the host slots
        for n in publish_nodes:  # the node, or its pieces if it was split since
            n.write_through_pending_id = None
            n.cp_hicache = None
            n.host_len = 0
            self.host.refresh(n)
        self.host.ledger.release(record.need)
        tree.dec_lock_ref(lock_node)
        self.counters.write_backups -= 1
        self.counters.write_takebacks += 1
        self.counters.write_failures += 1
