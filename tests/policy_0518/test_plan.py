"""The write/load plans: numbers from the page-interleave formula
(owner(page) = page % N), plus write -> load on N simulated ranks."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.policy_0518.allocator import OwnerLaneAllocator
from sglang_cp_hicache.policy_0518.metadata import CpHiCacheNodeMetadata
from sglang_cp_hicache.policy_0518.plan import CpWritePlan, HiCacheWriteFailure, plan_load, plan_write
from sglang_cp_hicache.policy_0518 import plan as plan_module
from sglang_cp_hicache.policy_0518.plan import page_owner_tokens, page_owners, placeholder_write_plan


class FakeHostPool:
    """Hands out the next slots of a fixed list; None when short."""

    def __init__(self, slots, *, short_by=0):
        self.slots = list(slots)
        self.alloc_calls = []
        self.freed = []
        self.short_by = short_by  # a broken pool: returns this many slots too few

    def alloc(self, need_size):
        self.alloc_calls.append(need_size)
        if need_size > len(self.slots):
            return None
        take = need_size - self.short_by
        out, self.slots = self.slots[:take], self.slots[take:]
        return torch.tensor(out, dtype=torch.int64)

    def free(self, idx):
        self.freed.append(idx.tolist())
        self.slots.extend(idx.tolist())
        return len(idx)


def locs_of(pages, P=4):
    return (torch.tensor(pages)[:, None] * P + torch.arange(P)).reshape(-1)


def test_write_plan_takes_the_owned_positions_and_their_host_slots():
    placement = CpPlacement(4, 4, 1)
    pool = FakeHostPool(range(100, 104))
    device_locs = locs_of([1, 2, 3, 4])  # owners 1, 2, 3, 0
    plan = plan_write(placement, torch.tensor([1, 2, 3, 4]), device_locs, pool.alloc)
    assert isinstance(plan, CpWritePlan)
    assert plan.metadata.logical_len == 16
    assert plan.metadata.owned_positions.tolist() == [0, 1, 2, 3]
    assert plan.host_locs.tolist() == [100, 101, 102, 103]
    assert plan.metadata.token_owners.tolist() == [1] * 4 + [2] * 4 + [3] * 4 + [0] * 4
    assert pool.alloc_calls == [4]
    assert plan.device_locs is device_locs  # the device locs ride along untouched
    # What the kernels do with it: the owned tokens are physical slots 0..3 on rank 1.
    owned = device_locs[placement.owned_by_this_rank(device_locs)]
    assert placement.logical_locs_to_physical(owned).tolist() == [0, 1, 2, 3]


def test_write_plan_positions_follow_the_pages_not_their_order():
    placement = CpPlacement(4, 2, 0)
    plan = plan_write(placement, torch.tensor([3, 8, 5, 6]), locs_of([3, 8, 5, 6]), FakeHostPool(range(8)).alloc)
    assert plan.metadata.owned_positions.tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    assert plan.metadata.token_owners.tolist() == [1] * 4 + [0] * 4 + [1] * 4 + [0] * 4


def test_write_plan_zero_owned_has_metadata_and_no_slots():
    placement = CpPlacement(4, 4, 3)
    pool = FakeHostPool([])
    plan = plan_write(placement, torch.tensor([1]), locs_of([1]), pool.alloc)
    assert plan.metadata.logical_len == 4 and plan.num_host_slots == 0
    assert plan.host_locs.tolist() == [] and pool.alloc_calls == []
    assert plan.metadata.token_owners.tolist() == [1] * 4
    assert plan.metadata.owned_positions.tolist() == []


def test_ledger_charge_counts_every_rank_s_owned_tokens():
    assert page_owner_tokens(CpPlacement(4, 4, 1), torch.tensor([1, 2, 3, 4])) == [4, 4, 4, 4]
    assert page_owner_tokens(CpPlacement(4, 2, 0), torch.tensor([3, 8, 5, 6])) == [8, 8]
    assert page_owner_tokens(CpPlacement(4, 4, 3), torch.tensor([1])) == [0, 4, 0, 0]


def test_owners_computed_once_feed_the_charge_and_both_plans(monkeypatch):
    """The write-through computes a node's owners once (``page_owners``): the
    ledger's charge, the plan and the placeholder plan all read them, and
    neither plan runs the owner formula again."""
    placement, pages = CpPlacement(4, 2, 0), torch.tensor([3, 8, 5, 6])
    expected = plan_write(placement, pages, locs_of([3, 8, 5, 6]), FakeHostPool(range(8)).alloc)
    owners = page_owners(placement, pages)
    assert owners.owners == [1, 0, 1, 0] and owners.tokens_per_rank == [8, 8]

    def no_second_time(*args, **kwargs):
        raise AssertionError("owner formula ran again")

    monkeypatch.setattr(plan_module, "page_owner", no_second_time)
    got = plan_write(placement, pages, locs_of([3, 8, 5, 6]), FakeHostPool(range(8)).alloc, owners=owners)
    assert torch.equal(got.metadata.token_owners, expected.metadata.token_owners)
    assert torch.equal(got.metadata.owned_positions, expected.metadata.owned_positions)
    assert torch.equal(got.host_locs, expected.host_locs)
    placeholder = placeholder_write_plan(placement, pages, locs_of([3, 8, 5, 6]), owners)
    assert torch.equal(placeholder.metadata.token_owners, expected.metadata.token_owners)
    assert placeholder.num_host_slots == 0


def test_placeholder_plan_records_every_owner_and_no_slots():
    plan = placeholder_write_plan(CpPlacement(4, 4, 2), torch.tensor([5, 2, 7]), locs_of([5, 2, 7]))
    assert plan.metadata.logical_len == 12 and plan.num_host_slots == 0
    assert plan.metadata.token_owners.tolist() == [1] * 4 + [2] * 4 + [3] * 4
    assert plan.metadata.owned_positions.tolist() == [] and plan.host_locs.tolist() == []


def test_write_plan_short_host_pool_reports_what_it_needed_and_takes_nothing():
    pool = FakeHostPool([100, 101])
    got = plan_write(CpPlacement(4, 4, 1), torch.tensor([1, 2, 3, 4]), locs_of([1, 2, 3, 4]), pool.alloc)
    assert isinstance(got, HiCacheWriteFailure) and got.required_host_slots == 4
    assert pool.slots == [100, 101]


def test_write_plan_gives_back_a_wrong_sized_host_allocation():
    pool = FakeHostPool(range(100, 110), short_by=1)
    with pytest.raises(RuntimeError, match="host allocator returned 3 slots for 4"):
        plan_write(CpPlacement(4, 4, 1), torch.tensor([1, 2]), locs_of([1, 2]), pool.alloc, pool.free)
    assert pool.freed == [[100, 101, 102]]


def test_write_plan_never_reads_the_device_locs():
    class Unreadable(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func not in (torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.dtype.__get__):
                raise AssertionError(f"device locs read on the host: {func}")
            return super().__torch_function__(func, types, args, kwargs or {})

    locs = locs_of([1, 2]).as_subclass(Unreadable)
    plan = plan_write(CpPlacement(4, 2, 0), torch.tensor([1, 2]), locs, FakeHostPool(range(4)).alloc)
    assert plan.num_host_slots == 4


def backed_up(rank, pages, host, P=4, N=4):
    plan = plan_write(CpPlacement(P, N, rank), torch.tensor(pages), locs_of(pages, P), FakeHostPool(host).alloc)
    return plan.metadata


def test_load_plan_allocates_with_the_backup_owners():
    meta = backed_up(1, [1, 2, 3, 4], range(100, 104))
    alloc = OwnerLaneAllocator(4 * 32, 4, 4)
    alloc.alloc(4 * 3)  # disturb the allocator so the new pages differ from the old
    plan = plan_load(CpPlacement(4, 4, 1), [meta], alloc)
    pages = plan.allocation.pages.tolist()
    assert [p % 4 for p in pages] == [1, 2, 3, 0]  # same owners as at backup
    assert plan.page_owners.tolist() == [1, 2, 3, 0]
    assert torch.equal(plan.device_locs, locs_of(pages))  # the mirror matches the locs
    assert plan.host_locs.tolist() == [100, 101, 102, 103]


def test_load_plan_zero_owned_restores_the_full_logical_locs():
    meta = backed_up(3, [1], [])
    plan = plan_load(CpPlacement(4, 4, 3), [meta], OwnerLaneAllocator(4 * 32, 4, 4))
    assert plan.device_locs.numel() == 4 and (plan.device_locs // 4 % 4).tolist() == [1] * 4
    assert plan.host_locs.numel() == 0


def test_load_plan_short_lane_returns_none_and_leaks_nothing():
    meta = backed_up(1, [1, 2, 3, 4], range(100, 104))
    alloc = OwnerLaneAllocator(4 * 4, 4, 4)  # pages 1..4, one per lane
    alloc.alloc_pages_with_owners([2])  # lane 2 now empty
    before = alloc.snapshot()
    assert plan_load(CpPlacement(4, 4, 1), [meta], alloc) is None
    assert alloc.snapshot() == before


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
    chain = [alloc.alloc_mirrored(n * page_size) for n in node_pages]
    content = {int(l): int(torch.randint(0, 2**31, (1,), generator=g)) for c in chain for l in c.locs}
    metas, hosts = {}, {}
    for rank in range(cp_size):
        placement = CpPlacement(page_size, cp_size, rank)
        host = {}
        pool = FakeHostPool(range(10_000))
        metas[rank] = []
        for node in chain:
            plan = plan_write(placement, node.pages, node.locs, pool.alloc)
            metas[rank].append(plan.metadata)
            owned = node.locs[placement.owned_by_this_rank(node.locs)]
            assert owned.numel() == plan.host_locs.numel()
            for h, l in zip(plan.host_locs.tolist(), owned.tolist()):
                host[h] = content[l]
        hosts[rank] = host
    for c in chain:
        alloc.free_mirrored(c.pages)
    alloc.alloc(page_size * int(torch.randint(0, 3, (1,), generator=g)))  # disturb
    # Every rank runs the same allocation from the same allocator state.
    start = alloc.snapshot()
    plans = {}
    for rank in range(cp_size):
        alloc.restore(start)
        plans[rank] = plan_load(CpPlacement(page_size, cp_size, rank), metas[rank], alloc)
        assert plans[rank] is not None
    new_locs = plans[0].device_locs
    for rank in range(cp_size):
        assert torch.equal(plans[rank].device_locs, new_locs)  # ranks agree
    old_locs = torch.cat([c.locs for c in chain])
    for rank in range(cp_size):
        placement = CpPlacement(page_size, cp_size, rank)
        assert torch.equal(placement.owner_of(new_locs), placement.owner_of(old_locs))  # owner preservation
        plan = plans[rank]
        mask = placement.owned_by_this_rank(new_locs)
        assert int(mask.sum()) == plan.host_locs.numel()
        for h, old in zip(plan.host_locs.tolist(), old_locs[placement.owned_by_this_rank(old_locs)].tolist()):
            assert hosts[rank][h] == content[old]


def test_metadata_from_a_plan_is_valid():
    meta = backed_up(2, [5, 6, 7], range(4))
    assert isinstance(meta, CpHiCacheNodeMetadata)
    CpHiCacheNodeMetadata(meta.logical_len, meta.owned_positions, meta.host_indices, meta.token_owners)


@given(
    cp_size=st.integers(1, 8),
    ops=st.lists(st.tuples(st.sampled_from(["alloc", "owners", "free"]), st.integers(0, 6)), max_size=12),
    before=st.lists(st.integers(0, 4), max_size=4),
    seed=st.integers(0, 2**16),
)
def test_rollback_restores_the_allocator_exactly(cp_size, ops, before, seed):
    """checkpoint/rollback (the load-back undo log, O(pages touched)) leaves
    the allocator exactly as a snapshot of every free list would."""
    g = torch.Generator().manual_seed(seed)
    alloc = OwnerLaneAllocator(4 * 64, 4, cp_size)
    held = []
    for n in before:  # some history: held pages, deferred releases
        got = alloc.alloc_mirrored(4 * n)
        if got is not None and n:
            held.append(got.pages)
    if held:
        alloc.free_mirrored(held.pop(0))
    start = alloc.snapshot()
    cp = alloc.checkpoint()
    for op, n in ops:
        if op == "alloc":
            got = alloc.alloc_mirrored(4 * n)
        elif op == "owners":
            got = alloc.alloc_with_owners_mirrored(torch.randint(0, cp_size, (n,), generator=g))
        else:
            got = None
            if held:
                alloc.free_mirrored(held.pop())
        if got is not None and got.pages.numel():
            held.append(got.pages)
    alloc.rollback(cp)
    assert alloc.snapshot() == start
    # and the log is closed: a second rollback to it is refused
    with pytest.raises(ValueError, match="checkpoint"):
        alloc.rollback(cp)


def test_commit_keeps_and_nests():
    alloc = OwnerLaneAllocator(4 * 16, 4, 2)
    outer = alloc.checkpoint()
    a = alloc.alloc_mirrored(8)
    inner = alloc.checkpoint()
    alloc.alloc_mirrored(8)
    alloc.rollback(inner)
    after_a = alloc.snapshot()
    alloc.commit(outer)
    assert alloc.snapshot() == after_a and a.pages.numel() == 2
    assert alloc.pages_in_use() == 2  # a's two pages (the padding page is not counted)
