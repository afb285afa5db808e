"""Split a freed cyclic run of device pages by owner class without reading it.

A page-interleaved allocator keeps one free list per owner class (page mod
N). Freeing locs means: their distinct pages, split by class, each class's
pages ascending. Done on the values themselves (a ``unique`` and one boolean
mask per class) that is a device-to-host read per free on a GPU: the output
sizes depend on the data. The locs of a tree node, of an insert's duplicate
or of a request's own pages are one cyclic run of pages (the last one
possibly partial), so how many fall in each class follows from the run's
first class and its length alone (host ints). With those counts known, the
split is fixed-shape device work: two sorts and a split, nothing read.

Torch only (no SGLang); the locs may live on any device.
"""

from __future__ import annotations

import torch

from sglang_cp_hicache.placement import page_owner
from sglang_cp_hicache.policy_0523.host_room import cyclic_class_counts
from sglang_cp_hicache.validation import check_1d_int_tensor, check_int

__all__ = ["cyclic_pages_by_class", "run_pages"]


def run_pages(num_locs: int, page_size: int) -> int:
    """Pages a run of ``num_locs`` locs from a page start covers (the last
    one possibly partial, as the allocator frees the whole page)."""
    check_int("num_locs", num_locs, 0)
    check_int("page_size", page_size, 1)
    return -(-num_locs // page_size)


def cyclic_pages_by_class(
    locs: torch.Tensor, *, page_size: int, cp_size: int, start_class: int
) -> list[torch.Tensor]:
    """``locs`` (token locs from a page start, each page's tokens contiguous,
    the last page possibly partial, pages drawn owner-cyclically from
    ``start_class``) as one tensor of page ids per owner class, ascending,
    on ``locs``' device.

    Equal to ``pages = unique(locs // page_size)`` split by ``pages % cp_size``
    whenever the pages really are that cyclic run of distinct pages; the
    caller vouches for that (the allocator drew them so). Never reads
    ``locs`` on the host.
    """
    check_1d_int_tensor("locs", locs)
    check_int("page_size", page_size, 1)
    check_int("cp_size", cp_size, 1)
    check_int("start_class", start_class, 0, cp_size - 1)
    counts = cyclic_class_counts(start_class, run_pages(locs.numel(), page_size), cp_size)
    # One loc per page: the run starts on a page start, so every page_size-th
    # loc is a page's first token.
    pages = torch.div(locs[::page_size].long(), page_size, rounding_mode="floor")
    ascending = torch.sort(pages).values
    # A stable sort by class keeps each class's pages ascending.
    by_class = ascending[torch.sort(page_owner(ascending, cp_size), stable=True).indices]
    return list(torch.split(by_class, counts))
