"""Splitting a freed cyclic run by owner class without reading it
(``sglang_cp_hicache.policy_0523.device_free``): equal to ``unique`` + one mask
per class, as SGLang 0.5.23's ``PageInterleavePoolAllocator.free`` computes it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_cp_hicache.policy_0523.device_free import cyclic_pages_by_class, run_pages


def _upstream_split(locs: torch.Tensor, page_size: int, n: int) -> list[torch.Tensor]:
    pages = torch.unique(locs.long() // page_size)
    return [pages[pages % n == r] for r in range(n)]


class _Unreadable(torch.Tensor):
    """Raises on every host read of its values (what a GPU sync would be)."""

    READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
             torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.nonzero, torch.nonzero, torch.unique,
             torch.Tensor.unique, torch.Tensor.masked_select, torch.masked_select, torch.equal,
             torch.Tensor.numpy, torch.Tensor.__repr__}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        bool_index = func is torch.Tensor.__getitem__ and isinstance(args[1], torch.Tensor) \
            and args[1].dtype == torch.bool
        if func in cls.READS or bool_index:
            raise AssertionError(f"host read: {getattr(func, '__name__', func)}")
        return super().__torch_function__(func, types, args, kwargs or {})


def _cyclic_run(draw, n: int, page_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    start = draw(st.integers(0, n - 1))
    pages = draw(st.integers(0, 12))
    # distinct page ids of the right class for each position, in any order within a class
    rows = draw(st.lists(st.integers(0, 30), min_size=pages, max_size=pages, unique=True))
    ids = [row * n + (start + j) % n for j, row in enumerate(rows)]
    offsets = torch.arange(page_size)
    locs = torch.cat([torch.tensor([p * page_size]) + offsets for p in ids]) if ids else torch.empty(0)
    # a request's row may end inside its last page: the allocator frees that page whole
    cut = draw(st.integers(0, page_size - 1)) if ids else 0
    return locs[: locs.numel() - cut].to(dtype), start


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 8), page_size=st.sampled_from([1, 2, 4, 64]), dtype=st.sampled_from([torch.int64, torch.int32]),
       data=st.data())
def test_the_split_equals_upstreams_unique_and_masks(n, page_size, dtype, data):
    locs, start = _cyclic_run(data.draw, n, page_size, dtype)
    got = cyclic_pages_by_class(locs.as_subclass(_Unreadable), page_size=page_size, cp_size=n, start_class=start)
    want = _upstream_split(locs, page_size, n)
    assert len(got) == n
    for g, w in zip(got, want):
        g = g.as_subclass(torch.Tensor)
        assert g.dtype == w.dtype == torch.int64 and torch.equal(g, w)


def test_it_reads_nothing_and_the_reader_catches_reads():
    locs = torch.arange(3 * 4).as_subclass(_Unreadable)  # pages 0, 1, 2 from class 0 at N 3
    out = cyclic_pages_by_class(locs, page_size=4, cp_size=3, start_class=0)
    assert [t.numel() for t in out] == [1, 1, 1]
    with pytest.raises(AssertionError, match="host read"):
        torch.unique(locs)
    with pytest.raises(AssertionError, match="host read"):
        locs[locs > 2]


def test_a_partial_last_page_is_one_page_of_its_class():
    # pages 10 (class 1 of 3) and 11 (class 2) whole, page 12 (class 0) with 2 of its 4 tokens
    locs = (torch.arange(10 * 4, 12 * 4 + 2)).as_subclass(_Unreadable)
    got = cyclic_pages_by_class(locs, page_size=4, cp_size=3, start_class=1)
    assert [g.as_subclass(torch.Tensor).tolist() for g in got] == [[12], [10], [11]]
    assert run_pages(10, 4) == 3 and run_pages(8, 4) == 2 and run_pages(0, 4) == 0


def test_bad_arguments_are_refused_by_name():
    locs = torch.arange(8)
    with pytest.raises(ValueError, match="num_locs must be >= 0"):
        run_pages(-1, 4)
    with pytest.raises(ValueError, match="start_class must be <= 1"):
        cyclic_pages_by_class(locs, page_size=4, cp_size=2, start_class=2)
    with pytest.raises(TypeError, match="locs must be an integer tensor"):
        cyclic_pages_by_class(locs.float(), page_size=4, cp_size=2, start_class=0)
