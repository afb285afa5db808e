"""Device frees of evicted nodes from their rotation phase vs SGLang 0.5.23's
``PageInterleavePoolAllocator.free``: for random alloc / free sequences, two
identical allocators -- one freed by upstream's ``free``, one by the
library's :func:`free_cyclic_run` -- end with identical state, every field."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.components.base import EvictLayer

from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.sglang_0523.device_free import PhaseKnownDeviceFrees, free_cyclic_run

P = 4  # the allocator's physical page (64 on a server; any size here)


def _allocator(n: int, pages_per_rank: int, need_sort: bool) -> PageInterleavePoolAllocator:
    return PageInterleavePoolAllocator(
        pages_per_rank * P, physical_page_size=P, shard_size=n, dtype=torch.int64, device="cpu",
        kvcache=None, need_sort=need_sort,
    )


def _frees_on_a_full_stand_in(
    n: int, pages_per_rank: int, need_sort: bool
) -> tuple[PageInterleavePoolAllocator, PageInterleavePoolAllocator, PhaseKnownDeviceFrees]:
    """(an allocator with the library's phase-known frees installed, an
    untouched twin of it, the frees) for rank 0 of ``n``, on a stand-in cache
    with only a FULL component."""
    alloc, twin = _allocator(n, pages_per_rank, need_sort), _allocator(n, pages_per_rank, need_sort)
    frees = PhaseKnownDeviceFrees(
        SimpleNamespace(components={ComponentType.FULL: _Full()}, tree_core=None), alloc, CpPlacement(P, n, 0),
    )
    frees.install()
    return alloc, twin, frees


def _same_state(a: PageInterleavePoolAllocator, b: PageInterleavePoolAllocator) -> list[str]:
    """Every field that differs (tensors: dtype and values; lists of tensors: each)."""
    diffs = []
    wired = {"free", "free_segment", "free_group_end"}  # the library's methods on a wired instance, not state
    fields_a, fields_b = (
        {k: v for k, v in vars(x).items() if not (k in wired and callable(v))} for x in (a, b)
    )
    assert fields_a.keys() == fields_b.keys()
    for key, x in fields_a.items():
        y = fields_b[key]
        if isinstance(x, torch.Tensor):
            same = isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        elif isinstance(x, list) and x and isinstance(x[0], torch.Tensor):
            same = len(x) == len(y) and all(u.dtype == v.dtype and torch.equal(u, v) for u, v in zip(x, y))
        elif key == "kvcache":
            same = x is y
        else:
            same = x == y
        if not same:
            diffs.append(key)
    return diffs


@settings(max_examples=120, deadline=None)
@given(n=st.sampled_from([2, 3, 4, 8]), need_sort=st.booleans(), data=st.data())
def test_random_alloc_free_sequences_leave_identical_allocators(n, need_sort, data):
    up, lib = _allocator(n, 6, need_sort), _allocator(n, 6, need_sort)
    live: list[tuple[torch.Tensor, int]] = []  # (locs, start class) of each allocated run
    for _ in range(data.draw(st.integers(1, 25))):
        if live and data.draw(st.booleans()):
            locs, start = live.pop(data.draw(st.integers(0, len(live) - 1)))
            pages = locs.numel() // P
            # a node may be a page-aligned part of a run (tree splits)
            i = data.draw(st.integers(0, pages - 1))
            j = data.draw(st.integers(i + 1, pages))
            part, rest = locs[i * P : j * P], [(locs[: i * P], start), (locs[j * P :], (start + j) % n)]
            live += [(r, s) for r, s in rest if r.numel()]
            up.free(part.clone())
            free_cyclic_run(lib, part.clone(), (start + i) % n)
        else:
            start = data.draw(st.integers(0, n - 1))
            size = data.draw(st.integers(1, 3 * n)) * P
            a, b = up.alloc_cyclic(start, size), lib.alloc_cyclic(start, size)
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a, b)
                live.append((a, start))
        assert _same_state(up, lib) == []
    up.merge_and_sort_free(), lib.merge_and_sort_free()
    assert _same_state(up, lib) == []


def test_a_stale_phase_is_caught_in_debug_mode(monkeypatch):
    monkeypatch.setenv("SGLANG_CP_HICACHE_DEBUG", "1")
    alloc = _allocator(2, 4, True)
    locs = alloc.alloc_cyclic(0, 3 * P)  # classes 0, 1, 0
    before = [t.clone() for t in alloc.class_release_pages]
    with pytest.raises(AssertionError, match="rotation phase is stale"):
        free_cyclic_run(alloc, locs, 1)  # as if it started at class 1
    assert all(torch.equal(x, y) for x, y in zip(before, alloc.class_release_pages))  # nothing changed


# ---- the instance wiring, on stand-ins for the tree ------------------------------------


class _Full:
    """FullComponent.evict_component's contract: queue the node's value."""

    def evict_component(self, node, device_frees, host_frees, cache_actions, target=EvictLayer.DEVICE):
        value = node.component(ComponentType.FULL).value
        if EvictLayer.DEVICE in target and value is not None:
            device_frees[ComponentType.FULL].append(value)
        return 0, 0


def _wired(n: int):
    alloc, twin = _allocator(n, 6, True), _allocator(n, 6, True)
    full = _Full()
    cache = SimpleNamespace(
        components={ComponentType.FULL: full},
        tree_core=SimpleNamespace(rotation_phase_of=lambda node_id: node_id),  # stand-in: phase = id
    )
    frees = PhaseKnownDeviceFrees(cache, alloc, CpPlacement(P, n, 0))
    frees.install()
    return alloc, twin, full, frees


def _node(node_id: int, value: torch.Tensor):
    data = SimpleNamespace(value=value)
    return SimpleNamespace(id=node_id, rotation_base=0, component=lambda ct: data)


def test_an_evicted_node_is_freed_from_its_phase_and_anything_else_by_upstream():
    from collections import defaultdict

    alloc, twin, full, frees = _wired(3)
    runs = [(alloc.alloc_cyclic(s, 4 * P), twin.alloc_cyclic(s, 4 * P), s) for s in (2, 0)]
    for locs, twin_locs, start in runs:
        device_frees = defaultdict(list)
        full.evict_component(_node(start + 3, locs), device_frees, {}, [])  # phase 5 = class 2, 3 = 0
        (queued,) = device_frees[ComponentType.FULL]
        alloc.free_segment(queued, start_pos=0)
        twin.free(twin_locs)
    assert frees.counters.from_phase == 2 and frees.counters.read_back == 0
    assert _same_state(alloc, twin) == []
    # a tensor it did not queue (an insert's duplicate, a request's tail): upstream's free, counted
    extra = alloc.alloc_cyclic(1, 2 * P)
    twin_extra = twin.alloc_cyclic(1, 2 * P)
    alloc.free_segment(extra.clone(), start_pos=0)
    twin.free(twin_extra)
    assert frees.counters.read_back == 1 and _same_state(alloc, twin) == []
    # a queued node freed while a free group is open: split at once, held
    # until the group ends, then freed as upstream's one free of the group
    locs, twin_locs = alloc.alloc_cyclic(0, 2 * P), twin.alloc_cyclic(0, 2 * P)
    device_frees = defaultdict(list)
    full.evict_component(_node(3, locs), device_frees, {}, [])
    alloc.free_group_begin(), twin.free_group_begin()
    alloc.free_segment(device_frees[ComponentType.FULL][0], start_pos=0)
    twin.free(twin_locs)
    # nothing freed before the group ends (upstream's group list holds its copy, ours the split)
    assert _same_state(alloc, twin) == ["free_group"]
    alloc.free_group_end(), twin.free_group_end()
    assert frees.counters.from_phase == 3 and frees.counters.held_in_group == 1 and frees.counters.read_back == 1
    assert _same_state(alloc, twin) == [] and frees._queued == {}


@settings(max_examples=80, deadline=None)
@given(n=st.sampled_from([2, 3, 4, 8]), need_sort=st.booleans(), grouped=st.booleans(), data=st.data())
def test_slices_of_an_open_run_are_freed_from_its_rotation(n, need_sort, grouped, data):
    """A request's row (int32, one row of a 2-D pool) or an insert's value:
    page-aligned slices of it, the last page possibly partial, freed while
    the run is open, leave the allocator as upstream's free leaves it -- in
    a free group too, where they are held until the group ends."""
    alloc, twin, frees = _frees_on_a_full_stand_in(n, 8, need_sort)
    base = data.draw(st.integers(0, n - 1))
    pages = data.draw(st.integers(1, 3 * n))
    run, twin_run = alloc.alloc_cyclic(base, pages * P), twin.alloc_cyclic(base, pages * P)
    assert torch.equal(run, twin_run)
    as_row = data.draw(st.booleans())
    rows = torch.zeros((3, pages * P + 5), dtype=torch.int32)
    if as_row:
        rows[2, : pages * P] = run.to(torch.int32)
        locs = rows[2]
    else:
        locs = run.clone()
    # consecutive page-aligned pieces; the last may stop inside its last page
    cuts = sorted(set(data.draw(st.lists(st.integers(1, pages - 1), max_size=3)) if pages > 1 else []))
    bounds = [0] + [c * P for c in cuts] + [pages * P - data.draw(st.integers(0, P - 1))]
    if grouped:
        alloc.free_group_begin(), twin.free_group_begin()
    with frees.run(locs, base, "request" if as_row else "duplicate"):
        for a, b in zip(bounds, bounds[1:]):
            alloc.free_segment(locs[a:b], start_pos=a)
            twin.free(twin_run[a:b].clone())
    if grouped:
        alloc.free_group_end(), twin.free_group_end()
    assert frees.counters.read_back == 0
    assert frees.counters.request_from_phase + frees.counters.duplicates_from_phase == len(bounds) - 1
    assert _same_state(alloc, twin) == []


def test_a_free_that_is_not_a_slice_of_the_open_run_goes_to_upstream():
    alloc, twin, frees = _frees_on_a_full_stand_in(2, 8, True)
    run, twin_run = alloc.alloc_cyclic(1, 4 * P), twin.alloc_cyclic(1, 4 * P)
    with frees.run(run, 1, "request"):
        alloc.free_segment(run[P // 2 : P], start_pos=0)  # not from a page start: not phase-known
        twin.free(twin_run[P // 2 : P].clone())
        alloc.free_segment(run[P : 2 * P].clone(), start_pos=P)  # a copy: another storage
        twin.free(twin_run[P : 2 * P].clone())
        alloc.free_segment(run[2 * P :: 2], start_pos=2 * P)  # strided
        twin.free(twin_run[2 * P :: 2].clone())
    assert frees.counters.read_back == 3 and frees.counters.request_from_phase == 0
    assert _same_state(alloc, twin) == []
    # after the run closes, a slice of it is no longer known either
    more, twin_more = alloc.alloc_cyclic(0, 2 * P), twin.alloc_cyclic(0, 2 * P)
    with frees.run(more, 0, "duplicate"):
        pass
    alloc.free_segment(more[:P], start_pos=0), twin.free(twin_more[:P].clone())
    assert frees.counters.read_back == 4 and _same_state(alloc, twin) == []
    with pytest.raises(ValueError, match="kind must be one of"):
        with frees.run(more, 0, "evicted"):
            pass
    with pytest.raises(ValueError, match="start_class must be in \\[0, 2\\), got 2"):
        with frees.run(more, 2, "request"):
            pass


def test_a_group_with_upstreams_own_deferrals_frees_everything_as_upstream():
    alloc, twin, frees = _frees_on_a_full_stand_in(3, 8, False)
    run, twin_run = alloc.alloc_cyclic(2, 5 * P), twin.alloc_cyclic(2, 5 * P)
    other, twin_other = alloc.alloc_cyclic(0, 3 * P), twin.alloc_cyclic(0, 3 * P)
    alloc.free_group_begin(), twin.free_group_begin()
    with frees.run(run, 2, "request"):
        alloc.free_segment(run[P:], start_pos=P)
    twin.free(twin_run[P:].clone())
    alloc.free_segment(other.clone(), start_pos=0)  # unknown: upstream defers it in the group
    twin.free(twin_other.clone())
    alloc.free_group_end(), twin.free_group_end()
    assert frees.counters.request_from_phase == 1 and frees.counters.read_back == 1  # the group's one free
    assert _same_state(alloc, twin) == []


def test_a_host_only_eviction_queues_nothing():
    from collections import defaultdict

    alloc, _, full, frees = _wired(2)
    locs = alloc.alloc_cyclic(0, 2 * P)
    device_frees = defaultdict(list)
    full.evict_component(_node(0, locs), device_frees, {}, [], target=EvictLayer.HOST)
    assert frees._queued == {} and not device_frees[ComponentType.FULL]


def test_wiring_arguments():
    alloc = _allocator(2, 4, True)
    cache = SimpleNamespace(components={ComponentType.FULL: _Full()}, tree_core=None)
    with pytest.raises(TypeError, match="placement must be a CpPlacement, got tuple"):
        PhaseKnownDeviceFrees(cache, alloc, (P, 2, 0))
    with pytest.raises(ValueError, match="differ from the placement"):
        PhaseKnownDeviceFrees(cache, alloc, CpPlacement(P, 3, 0))
