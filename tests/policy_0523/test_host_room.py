"""Owner-aware host room (``sglang_cp_hicache.policy_0523.host_room``): pure decisions on ints."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_cp_hicache.policy_0523.host_room import (
    HostRoom,
    class_counts_of,
    covering_tail,
    cyclic_class_counts,
    plan_host_room,
    reach_counts,
    shortest_tail,
)


@given(n=st.integers(1, 9), data=st.data())
def test_cyclic_counts_are_the_classes_a_cyclic_run_draws(n, data):
    start = data.draw(st.integers(0, n - 1))
    pages = data.draw(st.integers(0, 40))
    assert cyclic_class_counts(start, pages, n) == class_counts_of([(start + j) % n for j in range(pages)], n)


def test_the_finding_run_needs_two_of_class_0_and_one_of_class_1():
    assert cyclic_class_counts(0, 3, 2) == [2, 1]
    room = HostRoom([2, 1], [1, 1])
    assert room.shortfall == [1, 0] and room.short_classes == [0] and not room.satisfied
    assert not room.helps([0, 1])  # upstream's LRU page of class 1 frees nothing needed
    assert room.helps([1, 0])
    room.take([0, 1])
    assert room.shortfall == [1, 0]
    room.take([2, 0])
    assert room.satisfied and room.free == [3, 2]


def _leaves(n: int):
    return st.lists(st.lists(st.integers(0, 3), min_size=n, max_size=n), max_size=12)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 6), data=st.data())
def test_a_plan_takes_only_helpful_leaves_and_stops_when_the_run_fits(n, data):
    need = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    free = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    leaves = data.draw(_leaves(n))
    taken, fits = plan_host_room(need, free, leaves)
    assert taken == sorted(set(taken))
    # it fits exactly when all the leaves together could make it fit
    everything = HostRoom(need, free)
    everything.take([sum(col) for col in zip(*leaves, [0] * n)])
    assert fits == everything.satisfied
    if not fits:
        assert taken == []  # the write fails either way: nothing is evicted for it
        return
    # replay: each taken leaf held a page of a class short at its turn
    room = HostRoom(need, free)
    for i, leaf in enumerate(leaves):
        if i in taken:
            assert room.helps(leaf) and not room.satisfied
            room.take(leaf)
        elif not room.satisfied:
            assert not room.helps(leaf)  # skipped: nothing of a short class
    assert room.satisfied
    if taken:
        # the last leaf taken was needed: without it the run would not fit
        without = HostRoom(need, free)
        for i in taken[:-1]:
            without.take(leaves[i])
        assert not without.satisfied
        assert all(i <= taken[-1] for i in taken)
    # never more evicted of a class than it holds in total
    assert all(f >= fr for f, fr in zip(room.free, free))


def test_a_run_all_leaves_together_cannot_fit_takes_none():
    """Two leaves of class 0 for a run short of three class-0 pages: evicting
    them would leave it short, so neither is taken; with a third, all three."""
    need, free = [3, 1], [0, 1]
    assert plan_host_room(need, free, [[1, 0], [0, 2], [1, 1]]) == ([], False)
    assert plan_host_room(need, free, [[1, 0], [0, 2], [1, 1], [1, 0]]) == ([0, 2, 3], True)
    assert plan_host_room(need, free, []) == ([], False)
    assert plan_host_room([0, 1], [0, 1], []) == ([], True)


@given(n=st.integers(1, 6), data=st.data())
def test_can_fit_is_the_shortfall_covered_class_by_class(n, data):
    counts = st.lists(st.integers(0, 6), min_size=n, max_size=n)
    need, free, reachable = data.draw(counts), data.draw(counts), data.draw(counts)
    room = HostRoom(need, free)
    freed = HostRoom(need, free)
    freed.take(reachable)
    assert room.can_fit(reachable) == freed.satisfied == all(f + r >= k for k, f, r in zip(need, free, reachable))
    assert room.free == free  # asking changes nothing


@given(n=st.integers(1, 5), data=st.data())
def test_a_leaf_reaches_its_ancestors_up_to_the_first_that_cannot_be_cleared(n, data):
    counts = st.lists(st.integers(0, 3), min_size=n, max_size=n)
    leaf = data.draw(counts)
    ancestors = data.draw(st.lists(st.tuples(counts, st.booleans()), max_size=5))
    got = reach_counts(leaf, ancestors)
    cleared = []
    for c, ok in ancestors:
        if not ok:
            break
        cleared.append(c)
    assert got == [sum(col) for col in zip(leaf, *cleared)]


def test_an_inner_page_of_the_short_class_is_reached_through_its_leaf():
    """The class-0 page sits in the leaf's parent: the leaf alone does not
    help, the leaf with its clearable parent does; a locked parent stops it."""
    room = HostRoom([1, 0], [0, 3])
    leaf, parent = [0, 2], [1, 0]
    assert not room.helps(leaf)
    assert room.helps(reach_counts(leaf, [(parent, True)]))
    assert not room.helps(reach_counts(leaf, [(parent, False), ([5, 0], True)]))


@settings(max_examples=400, deadline=None)
@given(n=st.integers(1, 6), data=st.data())
def test_the_shortest_tail_makes_the_run_fit_and_no_shorter_one_does(n, data):
    counts = st.lists(st.integers(0, 4), min_size=n, max_size=n)
    need, free = data.draw(counts), data.draw(counts)
    owners = data.draw(st.lists(st.integers(0, n - 1), max_size=16))
    room = HostRoom(need, free)
    tail = shortest_tail(room, owners)

    def fits(length: int) -> bool:
        probe = HostRoom(need, free)
        probe.take(class_counts_of(owners[len(owners) - length:], n))
        return probe.satisfied

    assert room.free == free and room.need == need  # asking changes nothing
    if tail is None:
        assert not fits(len(owners))  # even the whole leaf leaves the run short
        return
    assert 0 <= tail <= len(owners)  # never longer than the leaf
    assert fits(tail)
    assert not any(fits(m) for m in range(tail))
    # its first page is one the run needs: every page before it stays
    assert tail == 0 or room.helps(class_counts_of([owners[-tail]], n))


def test_only_the_tail_a_run_needs_is_taken():
    """Short of one class-1 page: the leaf's last page of class 1 is enough,
    however long the leaf; short of a class-0 page too, the tail reaches back
    to the last page of class 0; a leaf without one cannot make it fit."""
    room = HostRoom([2, 3], [2, 2])
    assert shortest_tail(room, [0, 1, 0, 1, 0, 1]) == 1
    assert shortest_tail(room, [0, 1, 0, 1, 0, 0]) == 3
    assert shortest_tail(HostRoom([3, 3], [2, 2]), [0, 1, 0, 1, 1, 1]) == 4
    assert shortest_tail(HostRoom([3, 3], [2, 2]), [1, 1, 1]) is None
    assert shortest_tail(room, []) is None
    assert shortest_tail(HostRoom([1, 1], [1, 1]), [0, 1]) == 0  # already fits: nothing needed


@settings(max_examples=400, deadline=None)
@given(n=st.integers(1, 8), data=st.data())
def test_the_covering_tail_keeps_a_prefix_only_when_it_holds_every_class(n, data):
    counts = st.lists(st.integers(0, 4), min_size=n, max_size=n)
    need, free = data.draw(counts), data.draw(counts)
    start = data.draw(st.integers(0, n - 1))
    cyclic = data.draw(st.booleans())  # a host leaf's pages are cyclic; the rule holds for any order
    length = data.draw(st.integers(0, 3 * n + 2))
    owners = [(start + j) % n for j in range(length)] if cyclic else data.draw(
        st.lists(st.integers(0, n - 1), max_size=16))
    room = HostRoom(need, free)
    shortest, tail = shortest_tail(room, owners), covering_tail(room, owners)
    assert room.free == free and room.need == need  # asking changes nothing
    if shortest is None or shortest in (0, len(owners)):
        assert tail == shortest  # no tail fits the run, none is needed, or only the whole leaf
        return
    kept = owners[: len(owners) - shortest]
    if set(kept) == set(range(n)):
        assert tail == shortest  # the prefix helps any later run: it stays
    else:
        assert tail == len(owners)  # it would lack a class: the whole leaf goes
    if cyclic:  # a cyclic prefix holds every class exactly when it has N pages
        assert (tail == shortest) == (len(owners) - shortest >= n)


def test_a_prefix_lacking_a_class_is_not_kept():
    """CP 2, short of one class-0 page: the shortest tail of 1 0 1 0 is its
    last page (a prefix 1 0 1, both classes, stays); of 1 0 it is also its
    last page, but the prefix 1 would lack class 0: the whole leaf goes."""
    room = HostRoom([1, 0], [0, 0])
    assert shortest_tail(room, [1, 0, 1, 0]) == covering_tail(room, [1, 0, 1, 0]) == 1
    assert shortest_tail(room, [1, 0]) == 1 and covering_tail(room, [1, 0]) == 2
    assert covering_tail(room, [1, 1]) is None
    # CP 8: a prefix of seven cyclic pages lacks one class
    room8 = HostRoom([0] * 7 + [1], [0] * 8)
    assert shortest_tail(room8, list(range(8))) == 1 and covering_tail(room8, list(range(8))) == 8
    assert covering_tail(room8, list(range(8)) * 2) == 1
    with pytest.raises(ValueError, match="owners\\[0\\] must be <= 7"):
        covering_tail(room8, [8])


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="start_class must be <= 1"):
        cyclic_class_counts(2, 3, 2)
    with pytest.raises(ValueError, match="pages must be >= 0"):
        cyclic_class_counts(0, -1, 2)
    with pytest.raises(ValueError, match="cp_size must be >= 1"):
        cyclic_class_counts(0, 1, 0)
    with pytest.raises(ValueError, match="owners\\[1\\] must be <= 1"):
        class_counts_of([0, 2], 2)
    with pytest.raises(ValueError, match="free must have 2 entries, got 3"):
        HostRoom([1, 1], [0, 0, 0])
    with pytest.raises(ValueError, match="need\\[0\\] must be >= 0"):
        HostRoom([-1, 1], [0, 0])
    with pytest.raises(ValueError, match="need must have one entry per owner class"):
        HostRoom([], [])
    room = HostRoom([2, 1], [0, 0])
    with pytest.raises(ValueError, match="freed must have 2 entries, got 1"):
        room.take([1])
    with pytest.raises(TypeError, match="freed\\[0\\] must be an int"):
        room.helps([1.0, 0])
    assert room.free == [0, 0] and room.shortfall == [2, 1]  # nothing changed
    with pytest.raises(ValueError, match="reachable must have 2 entries, got 3"):
        room.can_fit([1, 1, 1])
    with pytest.raises(ValueError, match="reachable\\[1\\] must be >= 0"):
        room.can_fit([1, -1])
    with pytest.raises(ValueError, match="leaves\\[1\\] must have 2 entries, got 1"):
        plan_host_room([1, 1], [0, 0], [[1, 0], [1]])
    assert room.free == [0, 0] and room.shortfall == [2, 1]
    with pytest.raises(ValueError, match="owners\\[2\\] must be <= 1"):
        shortest_tail(room, [0, 1, 2])
    with pytest.raises(TypeError, match="owners must be a list of ints, got int"):
        shortest_tail(room, 3)
    with pytest.raises(TypeError, match="room must be a HostRoom, got list"):
        shortest_tail([2, 1], [0, 1])
    assert room.free == [0, 0] and room.shortfall == [2, 1]
    with pytest.raises(ValueError, match="ancestors\\[0\\] must have 2 entries, got 1"):
        reach_counts([0, 1], [([1], True)])
