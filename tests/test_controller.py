"""Seed Tasks 4 and 7 (write/load mapping), numbers from DESIGN.md's formula,
plus write -> load on N simulated ranks."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sglang_cp_hicache import (
    CpHiCacheController,
    CpHiCacheNodeMetadata,
    CpSharedKVLayout,
    HiCacheWriteFailure,
    HiCacheWriteResult,
    OwnerLaneAllocator,
    map_cp_load,
    map_cp_write,
)


class FakeHostPool:
    """Hands out the next slots of a fixed list; None when short."""

    def __init__(self, slots):
        self.slots = list(slots)
        self.alloc_calls = []
        self.freed = []

    def alloc(self, need_size):
        self.alloc_calls.append(need_size)
        if need_size > len(self.slots):
            return None
        out, self.slots = self.slots[:need_size], self.slots[need_size:]
        return torch.tensor(out, dtype=torch.int64)

    def free(self, idx):
        self.freed.append(idx.tolist())
        self.slots.extend(idx.tolist())
        return len(idx)


def make(rank, host_slots=range(100, 104), alloc=None, P=4, N=4):
    writes, loads = [], []
    ctrl = CpHiCacheController(
        layout=CpSharedKVLayout(P, N, rank),
        host_pool=FakeHostPool(host_slots),
        device_allocator=alloc or OwnerLaneAllocator(P * 32, P, N),
        transfer_write=writes.append,
        transfer_load=loads.append,
    )
    return ctrl, writes, loads


def test_cp_write_filters_to_owned_physical_locs():
    ctrl, writes, _ = make(rank=1)
    logical = torch.arange(4, 20)  # pages 1..4, owners 1,2,3,0
    result = ctrl.write(logical, node_id=7)
    assert isinstance(result, HiCacheWriteResult)
    assert result.metadata.logical_len == 16
    assert result.metadata.owned_positions.tolist() == [0, 1, 2, 3]
    assert result.metadata.host_indices.tolist() == [100, 101, 102, 103]
    assert result.metadata.token_owners.tolist() == [1] * 4 + [2] * 4 + [3] * 4 + [0] * 4
    assert ctrl.host_pool.alloc_calls == [4]
    ctrl.start_writing()
    (op,) = writes
    assert op.node_id == 7 and torch.equal(op.device_locs, logical)
    owned = op.device_locs[ctrl.layout.owned_by_this_rank(op.device_locs)]
    assert ctrl.layout.logical_locs_to_physical(owned).tolist() == [0, 1, 2, 3]
    assert [a.node_ids for a in ctrl.ack_write_queue] == [[7]]


def test_cp_write_zero_owned_returns_metadata_and_noop_ack():
    ctrl, writes, _ = make(rank=3, host_slots=[])
    result = ctrl.write(torch.arange(4, 8), node_id=8)  # page 1 -> owner 1
    assert result.metadata.logical_len == 4
    assert result.metadata.host_indices.tolist() == []
    assert ctrl.host_pool.alloc_calls == []
    assert len(ctrl.ack_write_queue) == 1 and ctrl.ack_write_queue[0].no_op
    ctrl.start_writing()
    assert writes == []


def test_cp_write_allocation_failure_reports_required_host_slots():
    ctrl, writes, _ = make(rank=1, host_slots=[100, 101])
    result = ctrl.write(torch.arange(4, 20), node_id=9)
    assert isinstance(result, HiCacheWriteFailure) and result.required_host_slots == 4
    assert ctrl.host_pool.slots == [100, 101]  # nothing taken
    assert not ctrl.write_queue and not ctrl.ack_write_queue


def test_cp_write_rejects_bad_locs():
    ctrl, _, _ = make(rank=0)
    with pytest.raises(ValueError, match="logical_locs"):
        ctrl.write(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="logical_locs"):
        ctrl.write([1, 2])


def backed_up_node_meta(rank, logical, host):
    result, _ = map_cp_write(CpSharedKVLayout(4, 4, rank), logical, FakeHostPool(host).alloc)
    return result.metadata


def test_cp_load_allocates_owner_preserving_and_transfers_owned_pages():
    meta = backed_up_node_meta(1, torch.arange(4, 20), range(100, 104))
    alloc = OwnerLaneAllocator(4 * 32, 4, 4)
    alloc.alloc(4 * 3)  # disturb the allocator so the new pages differ from the old
    ctrl, _, loads = make(rank=1, alloc=alloc)
    device_locs = ctrl.load([meta], node_id=11)
    pages = (device_locs.view(-1, 4)[:, 0] // 4).tolist()
    assert [p % 4 for p in pages] == [1, 2, 3, 0]  # same owners as at backup
    assert device_locs.numel() == 16
    ctrl.start_loading()
    (op,) = loads
    assert op.host_locs.tolist() == [100, 101, 102, 103]
    owned = op.device_locs[ctrl.layout.owned_by_this_rank(op.device_locs)]
    expect_page = pages[0] // 4  # rank 1's page, physical page index
    assert ctrl.layout.logical_locs_to_physical(owned).tolist() == [expect_page * 4 + i for i in range(4)]


def test_cp_load_zero_owned_returns_full_logical_locs_and_noop_ack():
    meta = backed_up_node_meta(3, torch.arange(4, 8), [])
    ctrl, _, loads = make(rank=3)
    device_locs = ctrl.load([meta], node_id=12)
    assert device_locs.numel() == 4 and (device_locs // 4 % 4).tolist() == [1] * 4
    assert len(ctrl.ack_load_queue) == 1 and ctrl.ack_load_queue[0].no_op
    ctrl.start_loading()
    assert loads == []


def test_cp_load_allocation_failure_returns_none_and_leaks_nothing():
    meta = backed_up_node_meta(1, torch.arange(4, 20), range(100, 104))
    alloc = OwnerLaneAllocator(4 * 4, 4, 4)  # pages 1..4, one per lane
    alloc.alloc_pages_with_owners([2])  # lane 2 now empty
    ctrl, _, _ = make(rank=1, alloc=alloc)
    before = alloc.allocator_state_str()
    assert ctrl.load([meta], node_id=13) is None
    assert alloc.allocator_state_str() == before
    assert not ctrl.load_queue and not ctrl.ack_load_queue


def test_transfer_error_leaves_op_queued_and_unacked():
    def boom(op):
        raise RuntimeError("copy failed")

    ctrl = CpHiCacheController(
        CpSharedKVLayout(4, 4, 1), FakeHostPool(range(4)), OwnerLaneAllocator(64, 4, 4), boom, boom
    )
    ctrl.write(torch.arange(4, 8), node_id=1)
    with pytest.raises(RuntimeError):
        ctrl.start_writing()
    assert len(ctrl.write_queue) == 1 and not ctrl.ack_write_queue


@given(
    cp_size=st.integers(1, 8),
    page_size=st.sampled_from([1, 4, 16, 64]),
    node_pages=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_write_then_load_restores_every_page_to_its_owner(cp_size, page_size, node_pages, seed):
    """Each rank backs up the pages it owns into a per-rank host 'pool' of
    page contents; after an owner-preserving reload into a disturbed
    allocator, every rank finds exactly its own pages again."""
    total_pages = sum(node_pages)
    logical_pages = 4 * total_pages + 8
    g = torch.Generator().manual_seed(seed)
    alloc = OwnerLaneAllocator(logical_pages * page_size, page_size, cp_size)
    chain = [alloc.alloc(n * page_size) for n in node_pages]
    # Content of each logical token: a random id; each rank stores its own.
    content = {int(l): int(torch.randint(0, 2**31, (1,), generator=g)) for c in chain for l in c}
    metas, hosts = {}, {}
    for rank in range(cp_size):
        lay = CpSharedKVLayout(page_size, cp_size, rank)
        host = {}
        pool = FakeHostPool(range(10_000))
        metas[rank] = []
        for node_locs in chain:
            result, op = map_cp_write(lay, node_locs, pool.alloc)
            metas[rank].append(result.metadata)
            if op is not None:
                owned = op.device_locs[lay.owned_by_this_rank(op.device_locs)]
                assert owned.numel() == op.host_locs.numel()
                for h, l in zip(op.host_locs.tolist(), owned.tolist()):
                    host[h] = content[l]
        hosts[rank] = host
    for c in chain:
        alloc.free(c)
    alloc.alloc(page_size * int(torch.randint(0, 3, (1,), generator=g)))  # disturb
    # All ranks run the same allocation (same allocator state): one shared copy
    # here; per-rank copies would be identical by determinism.
    plans = {}
    state = alloc.allocator_state_str()
    for rank in range(cp_size):
        replica = OwnerLaneAllocator(logical_pages * page_size, page_size, cp_size)
        replica._free = [list(x) for x in alloc._free]
        replica._release = [list(x) for x in alloc._release]
        replica._in_use = bytearray(alloc._in_use)
        plans[rank] = map_cp_load(CpSharedKVLayout(page_size, cp_size, rank), metas[rank], replica)
        assert plans[rank] is not None
    assert alloc.allocator_state_str() == state
    new_locs = plans[0].device_locs
    for rank in range(cp_size):
        assert torch.equal(plans[rank].device_locs, new_locs)  # ranks agree
    old_locs = torch.cat(chain)
    for rank in range(cp_size):
        lay = CpSharedKVLayout(page_size, cp_size, rank)
        # Owner preservation: page i keeps its owner.
        assert torch.equal(lay.owner_of(new_locs), lay.owner_of(old_locs))
        op = plans[rank].op
        if op is None:
            assert not bool(lay.owned_by_this_rank(old_locs).any())
            continue
        mask = lay.owned_by_this_rank(op.device_locs)
        assert int(mask.sum()) == op.host_locs.numel()
        for h, old in zip(op.host_locs.tolist(), old_locs[mask].tolist()):
            assert hosts[rank][h] == content[old]
