"""Malformed input: every public constructor and entry point answers wrong
dtypes, devices, shapes, negative and out-of-range values with ValueError or
TypeError naming the argument; stateful objects are unchanged afterwards."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.policy_0518.allocator import OwnerLaneAllocator
from sglang_cp_hicache.policy_0518.host_eviction import HostSlotLedger
from sglang_cp_hicache.policy_0518.metadata import CpHiCacheNodeMetadata
from sglang_cp_hicache.policy_0518.plan import plan_load, plan_write

# The count is kept in this process: under pytest-xdist the module's tests must
# all run on one worker, in file order, for test_report_count to see them.
pytestmark = pytest.mark.xdist_group("malformed_input")

TRIED = {"count": 0}

bad_scalars = st.one_of(
    st.integers(-(2**40), -1),
    st.booleans(),
    st.floats(allow_nan=True),
    st.none(),
    st.text(max_size=3),
    st.just(torch.tensor(3)),
)


def bad_tensors():
    return st.one_of(
        st.builds(lambda n: torch.zeros(n, dtype=torch.float32), st.integers(0, 4)),
        st.builds(lambda n: torch.zeros(n, dtype=torch.bool), st.integers(1, 4)),
        st.builds(lambda n: torch.zeros(n, n, dtype=torch.int64), st.integers(2, 3)),
        st.just([1, 2, 3]),
        st.just(None),
    )


def expect_named_error(name: str, fn, *args, **kwargs):
    TRIED["count"] += 1
    with pytest.raises((ValueError, TypeError)) as info:
        fn(*args, **kwargs)
    assert name in str(info.value), f"{name!r} not named in: {info.value}"


@given(field=st.sampled_from(["page_size", "cp_size", "cp_rank"]), value=bad_scalars)
def test_layout_constructor(field, value):
    kwargs = dict(page_size=4, cp_size=2, cp_rank=1)
    kwargs[field] = value
    if field == "cp_rank" and isinstance(value, int) and not isinstance(value, bool) and value < 0:
        expect_named_error("cp_rank", CpPlacement, **kwargs)
        return
    expect_named_error(field, CpPlacement, **kwargs)


@given(locs=bad_tensors().filter(lambda t: not (isinstance(t, torch.Tensor) and t.dim() > 1)),
       method=st.sampled_from(["owner_of", "owned_by_this_rank", "logical_locs_to_physical", "physical_locs_to_logical"]))
def test_layout_methods(locs, method):
    placement = CpPlacement(4, 2, 0)
    name = "phys" if method == "physical_locs_to_logical" else "locs"
    expect_named_error(name, getattr(placement, method), locs)


@given(
    field=st.sampled_from(["logical_len", "owned_positions", "host_indices", "token_owners"]),
    value=st.one_of(bad_scalars, bad_tensors()),
)
def test_metadata_constructor(field, value):
    kwargs = dict(logical_len=8, owned_positions=torch.tensor([1, 2]), host_indices=torch.tensor([5, 6]),
                  token_owners=torch.zeros(8, dtype=torch.int64))
    kwargs[field] = value
    if field == "token_owners" and value is None:
        return  # optional: None is valid
    expect_named_error(field if field != "logical_len" or not isinstance(value, torch.Tensor) else "logical_len",
                       CpHiCacheNodeMetadata, **kwargs)


@given(value=st.one_of(bad_scalars, st.integers(9, 100)))
def test_metadata_split(value):
    m = CpHiCacheNodeMetadata(8, torch.tensor([1, 2]), torch.tensor([5, 6]))
    before = (m.owned_positions.clone(), m.host_indices.clone())
    expect_named_error("split_len", m.split, value)
    assert torch.equal(m.owned_positions, before[0]) and torch.equal(m.host_indices, before[1])


def allocator_state(a: OwnerLaneAllocator):
    return (a.allocator_state_str(), a.lane_available_pages(), bytes(a._in_use), a._rr_cursor,
            [list(x) for x in a._free], [list(x) for x in a._release])


@given(
    call=st.sampled_from(["alloc", "owners", "free"]),
    value=st.one_of(bad_scalars, bad_tensors(), st.integers(1, 3), st.lists(st.integers(-3, 9), max_size=4),
                    st.lists(st.floats(), min_size=1, max_size=2)),
)
def test_allocator_entry_points_leave_state_unchanged(call, value):
    a = OwnerLaneAllocator(4 * 8, 4, 3)
    held = a.alloc(8)
    before = allocator_state(a)
    name = {"alloc": "need_size", "owners": "owners", "free": "free_index"}[call]
    fn = {"alloc": a.alloc, "owners": a.alloc_pages_with_owners, "free": a.free}[call]
    try:
        result = fn(value)
    except (ValueError, TypeError) as exc:
        TRIED["count"] += 1
        assert name in str(exc), f"{name!r} not named in: {exc}"
        assert allocator_state(a) == before, "failed call changed allocator state"
        return
    # Accepted only when the input was valid after all.
    if call == "alloc":
        assert isinstance(value, int) and value % 4 == 0 or result is None or value == 0
    elif call == "owners":
        assert all(isinstance(o, int) and 0 <= o < 3 for o in value)
    else:
        pytest.fail(f"free accepted {value!r}")
    del held


@given(bad=st.one_of(st.integers(-5, -1), st.just([-1, 0])))
def test_allocator_and_ledger_constructors(bad):
    if isinstance(bad, int):
        expect_named_error("logical_size", OwnerLaneAllocator, bad * 4, 4, 2)
        expect_named_error("cp_size", OwnerLaneAllocator, 16, 4, bad)
        expect_named_error("page_size", OwnerLaneAllocator, 16, bad, 2)
    else:
        expect_named_error("capacity", HostSlotLedger, bad)


@given(pages=st.one_of(bad_tensors(), st.just(torch.tensor([-1, 2])), st.just(torch.tensor([3, 5, 3]))))
def test_write_plan_pages(pages):
    # Malformed, negative or repeated pages (a page twice could never be restored).
    placement = CpPlacement(4, 2, 0)
    calls = []
    expect_named_error("pages", plan_write, placement, pages, torch.arange(12), lambda n: calls.append(n))
    assert calls == [], "host slots allocated for malformed input"


@given(locs=st.one_of(bad_tensors(), st.just(torch.arange(6))))
def test_write_plan_device_locs(locs):
    # Not a 1-D integer tensor, or not whole pages of the listed pages.
    placement = CpPlacement(4, 2, 0)
    calls = []
    expect_named_error("device_locs", plan_write, placement, torch.tensor([2, 3]), locs, lambda n: calls.append(n))
    assert calls == [], "host slots allocated for malformed input"


@given(bad=st.one_of(st.just([None]), st.just(["x"]), st.just([CpHiCacheNodeMetadata.empty(4)])))
def test_load_mapping(bad):
    placement = CpPlacement(4, 2, 0)
    a = OwnerLaneAllocator(4 * 8, 4, 2)
    before = allocator_state(a)
    name = "token_owners" if isinstance(bad[0], CpHiCacheNodeMetadata) else "metadata"
    expect_named_error(name, plan_load, placement, bad, a)
    assert allocator_state(a) == before


def test_report_count():
    # Run last in this module (pytest keeps file order): the figure for the note.
    print(f"malformed inputs tried: {TRIED['count']}")
    assert TRIED["count"] >= 300
