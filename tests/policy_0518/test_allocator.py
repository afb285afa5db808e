import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_cp_hicache.policy_0518.allocator import OwnerLaneAllocator


def pages_of(locs, page_size):
    return (locs.view(-1, page_size)[:, 0] // page_size).tolist()


def test_state_str_reports_free_and_release_pages():
    # OOM accounting, numbers from the page-interleave layout: 8 logical pages of 64
    # (page 0 reserved) over 4 ranks -> pages 1..8 free initially.
    a = OwnerLaneAllocator(logical_size=64 * 8, page_size=64, cp_size=4)
    locs = a.alloc(64 * 6)  # leaves 2 pages free
    assert len(pages_of(locs, 64)) == 6
    a.free(locs[:64])  # one page goes to the deferred release list
    state = a.allocator_state_str()
    assert state == (
        "allocator_available_size=192 (allocator_free_size=128 [free_pages=2] + "
        "allocator_release_size=64 [release_pages=1])"
    )
    assert a.immediate_available_size() == 128 and a.deferred_available_size() == 64
    assert a.available_size() == 192


def test_alloc_is_round_robin_and_deterministic():
    runs = []
    for _ in range(2):
        a = OwnerLaneAllocator(64 * 16, 64, 4)
        first = pages_of(a.alloc(64 * 5), 64)
        second = pages_of(a.alloc(64 * 3), 64)
        runs.append((first, second))
    assert runs[0] == runs[1]
    first, second = runs[0]
    assert [p % 4 for p in first] == [0, 1, 2, 3, 0]
    assert [p % 4 for p in second] == [1, 2, 3]  # continues where it stopped
    assert len(set(first + second)) == 8 and 0 not in first + second


def test_alloc_pages_with_owners_and_failure_changes_nothing():
    a = OwnerLaneAllocator(4 * 8, 4, 4)  # pages 1..8: two per lane
    locs = a.alloc_pages_with_owners([3, 3, 0])
    assert [p % 4 for p in pages_of(locs, 4)] == [3, 3, 0]
    assert locs.tolist()[:4] == [12, 13, 14, 15]  # page 3, whole page of locs
    before = (a.allocator_state_str(), a.lane_available_pages())
    assert a.alloc_pages_with_owners([3]) is None  # lane 3 is empty now
    assert (a.allocator_state_str(), a.lane_available_pages()) == before
    assert a.alloc_pages_with_owners([]).numel() == 0


def test_free_validates_and_detects_double_free():
    a = OwnerLaneAllocator(4 * 8, 4, 2)
    locs = a.alloc(8)
    a.free(locs)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(locs)
    with pytest.raises(ValueError, match="outside"):
        a.free(torch.tensor([4 * 9]))
    with pytest.raises(ValueError, match="outside"):
        a.free(torch.tensor([0]))  # reserved page
    with pytest.raises(TypeError, match="free_index"):
        a.free([4])


def test_bad_arguments():
    with pytest.raises(ValueError, match="logical_size"):
        OwnerLaneAllocator(10, 4, 2)
    with pytest.raises(ValueError, match="page_size"):
        OwnerLaneAllocator(8, 0, 2)
    a = OwnerLaneAllocator(16, 4, 2)
    with pytest.raises(ValueError, match="need_size"):
        a.alloc(3)
    with pytest.raises(ValueError, match="owners"):
        a.alloc_pages_with_owners([2])
    assert a.alloc(4 * 5) is None and a.available_size() == 16


def test_released_pages_are_reused_after_merge():
    a = OwnerLaneAllocator(2 * 4, 2, 2)  # pages 1..4
    locs = a.alloc(8)
    a.free(locs)
    assert a.immediate_available_pages() == 0 and a.deferred_available_pages() == 4
    again = a.alloc(8)
    assert sorted(pages_of(again, 2)) == [1, 2, 3, 4]


ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 6)),
        st.tuples(st.just("owners"), st.lists(st.integers(0, 7), max_size=6)),
        st.tuples(st.just("free"), st.integers(0, 50)),
    ),
    max_size=40,
)


@given(cp_size=st.integers(1, 8), page_size=st.sampled_from([1, 4, 16]), num_pages=st.integers(1, 30), seq=ops)
def test_never_double_allocates_and_conserves_pages(cp_size, page_size, num_pages, seq):
    a = OwnerLaneAllocator(num_pages * page_size, page_size, cp_size)
    held: list[list[int]] = []
    for kind, arg in seq:
        before = (a.allocator_state_str(), a.lane_available_pages())
        if kind == "alloc":
            locs = a.alloc(arg * page_size)
        elif kind == "owners":
            owners = [o % cp_size for o in arg]
            locs = a.alloc_pages_with_owners(owners)
            if locs is not None:
                assert [p % cp_size for p in pages_of(locs, page_size)] == owners
        else:
            if held:
                pages = held.pop(arg % len(held))
                a.free(torch.tensor([p * page_size for p in pages], dtype=torch.int64))
            locs = None
            kind = "free"
        if kind != "free":
            if locs is None:
                assert (a.allocator_state_str(), a.lane_available_pages()) == before
            else:
                pages = pages_of(locs, page_size) if locs.numel() else []
                if pages:  # every page's locs are whole and contiguous
                    expect = torch.tensor(pages, dtype=torch.int64)[:, None] * page_size
                    assert torch.equal(locs, (expect + torch.arange(page_size)).reshape(-1))
                held.append(pages)
        flat = [p for ps in held for p in ps]
        assert len(flat) == len(set(flat)), "page handed out twice"
        assert 0 not in flat
        assert all(1 <= p <= num_pages for p in flat)
        assert a.available_pages() + len(flat) == num_pages


def test_alloc_prefers_the_fullest_lane():
    a = OwnerLaneAllocator(4 * 12, 4, 3)  # pages 1..12: lanes 0, 1, 2 hold 4 each
    a.alloc_pages_with_owners([1, 1, 1])  # lane 1 nearly drained: [4, 1, 4]
    lanes = [p % 3 for p in pages_of(a.alloc(4 * 6), 4)]
    assert lanes == [0, 2, 0, 2, 0, 2]  # the fullest lanes first, ties round-robin
    assert a.lane_available_pages() == [1, 1, 1]


def test_lane_bias_steers_pages_to_the_least_loaded_lanes():
    a = OwnerLaneAllocator(4 * 12, 4, 3)  # 4 pages per lane
    a.lane_bias = lambda: [128, 0, 64]  # e.g. host slots each rank already holds
    lanes = [p % 3 for p in pages_of(a.alloc(4 * 5), 4)]
    # lane 1 takes pages until it is out of them (its load stays below 64);
    # then the next least loaded lane
    assert lanes == [1, 1, 1, 1, 2]
    # no reclaim hook: the 5th page went off balance (lane 1, the least
    # loaded, was out of pages); the first four did not
    assert (a.uneven_picks, a.lane_reclaims) == (1, 0)


class LaneCache:
    """Stands in for the CP cache: holds pages, frees one of a lane on demand."""

    def __init__(self, allocator):
        self.a, self.held, self.calls = allocator, [], []

    def reclaim(self, lane, pages):
        self.calls.append(lane)
        freed = 0
        for page in [p for p in self.held if p % self.a.cp_size == lane]:
            if self.a.lane_available_pages()[lane] >= pages:
                break
            self.held.remove(page)
            self.a.free_mirrored(torch.tensor([page]))
            freed += 1
        return freed


def test_an_empty_least_loaded_lane_is_reclaimed_before_the_loads_drift():
    a = OwnerLaneAllocator(4 * 12, 4, 3)  # 4 pages per lane
    cache = LaneCache(a)
    cache.held = pages_of(a.alloc_pages_with_owners([1, 1, 1, 1]), 4)  # lane 1 all in use
    a.lane_bias, a.lane_reclaim = (lambda: [8, 0, 8]), cache.reclaim  # lane 1 two pages behind
    lanes = [p % 3 for p in pages_of(a.alloc(4), 4)]
    assert cache.calls == [1] and lanes == [1]  # evicted for lane 1, then took its page
    assert (a.lane_reclaims, a.uneven_picks) == (1, 0)


def test_reclaim_counts_the_pages_this_call_already_planned_on_the_lane():
    """Lane 1 has one free page but is owed two in this call: the second
    pick asks for a lane with 2 free pages, not for "any free page"."""
    a = OwnerLaneAllocator(4 * 12, 4, 3)
    cache = LaneCache(a)
    cache.held = pages_of(a.alloc_pages_with_owners([1, 1, 1]), 4)  # 1 page left in lane 1
    a.lane_bias, a.lane_reclaim = (lambda: [16, 0, 16]), cache.reclaim  # lane 1 four pages behind
    lanes = [p % 3 for p in pages_of(a.alloc(4 * 2), 4)]
    assert lanes == [1, 1] and cache.calls == [1]
    assert (a.lane_reclaims, a.uneven_picks) == (1, 0)


def test_no_reclaim_while_one_page_off_is_still_within_a_page_of_the_mean():
    a = OwnerLaneAllocator(4 * 12, 4, 3)
    cache = LaneCache(a)
    cache.held = pages_of(a.alloc_pages_with_owners([1, 1, 1, 1]), 4)
    a.lane_bias, a.lane_reclaim = (lambda: [4, 0, 4]), cache.reclaim  # one page behind
    lanes = [p % 3 for p in pages_of(a.alloc(4), 4)]
    # loads become [8, 0, 4] or [4, 0, 8]: every lane within 4 slots of the mean 4
    assert cache.calls == [] and lanes in ([0], [2])


def test_nothing_to_reclaim_places_the_page_off_balance_and_counts_it():
    a = OwnerLaneAllocator(4 * 12, 4, 3)
    a.alloc_pages_with_owners([1, 1, 1, 1])  # held by someone the cache cannot evict
    cache = LaneCache(a)
    a.lane_bias, a.lane_reclaim = (lambda: [8, 0, 8]), cache.reclaim
    lanes = [p % 3 for p in pages_of(a.alloc(4), 4)]
    assert cache.calls == [1] and lanes in ([0], [2])
    assert (a.lane_reclaims, a.uneven_picks) == (0, 1)


def test_no_reclaim_under_an_open_checkpoint():
    """A rollback could not undo an eviction: inside a checkpoint the
    allocator never asks for one."""
    a = OwnerLaneAllocator(4 * 12, 4, 3)
    cache = LaneCache(a)
    cache.held = pages_of(a.alloc_pages_with_owners([1, 1, 1, 1]), 4)
    a.lane_bias, a.lane_reclaim = (lambda: [8, 0, 8]), cache.reclaim
    cp = a.checkpoint()
    a.alloc(4)
    a.rollback(cp)
    assert cache.calls == [] and a.uneven_picks == 1


@settings(max_examples=100, deadline=None)
@given(
    st.integers(2, 8),
    st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(0, 7), min_size=1, max_size=6)),
        min_size=1, max_size=60,
    ),
)
def test_with_reclaim_every_lane_stays_within_a_page_of_the_mean(cp_size, steps):
    """New pages are "backed up" (the bias is every new page ever handed out
    per lane); restored pages keep the owners they had (``alloc_pages_with_owners``,
    not backed up again), which skews what the pool holds. The pool is tight:
    only what an LRU cache evicts is free. With reclaim, after every
    allocation each lane's load is within one page of the mean load."""
    P = 4
    a = OwnerLaneAllocator(P * 3 * cp_size, P, cp_size)  # 3 pages per lane
    loads = [0] * cp_size
    cache = LaneCache(a)  # LRU order: oldest first
    a.lane_bias, a.lane_reclaim = (lambda: loads), cache.reclaim
    for restore, owners in steps:
        owners = [o % cp_size for o in owners]
        while a.available_pages() < len(owners) and cache.held:  # evict the shortfall, any lane
            a.free_mirrored(torch.tensor([cache.held.pop(0)]))
        if restore:
            while cache.held and any(
                owners.count(o) > a.lane_available_pages()[o] for o in set(owners)
            ):
                a.free_mirrored(torch.tensor([cache.held.pop(0)]))
            got = a.alloc_with_owners_mirrored(owners)
            if got is not None:  # else refused, as the cache refuses such a load-back
                cache.held += got.pages.tolist()
            continue
        got = a.alloc_mirrored(len(owners) * P)
        assert got is not None  # everything held can be evicted
        for page in got.pages.tolist():
            loads[page % cp_size] += P
            cache.held.append(page)
        total = sum(loads)
        assert all(abs(x * cp_size - total) <= P * cp_size for x in loads), loads
