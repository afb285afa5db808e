"""CP writes and loads on top of SGLang 0.5.18's ``HybridCacheController``.

The one place that edits SGLang's queues. A plan from
:mod:`sglang_cp_hicache.policy_0518.plan` becomes an ordinary ``CacheOperation`` whose
``device_indices`` are the node's LOGICAL locs (they stay on the device, never
read on the host) and whose ``host_indices`` are this rank's host slots of the
owned tokens. SGLang's controller then submits the copies on its own streams
(per-layer loads keep its ``layer_done_counter``), and the CP host pools (see
:mod:`.host_copies`) run them through this library's kernels, which mask
other ranks' pages and translate owned ones to physical slots on the device.
The indexer rides the KV indices (``indices_from_pool=KV``), so it is backed
up and restored with the KV.

A rank owning nothing in a node still queues an (empty) operation: it gets
the same ack as every other rank, and SGLang's MIN all-reduce over ready acks
stays in step on every rank.

A write can be taken back at every step through its handle,
:class:`PendingWrite` (``start`` / ``abort`` / ``undo``). A load is queued
only once its owner-preserving allocation succeeded (a failed one is rolled
back inside :meth:`CpTransferAdapter.queue_load`); after that the cache
takes load-backs back as a whole at the step's all-reduce (it drains the
load acks, drops the loads queued but not started, and evicts the restored
nodes again).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from sglang.srt.managers.cache_controller import CacheOperation

from sglang_cp_hicache.policy_0518.allocator import AllocatorCheckpoint
from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.policy_0518.metadata import CpHiCacheNodeMetadata
from sglang_cp_hicache.policy_0518.plan import (
    CpLoadPlan,
    CpWritePlan,
    HiCacheWriteFailure,
    PageOwners,
    placeholder_write_plan,
    plan_load,
    plan_write,
)

__all__ = ["CpTransferAdapter", "CpTransferStats", "PendingLoad", "PendingWrite", "StartedLoads", "WriteState"]


@dataclass
class CpTransferStats:
    writes: int = 0
    zero_owned_writes: int = 0
    loads: int = 0
    zero_owned_loads: int = 0
    backup_slots: int = 0  # physical host slots written by this rank
    load_slots: int = 0  # physical slots restored by this rank


class WriteState(enum.Enum):
    PLANNED = "planned"  # host slots held, nothing queued
    STARTED = "started"  # copy submitted, its ack in SGLang's ack queue
    CLOSED = "closed"  # kept, aborted or undone: nothing left to do


def _to_copy_engine(host_locs: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host slots as SGLang hands them to the copy: pinned on CUDA machines,
    so the controller's ``non_blocking`` H2D copy of the indices never blocks."""
    if device.type == "cuda" and host_locs.numel() and not host_locs.is_pinned():
        return host_locs.pin_memory()
    return host_locs


@dataclass(eq=False)
class PendingWrite:
    """One node's backup on this rank, from planned to kept or taken back."""

    adapter: "CpTransferAdapter"
    plan: CpWritePlan
    op: CacheOperation
    state: WriteState = WriteState.PLANNED

    @property
    def metadata(self) -> CpHiCacheNodeMetadata:
        return self.plan.metadata

    def start(self) -> None:
        """Queue and submit the copy. On an exception nothing stays queued
        and no ack is left behind; the host slots are still held (abort)."""
        if self.state is not WriteState.PLANNED:
            raise RuntimeError(f"cannot start a CP write in state {self.state.value}")
        ctrl = self.adapter.controller
        acks_before = len(ctrl.ack_write_queue)
        ctrl.write_queue.append(self.op)
        try:
            ctrl.start_writing()
        except BaseException:
            if self.op in ctrl.write_queue:
                ctrl.write_queue.remove(self.op)
            del ctrl.ack_write_queue[acks_before:]
            raise
        self.state = WriteState.STARTED
        self.adapter._count_write(self.plan, +1)

    def abort(self) -> None:
        """Release a planned write that never started (or failed to)."""
        if self.state is not WriteState.PLANNED:
            raise RuntimeError(f"cannot abort a CP write in state {self.state.value}: use undo")
        self.state = WriteState.CLOSED
        if self.op.host_indices.numel():
            self.adapter.controller.mem_pool_host.free(self.op.host_indices)

    def undo(self) -> None:
        """Take back a started write the group refused: wait for its copy,
        drop its ack, free its host slots."""
        if self.state is not WriteState.STARTED:
            raise RuntimeError(f"cannot undo a CP write in state {self.state.value}")
        self.state = WriteState.CLOSED
        ctrl = self.adapter.controller
        node_id = self.op.node_ids[0]
        for i in range(len(ctrl.ack_write_queue) - 1, -1, -1):
            ack = ctrl.ack_write_queue[i]
            if node_id in ack.node_ids:
                ack.finish_event.synchronize()  # the slots are busy until the copy ends
                del ctrl.ack_write_queue[i]
                break
        if self.op.host_indices.numel():
            ctrl.mem_pool_host.free(self.op.host_indices)
        self.adapter._count_write(self.plan, -1)

    def keep(self) -> None:
        """The group agreed: the node now owns the host slots."""
        if self.state is not WriteState.STARTED:
            raise RuntimeError(f"cannot keep a CP write in state {self.state.value}")
        self.state = WriteState.CLOSED


@dataclass(eq=False)
class PendingLoad:
    """One restore of a node chain whose pages are taken: its copy queued
    (``op``), or -- when preparing the copy raised on this rank -- nothing
    queued and the ``error`` kept for the step's all-reduce."""

    adapter: "CpTransferAdapter"
    plan: CpLoadPlan
    op: Optional[CacheOperation]
    checkpoint: AllocatorCheckpoint
    error: Optional[BaseException] = None
    closed: bool = False

    def keep(self) -> None:
        """The allocation stays (closes the allocator's undo log)."""
        if self.closed:
            raise RuntimeError("CP load already kept")
        self.closed = True
        self.adapter.allocator.commit(self.checkpoint)


@dataclass(frozen=True)
class StartedLoads:
    """The outcome of submitting every queued load of a batch: SGLang's
    producer id, or the error (the cache reports it at the step's
    all-reduce, which takes every unconsumed load-back back)."""

    producer_id: int
    error: Optional[BaseException]


class CpTransferAdapter:
    def __init__(self, controller, placement: CpPlacement, allocator) -> None:
        self.controller = controller
        self.placement = placement
        self.allocator = allocator
        self.stats = CpTransferStats()
        self._device = torch.device(getattr(allocator, "device", "cpu"))

    def _count_write(self, plan: CpWritePlan, sign: int) -> None:
        self.stats.writes += sign
        self.stats.zero_owned_writes += sign * int(plan.num_host_slots == 0)
        self.stats.backup_slots += sign * plan.num_host_slots

    def _count_load(self, plan: CpLoadPlan, sign: int) -> None:
        n = int(plan.host_locs.numel())
        self.stats.loads += sign
        self.stats.zero_owned_loads += sign * int(n == 0)
        self.stats.load_slots += sign * n

    # ---- writes ------------------------------------------------------------
    def plan_write(
        self,
        device_locs: torch.Tensor,
        owners: PageOwners,
        node_id: int = -1,
        priority: Optional[int] = None,
        extra_pools=None,
    ) -> Union[PendingWrite, HiCacheWriteFailure]:
        """Take host slots for this rank's pages of one node (``owners``: the
        node's logical pages on the CPU -- the cache's own mirror, validated
        when it was handed in -- and their owners; ``device_locs``: its
        logical locs, never read). Nothing is queued until :meth:`PendingWrite.start`."""
        ctrl = self.controller
        host_pool = ctrl.mem_pool_host
        plan = plan_write(
            self.placement, owners.pages, device_locs, host_pool.alloc, host_pool.free, trusted=True, owners=owners
        )
        if isinstance(plan, HiCacheWriteFailure):
            return plan
        try:
            host = _to_copy_engine(plan.host_locs, self._device)
            pool_transfers = ctrl._resolve_pool_transfers_allocation(
                extra_pools, alloc_host=True, kv_device_indices=device_locs, kv_host_indices=host
            )
            if pool_transfers is None and extra_pools:
                self._free_host(plan)
                return HiCacheWriteFailure(required_host_slots=plan.num_host_slots)
            op = CacheOperation(host, device_locs, node_id, priority, pool_transfers=pool_transfers or None)
        except BaseException:
            # No handle exists yet to free the slots later: free them now, or
            # this rank's pool stays short of what the ledger says it has.
            self._free_host(plan)
            raise
        return PendingWrite(self, plan, op)

    def _free_host(self, plan: CpWritePlan) -> None:
        if plan.host_locs.numel():
            self.controller.mem_pool_host.free(plan.host_locs)

    def placeholder_write(
        self, device_locs: torch.Tensor, owners: PageOwners, node_id: int = -1, extra_pools=None
    ) -> PendingWrite:
        """A write with no host slots for a node this rank could not back up:
        its (empty) operation still gets an ack like every other rank's, so
        the ack queues stay aligned until the group takes the write back."""
        plan = placeholder_write_plan(self.placement, owners.pages, device_locs, owners)
        op = CacheOperation(plan.host_locs, device_locs, node_id, None, pool_transfers=None)
        return PendingWrite(self, plan, op)

    # ---- loads -------------------------------------------------------------
    def queue_load(
        self,
        metadata: Sequence[CpHiCacheNodeMetadata],
        node_id: int = -1,
        priority: Optional[int] = None,
        extra_pools=None,
    ) -> Optional[PendingLoad]:
        """Owner-preserving allocation for a node chain; queues this rank's
        pages (an empty op if none). None, with nothing changed, when the
        device allocator cannot give every owner lane its pages (and the
        allocator's own error, with nothing changed, when it raised). Once
        the pages are taken they stay: if preparing the copy raises, the load
        comes back with ``error`` set and nothing queued, so this rank's
        allocator stays that of every other rank and only the copy is missing."""
        checkpoint = self.allocator.checkpoint()
        try:
            plan = plan_load(self.placement, metadata, self.allocator)
        except BaseException:
            self.allocator.rollback(checkpoint)
            raise
        if plan is None:
            self.allocator.rollback(checkpoint)
            return None
        try:
            op = self._load_operation(plan, node_id, priority, extra_pools)
        except Exception as exc:  # reported to every rank at the step's all-reduce
            self._count_load(plan, +1)
            return PendingLoad(self, plan, None, checkpoint, error=exc)
        if op is None:
            self.allocator.rollback(checkpoint)
            return None
        self.controller.load_queue.append(op)
        self._count_load(plan, +1)
        return PendingLoad(self, plan, op, checkpoint)

    def _load_operation(self, plan: CpLoadPlan, node_id: int, priority: Optional[int], extra_pools):
        """The copy of one planned restore, or None when an extra pool has no room."""
        host = _to_copy_engine(plan.host_locs, self._device)
        pool_transfers = self.controller._resolve_pool_transfers_allocation(
            extra_pools, alloc_host=False, kv_device_indices=plan.device_locs, kv_host_indices=host
        )
        if pool_transfers is None and extra_pools:
            return None
        return CacheOperation(host, plan.device_locs, node_id, priority, pool_transfers=pool_transfers or None)

    def take_back_loads(self, loads: Sequence[PendingLoad]) -> None:
        """Forget loads the step took back: drops every load queued but not
        started (all of them are taken back together) and their counts."""
        self.controller.load_queue.clear()
        for load in loads:
            self._count_load(load.plan, -1)

    def start_loading(self) -> StartedLoads:
        """Submit every queued load. Never raises: a failure is returned in
        ``error`` (with the queue cleared) so the caller can tell the group
        before it raises."""
        ctrl = self.controller
        try:
            producer = ctrl.start_loading()
        except Exception as exc:  # reported to every rank by the caller
            ctrl.load_queue.clear()
            return StartedLoads(-1, exc)
        return StartedLoads(producer, None)
