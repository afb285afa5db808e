"""CP writes and loads on top of SGLang 0.5.18's ``HybridCacheController``.

SGLang's host pools stay unaware of the layout: this adapter maps a node's
logical locs to the owned physical device slots (policy in
``sglang_cp_hicache.controller``) and hands SGLang an ordinary
``CacheOperation`` with physical indices. The indexer rides the KV indices
(``indices_from_pool=KV``), so it is backed up and restored with the KV.

A rank owning nothing in a node still queues an (empty) operation: it gets
the same ack as every other rank, and SGLang's MIN all-reduce over ready acks
stays in step on every rank.

Every step can be taken back (the cache calls these after a group vote):
:meth:`abort_last_write` before the copy starts, :meth:`undo_last_commit`
after it (waits for the copy, drops its ack, frees the host slots), and
:meth:`drop_last_load` for a queued load that has not started.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from sglang.srt.managers.cache_controller import CacheOperation

from sglang_cp_hicache.controller import (
    HiCacheWriteFailure,
    HiCacheWriteResult,
    map_cp_write,
    page_owners_of,
)
from sglang_cp_hicache.layout import CpSharedKVLayout
from sglang_cp_hicache.metadata import CpHiCacheNodeMetadata

__all__ = ["CpTransferAdapter", "CpTransferStats"]

_EMPTY = torch.empty((0,), dtype=torch.int64)


@dataclass
class CpTransferStats:
    writes: int = 0
    zero_owned_writes: int = 0
    loads: int = 0
    zero_owned_loads: int = 0
    backup_slots: int = 0  # physical host slots written by this rank
    load_slots: int = 0  # physical slots restored by this rank


@dataclass
class _PendingWrite:
    op: CacheOperation
    metadata: CpHiCacheNodeMetadata
    committed: bool = False


@dataclass
class _QueuedLoad:
    op: CacheOperation
    logical_locs: torch.Tensor
    allocator_state: object  # the allocator is identical on every rank: undo exactly


class CpTransferAdapter:
    def __init__(self, controller, layout: CpSharedKVLayout, allocator) -> None:
        self.controller = controller
        self.layout = layout
        self.allocator = allocator
        self.stats = CpTransferStats()
        self._write: Optional[_PendingWrite] = None
        self._load: Optional[_QueuedLoad] = None

    def _physical(self, logical_locs_cpu: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.layout.logical_locs_to_physical(logical_locs_cpu[positions])

    # ---- writes ------------------------------------------------------------
    def write(
        self,
        device_indices: torch.Tensor,
        node_id: int = -1,
        priority: Optional[int] = None,
        extra_pools=None,
    ) -> Union[HiCacheWriteResult, HiCacheWriteFailure]:
        """Allocate host slots for this rank's pages of one node; the copy
        starts at :meth:`commit_last_write`."""
        self._write = None
        ctrl = self.controller
        locs_cpu = device_indices.to("cpu", torch.int64)
        host_slots: list[torch.Tensor] = []

        def host_alloc(n: int) -> Optional[torch.Tensor]:
            got = ctrl.mem_pool_host.alloc(n)
            if got is not None:
                host_slots.append(got)
            return got

        result, _ = map_cp_write(self.layout, locs_cpu, host_alloc, node_id)
        if isinstance(result, HiCacheWriteFailure):
            return result
        meta = result.metadata
        physical = self._physical(locs_cpu, meta.owned_positions)
        host = host_slots[0] if host_slots else _EMPTY
        pool_transfers = ctrl._resolve_pool_transfers_allocation(
            extra_pools, alloc_host=True, kv_device_indices=physical, kv_host_indices=host
        )
        if pool_transfers is None and extra_pools:
            if host.numel():
                ctrl.mem_pool_host.free(host)
            return HiCacheWriteFailure(required_host_slots=meta.num_host_slots)
        op = CacheOperation(host, physical, node_id, priority, pool_transfers=pool_transfers or None)
        self._write = _PendingWrite(op, meta)
        return result

    def commit_last_write(self) -> None:
        """Queue and start the prepared copy. On an exception nothing stays
        queued (the host slots are still held; undo or abort frees them)."""
        pending = self._write
        if pending is None or pending.committed:
            raise RuntimeError("no prepared CP write to commit")
        ctrl = self.controller
        acks_before = len(ctrl.ack_write_queue)
        ctrl.write_queue.append(pending.op)
        try:
            ctrl.start_writing()
        except BaseException:
            if pending.op in ctrl.write_queue:
                ctrl.write_queue.remove(pending.op)
            del ctrl.ack_write_queue[acks_before:]
            raise
        pending.committed = True
        self.stats.writes += 1
        self.stats.zero_owned_writes += int(pending.metadata.num_host_slots == 0)
        self.stats.backup_slots += pending.metadata.num_host_slots

    def abort_last_write(self) -> None:
        """Release a prepared write that never started copying (or failed to)."""
        pending, self._write = self._write, None
        if pending is None:
            return
        if pending.committed:
            raise RuntimeError("write already started: use undo_last_commit")
        if pending.op.host_indices.numel():
            self.controller.mem_pool_host.free(pending.op.host_indices)

    def undo_last_commit(self) -> None:
        """Take back a started write the group refused: wait for its copy,
        drop its ack, free its host slots."""
        pending, self._write = self._write, None
        if pending is None or not pending.committed:
            raise RuntimeError("no committed CP write to undo")
        ctrl = self.controller
        for i in range(len(ctrl.ack_write_queue) - 1, -1, -1):
            ack = ctrl.ack_write_queue[i]
            if pending.op.node_ids[0] in ack.node_ids:
                ack.finish_event.synchronize()  # the slots are busy until the copy ends
                del ctrl.ack_write_queue[i]
                break
        if pending.op.host_indices.numel():
            ctrl.mem_pool_host.free(pending.op.host_indices)
        self.stats.writes -= 1
        self.stats.zero_owned_writes -= int(pending.metadata.num_host_slots == 0)
        self.stats.backup_slots -= pending.metadata.num_host_slots

    def forget_last_write(self) -> None:
        self._write = None

    # ---- loads -------------------------------------------------------------
    def load(
        self,
        metadata: Sequence[CpHiCacheNodeMetadata],
        node_id: int = -1,
        priority: Optional[int] = None,
        extra_pools=None,
    ) -> Optional[torch.Tensor]:
        """Owner-preserving allocation for a node chain; queues this rank's
        pages (an empty op if none). Returns the full logical locs or None."""
        self._load = None
        ctrl = self.controller
        owners = page_owners_of(metadata, self.layout.page_size)
        state = self.allocator.backup_state()
        logical = self.allocator.alloc_pages_with_owners(owners)
        if logical is None:
            return None
        locs_cpu = logical.to("cpu", torch.int64)
        positions, offset = [], 0
        for meta in metadata:
            positions.append(meta.owned_positions + offset)
            offset += meta.logical_len
        owned = torch.cat(positions) if positions else _EMPTY
        physical = self._physical(locs_cpu, owned)
        host = torch.cat([m.host_indices for m in metadata]) if metadata else _EMPTY
        pool_transfers = ctrl._resolve_pool_transfers_allocation(
            extra_pools, alloc_host=False, kv_device_indices=physical, kv_host_indices=host
        )
        if pool_transfers is None and extra_pools:
            self.allocator.restore_state(state)
            return None
        op = CacheOperation(host, physical, node_id, priority, pool_transfers=pool_transfers or None)
        ctrl.load_queue.append(op)
        self._load = _QueuedLoad(op, logical, state)
        self.stats.loads += 1
        self.stats.zero_owned_loads += int(host.numel() == 0)
        self.stats.load_slots += int(host.numel())
        return logical

    def drop_last_load(self) -> None:
        """Take back the last queued (not yet started) load: unqueue, and put
        the allocator back exactly as it was (free-list order included), so it
        stays identical to the allocators of ranks that never allocated."""
        queued, self._load = self._load, None
        if queued is None:
            raise RuntimeError("no queued CP load to drop")
        self.controller.load_queue.remove(queued.op)
        self.allocator.restore_state(queued.allocator_state)
        self.stats.loads -= 1
        self.stats.zero_owned_loads -= int(queued.op.host_indices.numel() == 0)
        self.stats.load_slots -= int(queued.op.host_indices.numel())
