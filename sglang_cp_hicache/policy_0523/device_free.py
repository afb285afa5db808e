"""Split a freed cyclic run of device pages by owner class without reading it.

A page-interleaved allocator keeps one free list per owner class (page mod
N). Freeing the locs of a tree node means: its distinct pages, split by
class, each class's pages ascending. Done on the values themselves (a
``unique`` and one boolean mask per class) that is a device-to-host read per
free on a GPU: the output sizes depend on the data. A node's pages are one
cyclic run of whole pages, so how many fall in each class follows from the
run's first class and its length alone (host ints). With those counts known,
the split is fixed-shape device work: two sorts and a split, nothing read.

Torch only (no SGLang); the locs may live on any device.
"""

from __future__ import annotations

import torch

from sglang_cp_hicache.policy_0523.host_room import cyclic_class_counts
from sglang_cp_hicache.validation import check_1d_int_tensor, check_int

__all__ = ["cyclic_pages_by_class"]


def cyclic_pages_by_class(
    locs: torch.Tensor, *, page_size: int, cp_size: int, start_class: int
) -> list[torch.Tensor]:
    """``locs`` (token locs of whole pages, page-aligned, each page's tokens
    contiguous, pages drawn owner-cyclically from ``start_class``) as one
    tensor of page ids per owner class, ascending, on ``locs``' device.

    Equal to ``pages = unique(locs // page_size)`` split by ``pages % cp_size``
    whenever the pages really are that cyclic run of distinct pages; the
    caller vouches for that (the allocator drew them so). Never reads
    ``locs`` on the host.
    """
    check_1d_int_tensor("locs", locs)
    check_int("page_size", page_size, 1)
    check_int("cp_size", cp_size, 1)
    check_int("start_class", start_class, 0, cp_size - 1)
    if locs.numel() % page_size:
        raise ValueError(f"locs must cover whole pages: {locs.numel()} locs, page_size {page_size}")
    counts = cyclic_class_counts(start_class, locs.numel() // page_size, cp_size)
    pages = torch.div(locs[::page_size].long(), page_size, rounding_mode="floor")
    ascending = torch.sort(pages).values
    # A stable sort by class keeps each class's pages ascending.
    by_class = ascending[torch.sort(ascending % cp_size, stable=True).indices]
    return list(torch.split(by_class, counts))
