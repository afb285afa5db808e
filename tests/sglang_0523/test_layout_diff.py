"""This library's layout vs SGLang 0.5.23's page-interleave placement.

Upstream: ``PageInterleavePlacement`` (owner, local row), the host pool's
``owned_rows`` (CPU mask + device gather), the owner-classed allocator's
rotation (``alloc_cyclic``, ``_class_counts``). Library: ``CpPlacement``
and the host-row narrowing of ``LibraryCopyController``. Every loc of several
logical groups (and a partial one), for N in {1, 2, 3, 4, 8}.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator
from sglang.srt.mem_cache.page_interleave import PageInterleavePlacement, PageShardSpec
from sglang.srt.mem_cache.pool_host.page_interleave import PageInterleaveHostPool

from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.sglang_0523.controller import LibraryCopyController

P = 64
SIZES = [1, 2, 3, 4, 8]


def _placement(rank: int, size: int) -> PageInterleavePlacement:
    spec = PageShardSpec(shard_rank=rank, shard_size=size, page_size=P, max_prefix_tokens=size * P, chunk_tokens=P)
    return PageInterleavePlacement(spec)


def _locs(size: int) -> torch.Tensor:
    every = torch.arange(0, size * P * 7 + 5, dtype=torch.int64)  # 7 groups and a partial one
    far = torch.tensor([2**31 - 1, 2**40 + 12345, 10**12], dtype=torch.int64)
    return torch.cat([every, far])


@pytest.mark.parametrize("size", SIZES)
def test_owner_and_physical_row_of_every_loc(size):
    locs = _locs(size)
    for rank in range(size):
        placement, ours = _placement(rank, size), CpPlacement(P, size, rank)
        assert torch.equal(placement.owner_of(locs), ours.owner_of(locs))
        assert torch.equal(placement.local_mask(locs, rank), ours.owned_by_this_rank(locs))
        assert torch.equal(placement.local_index(locs), ours.logical_locs_to_physical(locs))
        owned = locs[ours.owned_by_this_rank(locs)]
        assert torch.equal(placement.filter_local(locs, rank), ours.logical_locs_to_physical(owned))
        # the library's inverse undoes upstream's translation on owned locs
        assert torch.equal(ours.physical_locs_to_logical(placement.local_index(owned)), owned)


@pytest.mark.parametrize("size", SIZES)
def test_every_physical_row_has_exactly_one_logical_loc(size):
    locs = torch.arange(0, size * P * 6, dtype=torch.int64)
    rows = torch.stack([_placement(0, size).local_index(locs), _placement(0, size).owner_of(locs)], dim=1)
    assert torch.unique(rows, dim=0).shape[0] == locs.numel()  # a bijection onto (row, owner)


def _owner_matched_pairs(size: int, pages: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Host slots and device locs of one chain: page i of both owned by (base + i) % size."""
    g = torch.Generator().manual_seed(seed)
    base = int(torch.randint(size, (1,), generator=g))
    owners = (base + torch.arange(pages)) % size
    host_q = torch.randperm(4 * pages, generator=g)[:pages]
    dev_q = torch.randperm(4 * pages, generator=g)[:pages]
    offsets = torch.arange(P)
    host = ((host_q * size + owners) * P).view(-1, 1) + offsets
    dev = ((dev_q * size + owners) * P).view(-1, 1) + offsets
    return host.reshape(-1), dev.reshape(-1)


@pytest.mark.parametrize("size", SIZES)
def test_owned_rows_equals_the_library_narrowing(size):
    for seed in range(3):
        host, dev = _owner_matched_pairs(size, pages=11, seed=seed)
        for rank in range(size):
            placement, ours = _placement(rank, size), CpPlacement(P, size, rank)
            up_host, up_dev = PageInterleaveHostPool.owned_rows(
                SimpleNamespace(placement=placement, shard_rank=rank), host, dev
            )
            anchor = SimpleNamespace(placement=placement, shard_rank=rank)
            controller = SimpleNamespace(
                mem_pool_host=SimpleNamespace(anchor_entry=SimpleNamespace(host_pool=anchor)), device="cpu"
            )
            lib_host = LibraryCopyController._owned_host_rows(controller, host)
            # The kernel's own device side: mask the logical locs, translate the owned.
            lib_dev = ours.logical_locs_to_physical(dev[ours.owned_by_this_rank(dev)])
            assert torch.equal(lib_host, up_host), (size, rank, seed)
            assert torch.equal(lib_dev, up_dev), (size, rank, seed)


@pytest.mark.parametrize("size", [s for s in SIZES if s > 1])
def test_allocator_rotation_matches_layout_owners(size):
    for start in range(size):
        slots = PageInterleavePoolAllocator(
            size=12 * P, physical_page_size=P, shard_size=size, dtype=torch.int64, device="cpu",
            kvcache=None, need_sort=False,
        )
        pages = 2 * size + 1
        locs = slots.alloc_cyclic(start_class=start, need_size=pages * P)
        assert locs is not None
        owners = CpPlacement(P, size, 0).owner_of(locs[::P])
        assert owners.tolist() == [(start + i) % size for i in range(pages)]
        counts = PageInterleavePoolAllocator._class_counts(start, pages, size)
        assert counts == [int((owners == r).sum()) for r in range(size)]


@pytest.mark.parametrize("size", [s for s in SIZES if s > 1])
def test_class_counts_equal_library_owned_pages(size):
    for num_pages in range(0, 3 * size + 2):
        counts = PageInterleavePoolAllocator._class_counts(0, num_pages, size)
        assert counts == [CpPlacement(P, size, r).owned_pages(num_pages) for r in range(size)]
