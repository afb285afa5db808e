"""What one CP rank backs up and restores: the one planning path (policy).

Pure Python + torch, testable with small integers, and never a read of device
memory: page owners come from the CPU mirror of the pages a node holds, the
device locs only ride along to the copy kernels (which mask other ranks'
pages and translate owned ones to physical slots themselves).

* :func:`plan_write` -- one node: the positions this rank owns, their host
  slots, every position's owner -> a :class:`CpWritePlan` (or a
  :class:`HiCacheWriteFailure` with nothing allocated).
* :func:`plan_load` -- a chain of backed-up nodes: an owner-preserving
  allocation (page ``i`` gets the owner it had at backup, so every rank's
  host pages land on pages it owns again) -> a :class:`CpLoadPlan`.

A zero-owned rank still gets a plan (with no host slots): it queues an empty
operation, so every rank consumes the same acks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence, Union

import torch

from sglang_cp_hicache.placement import CpPlacement, page_owner
from sglang_cp_hicache.policy_0518.allocator import PageAllocation
from sglang_cp_hicache.policy_0518.metadata import CpHiCacheNodeMetadata
from sglang_cp_hicache.validation import check_1d_int_tensor, check_int, check_int_tensor

__all__ = [
    "CpLoadPlan", "CpWritePlan", "HiCacheWriteFailure", "PageOwners", "check_pages", "page_owner_tokens", "page_owners",
    "page_owners_of", "plan_load", "placeholder_write_plan", "plan_write",
]

_EMPTY = torch.empty((0,), dtype=torch.int64)


@dataclass(frozen=True)
class CpWritePlan:
    """This rank's backup of one node.

    ``device_locs`` are the node's full LOGICAL locs, where SGLang keeps them
    (the device); ``host_locs`` the host slots of the tokens this rank owns,
    in order (``metadata.host_indices``); every position's owner is in
    ``metadata.token_owners``.
    """

    metadata: CpHiCacheNodeMetadata
    device_locs: torch.Tensor

    @property
    def host_locs(self) -> torch.Tensor:
        return self.metadata.host_indices

    @property
    def num_host_slots(self) -> int:
        return self.metadata.num_host_slots


@dataclass(frozen=True)
class HiCacheWriteFailure:
    """The host pool could not give this rank ``required_host_slots`` slots;
    nothing was allocated."""

    required_host_slots: int


@dataclass(frozen=True)
class CpLoadPlan:
    """This rank's restore of a node chain.

    ``allocation`` holds the new logical pages (device locs + CPU mirror),
    page ``i`` with the owner ``page_owners[i]`` it had at backup;
    ``host_locs`` this rank's host slots in chain order (empty when it owns
    nothing in the chain).
    """

    allocation: PageAllocation
    page_owners: torch.Tensor
    host_locs: torch.Tensor

    @property
    def device_locs(self) -> torch.Tensor:
        return self.allocation.locs


class OwnerPreservingAllocator(Protocol):
    def alloc_with_owners_mirrored(self, owners: Sequence[int]) -> Optional[PageAllocation]: ...


def check_pages(pages: object) -> torch.Tensor:
    """A node's logical pages: the CPU mirror, 1-D, non-negative, no page
    twice (a page listed twice could never be restored to both places)."""
    pages = check_1d_int_tensor("pages", pages)
    if pages.device.type != "cpu":
        raise ValueError(f"pages must be a CPU tensor (the host mirror of the node's pages), got {pages.device}")
    pages = pages.to(torch.int64)
    if pages.numel():
        if int(pages.min()) < 0:
            raise ValueError("pages must be non-negative")
        if torch.unique(pages).numel() != pages.numel():
            raise ValueError("pages lists a page more than once")
    return pages


@dataclass(frozen=True)
class PageOwners:
    """The owner of every page of one node, computed once per write from its
    CPU page mirror: the ledger's charge and the write plan both read it."""

    pages: torch.Tensor  # the node's logical pages (the trusted CPU mirror)
    owners: list[int]  # owners[i] owns pages[i]
    tokens_per_rank: list[int]  # tokens each rank owns: the ledger's charge


def page_owners(placement: CpPlacement, pages: torch.Tensor) -> PageOwners:
    """Owners of a node whose (trusted, CPU) pages are ``pages``. Plain
    Python: nodes are a handful of pages and this runs once per write."""
    P, N = placement.page_size, placement.cp_size
    owners = [page_owner(page, N) for page in pages.tolist()]
    counts = [0] * N
    for owner in owners:
        counts[owner] += P
    return PageOwners(pages, owners, counts)


def page_owner_tokens(placement: CpPlacement, pages: torch.Tensor) -> list[int]:
    """Tokens each rank owns in a node whose (trusted, CPU) pages are ``pages``."""
    return page_owners(placement, pages).tokens_per_rank


def plan_write(
    placement: CpPlacement,
    pages: torch.Tensor,
    device_locs: torch.Tensor,
    host_alloc: Callable[[int], Optional[torch.Tensor]],
    host_free: Optional[Callable[[torch.Tensor], object]] = None,
    *,
    trusted: bool = False,
    owners: Optional[PageOwners] = None,
) -> Union[CpWritePlan, HiCacheWriteFailure]:
    """Plan this rank's backup of one node of whole pages.

    ``pages``: the node's logical pages, from the CPU mirror (owner of page
    ``p`` is ``page_owner(p, cp_size)``); ``device_locs``: the node's logical locs (any
    device, never read: only its length is checked). Host slots come from
    ``host_alloc`` only when this rank owns a page; a short host pool returns
    :class:`HiCacheWriteFailure` with nothing taken, and slots of a
    wrong-sized allocation go back through ``host_free`` before the error.
    ``trusted``: ``pages`` is a mirror the caller already validated (the
    cache's own), so the page checks are skipped on this hot path.
    ``owners``: :func:`page_owners` of ``pages``, when the caller already
    has them (the write-through charged its ledger from them).
    """
    if not trusted:
        pages = check_pages(pages)
    check_1d_int_tensor("device_locs", device_locs)
    P, N, rank = placement.page_size, placement.cp_size, placement.cp_rank
    page_list = pages.tolist()
    if device_locs.numel() != len(page_list) * P:
        raise ValueError(
            f"device_locs has {device_locs.numel()} entries but pages lists "
            f"{len(page_list)} pages of page_size={P}"
        )
    owner_list = owners.owners if owners is not None else [page_owner(page, N) for page in page_list]
    owned = [i for i, owner in enumerate(owner_list) if owner == rank]
    num_owned = len(owned) * P
    host_locs = _EMPTY
    if num_owned:
        got = host_alloc(num_owned)
        if got is None:
            return HiCacheWriteFailure(required_host_slots=num_owned)
        host_locs = check_int_tensor("host_alloc result", got).to("cpu", torch.int64).reshape(-1)
        if host_locs.numel() != num_owned:
            if host_free is not None:
                host_free(got)
            raise RuntimeError(
                f"host allocator returned {host_locs.numel()} slots for {num_owned} owned tokens"
            )
        owned_positions = (torch.tensor(owned, dtype=torch.int64)[:, None] * P + torch.arange(P)).reshape(-1)
    else:
        owned_positions = _EMPTY
    token_owners = torch.tensor(owner_list, dtype=torch.int64).repeat_interleave(P)
    metadata = CpHiCacheNodeMetadata._trusted(len(page_list) * P, owned_positions, host_locs, token_owners)
    return CpWritePlan(metadata=metadata, device_locs=device_locs)


def placeholder_write_plan(
    placement: CpPlacement, pages: torch.Tensor, device_locs: torch.Tensor, owners: Optional[PageOwners] = None
) -> CpWritePlan:
    """The plan of a write this rank could not take host slots for: every
    owner recorded, no slots. It keeps the node (and the ledger) as on every
    other rank until the step's all-reduce takes the write back everywhere.
    ``owners``: :func:`page_owners` of ``pages``, when the caller has them."""
    pages = check_pages(pages)
    if owners is not None:
        page_owner_ids = torch.tensor(owners.owners, dtype=torch.int64)
    else:
        page_owner_ids = page_owner(pages, placement.cp_size)
    metadata = CpHiCacheNodeMetadata._trusted(
        int(device_locs.numel()), _EMPTY, _EMPTY, page_owner_ids.repeat_interleave(placement.page_size)
    )
    return CpWritePlan(metadata=metadata, device_locs=device_locs)


def page_owners_of(metadata: Sequence[CpHiCacheNodeMetadata], page_size: int) -> list[int]:
    """Owner of every page of a node chain, as recorded at backup time."""
    check_int("page_size", page_size, 1)
    owners: list[int] = []
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


def plan_load(
    placement: CpPlacement,
    metadata: Sequence[CpHiCacheNodeMetadata],
    device_allocator: OwnerPreservingAllocator,
) -> Optional[CpLoadPlan]:
    """Owner-preserving allocation for a node chain + this rank's host slots.

    None (nothing allocated) when the allocator cannot satisfy every owner
    lane; the allocator is identical on every rank, so all ranks agree.
    """
    owners = page_owners_of(metadata, placement.page_size)
    allocation = device_allocator.alloc_with_owners_mirrored(owners)
    if allocation is None:
        return None
    chunks = [m.host_indices for m in metadata if m.num_host_slots > 0]
    host_locs = torch.cat(chunks) if chunks else _EMPTY
    return CpLoadPlan(
        allocation=allocation,
        page_owners=torch.tensor(owners, dtype=torch.int64),
        host_locs=host_locs,
    )
