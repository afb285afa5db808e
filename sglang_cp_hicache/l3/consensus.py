"""Prefetch consensus: how many pages of a chain every rank may restore.

Each rank verifies only the pages it will own. Its *local* usable prefix is
the index of its first own page that is missing or rejected; pages owned by
others count as present, because their owners judge them. The MIN of the
local values over the CP group is then the index of the first page that
failed on its owner: a page missing on any rank is a miss for every rank
from that page on, and nothing past it is used. That MIN rides the
all-reduce SGLang already runs for a prefetch; no new collective.
"""

from __future__ import annotations

from collections.abc import Sequence

from sglang_cp_hicache.validation import check_int, check_int_list

__all__ = ["local_usable_pages"]


def _check_flags(name: str, flags: object, length: int) -> list[bool]:
    if isinstance(flags, (str, bytes)) or not isinstance(flags, Sequence):
        raise TypeError(f"{name} must be a list of bools, got {type(flags).__name__}")
    if len(flags) != length:
        raise ValueError(f"{name} must have one entry per owned page ({length}), got {len(flags)}")
    for i, flag in enumerate(flags):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}[{i}] must be a bool, got {type(flag).__name__}")
    return list(flags)


def local_usable_pages(
    owned_page_indices: Sequence[int], ok_flags: Sequence[bool], num_pages: int
) -> int:
    """This rank's usable prefix of a chain, in pages.

    ``owned_page_indices``: this rank's pages of the chain (strictly
    increasing, in ``[0, num_pages)``); ``ok_flags[j]``: page
    ``owned_page_indices[j]`` exists and verified. Returns the first owned
    index whose flag is False, else ``num_pages``.
    """
    check_int("num_pages", num_pages, 0)
    indices = check_int_list("owned_page_indices", owned_page_indices, minimum=0)
    flags = _check_flags("ok_flags", ok_flags, len(indices))
    previous = -1
    for j, index in enumerate(indices):
        if index <= previous or index >= num_pages:
            raise ValueError(
                f"owned_page_indices[{j}] must be in ({previous}, num_pages={num_pages}), "
                f"strictly increasing, got {index}"
            )
        previous = index
    for index, ok in zip(indices, flags):
        if not ok:
            return index
    return num_pages
