"""CP write/load mapping (policy) and a framework-neutral controller.

Policy, pure and testable with small integers:

* :func:`map_cp_write` -- which positions of a node this rank backs up, how
  many host slots that takes, the pending transfer.
* :func:`map_cp_load` -- an owner-preserving allocation for a chain of
  nodes and the pending transfer of this rank's pages.

Mechanism (the copy itself) is injected: :class:`CpHiCacheController` calls
``transfer(op)``; the SGLang adapter hands the same ops to the kernels.
Zero-owned writes and loads still produce a completed ack, so every rank
consumes the same number of acks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence, Union

import torch

from sglang_cp_hicache.layout import CpSharedKVLayout
from sglang_cp_hicache.metadata import CpHiCacheNodeMetadata

__all__ = [
    "CpAck",
    "CpHiCacheController",
    "CpLoadOp",
    "CpLoadPlan",
    "CpWriteOp",
    "HiCacheWriteFailure",
    "HiCacheWriteResult",
    "map_cp_load",
    "map_cp_write",
    "page_owners_of",
]


@dataclass
class HiCacheWriteResult:
    metadata: CpHiCacheNodeMetadata
    required_host_slots: int = 0


@dataclass
class HiCacheWriteFailure:
    required_host_slots: int
    metadata: None = None


@dataclass
class CpWriteOp:
    """D2H backup of one node: ``device_locs`` are the node's full logical
    locs (the copy skips pages of other ranks); ``host_locs`` the owned ones'
    host slots."""

    node_id: int
    device_locs: torch.Tensor
    host_locs: torch.Tensor


@dataclass
class CpLoadOp:
    """H2D restore of a node chain into freshly allocated logical locs."""

    node_id: int
    device_locs: torch.Tensor
    host_locs: torch.Tensor


@dataclass
class CpAck:
    node_ids: list[int]
    no_op: bool  # True when this rank moved nothing (zero-owned)


@dataclass
class CpLoadPlan:
    device_locs: torch.Tensor  # full logical locs, node chain concatenated
    op: Optional[CpLoadOp]  # None when this rank owns nothing in the chain


class HostAllocator(Protocol):
    def alloc(self, need_size: int) -> Optional[torch.Tensor]: ...
    def free(self, indices: torch.Tensor) -> object: ...


class OwnerPreservingAllocator(Protocol):
    page_size: int

    def alloc_pages_with_owners(self, owners: Sequence[int]) -> Optional[torch.Tensor]: ...


def _check_locs(name: str, locs: torch.Tensor) -> torch.Tensor:
    if not isinstance(locs, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(locs).__name__}")
    if locs.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int32/int64 tensor, got {locs.dtype}")
    if locs.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(locs.shape)}")
    return locs


def map_cp_write(
    layout: CpSharedKVLayout,
    logical_locs: torch.Tensor,
    host_alloc: Callable[[int], Optional[torch.Tensor]],
    node_id: int = -1,
) -> tuple[Union[HiCacheWriteResult, HiCacheWriteFailure], Optional[CpWriteOp]]:
    """Metadata + pending op for backing up ``logical_locs`` on this rank.

    Returns (failure, None) with nothing allocated when the host pool is
    short, and (result, None) for a zero-owned node (no host slots).
    """
    _check_locs("logical_locs", logical_locs)
    locs_cpu = logical_locs.to("cpu", torch.int64)
    if locs_cpu.numel() and int(locs_cpu.min()) < 0:
        raise ValueError("logical_locs must be non-negative")
    owners = layout.owner_of(locs_cpu)
    owned_positions = torch.nonzero(owners == layout.cp_rank).reshape(-1)
    num_owned = int(owned_positions.numel())
    host_locs: Optional[torch.Tensor] = None
    if num_owned > 0:
        host_locs = host_alloc(num_owned)
        if host_locs is None:
            return HiCacheWriteFailure(required_host_slots=num_owned), None
        if host_locs.numel() != num_owned:
            raise RuntimeError(f"host allocator returned {host_locs.numel()} slots for {num_owned}")
    metadata = CpHiCacheNodeMetadata._trusted(
        int(locs_cpu.numel()),
        owned_positions,
        host_locs.to("cpu", torch.int64) if host_locs is not None else torch.empty((0,), dtype=torch.int64),
        owners,
    )
    op = None
    if host_locs is not None:
        op = CpWriteOp(node_id=node_id, device_locs=logical_locs, host_locs=host_locs)
    return HiCacheWriteResult(metadata=metadata), op


def page_owners_of(metadata: Sequence[CpHiCacheNodeMetadata], page_size: int) -> list[int]:
    """Owner of every page of a node chain, as recorded at backup time."""
    owners: list[int] = []
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    for meta in metadata:
        if not isinstance(meta, CpHiCacheNodeMetadata):
            raise TypeError(f"metadata must hold CpHiCacheNodeMetadata, got {type(meta).__name__}")
        if meta.token_owners is None:
            raise ValueError("page_owners_of needs metadata with token_owners")
        if meta.logical_len % page_size != 0:
            raise ValueError(
                f"node logical_len {meta.logical_len} is not a multiple of page_size {page_size}"
            )
        owners.extend(meta.token_owners[::page_size].tolist())
    return owners


def map_cp_load(
    layout: CpSharedKVLayout,
    metadata: Sequence[CpHiCacheNodeMetadata],
    device_allocator: OwnerPreservingAllocator,
    node_id: int = -1,
) -> Optional[CpLoadPlan]:
    """Owner-preserving allocation for a node chain + this rank's pending load.

    Page i of the new allocation gets the owner page i had at backup, so the
    pages this rank backed up land on pages it owns again. None (nothing
    allocated) when the allocator cannot satisfy every owner lane.
    """
    owners = page_owners_of(metadata, layout.page_size)
    device_locs = device_allocator.alloc_pages_with_owners(owners)
    if device_locs is None:
        return None
    host_chunks = [m.host_indices for m in metadata if m.num_host_slots > 0]
    if not host_chunks:
        return CpLoadPlan(device_locs=device_locs, op=None)
    host_locs = torch.cat(host_chunks)
    return CpLoadPlan(
        device_locs=device_locs,
        op=CpLoadOp(node_id=node_id, device_locs=device_locs, host_locs=host_locs),
    )


@dataclass
class CpHiCacheController:
    """Queues and acks for CP writes and loads, with an injected transfer.

    ``transfer_write(op)`` / ``transfer_load(op)`` perform the copies (the
    kernels issue provides them; tests pass recorders).
    """

    layout: CpSharedKVLayout
    host_pool: HostAllocator
    device_allocator: OwnerPreservingAllocator
    transfer_write: Callable[[CpWriteOp], None]
    transfer_load: Callable[[CpLoadOp], None]
    write_queue: deque = field(default_factory=deque)
    load_queue: deque = field(default_factory=deque)
    ack_write_queue: deque = field(default_factory=deque)
    ack_load_queue: deque = field(default_factory=deque)

    def write(
        self, device_indices: torch.Tensor, node_id: int = -1
    ) -> Union[HiCacheWriteResult, HiCacheWriteFailure]:
        result, op = map_cp_write(self.layout, device_indices, self.host_pool.alloc, node_id)
        if isinstance(result, HiCacheWriteFailure):
            return result
        if op is None:
            self.ack_write_queue.append(CpAck([node_id], no_op=True))
        else:
            self.write_queue.append(op)
        return result

    def start_writing(self) -> None:
        while self.write_queue:
            op = self.write_queue[0]
            self.transfer_write(op)  # on error the op stays queued: nothing acked
            self.write_queue.popleft()
            self.ack_write_queue.append(CpAck([op.node_id], no_op=False))

    def load(
        self, metadata: Sequence[CpHiCacheNodeMetadata], node_id: int = -1
    ) -> Optional[torch.Tensor]:
        plan = map_cp_load(self.layout, metadata, self.device_allocator, node_id)
        if plan is None:
            return None
        if plan.op is None:
            self.ack_load_queue.append(CpAck([node_id], no_op=True))
        else:
            self.load_queue.append(plan.op)
        return plan.device_locs

    def start_loading(self) -> None:
        while self.load_queue:
            op = self.load_queue[0]
            self.transfer_load(op)
            self.load_queue.popleft()
            self.ack_load_queue.append(CpAck([op.node_id], no_op=False))
