"""CP placement: logical token locations <-> (owner rank, physical slot).

Page interleave, the same bijection as SGLang's merged kv-shard placement::

    page(loc)        = loc // P
    owner(loc)       = page(loc) % N
    physical(loc)    = (page(loc) // N) * P + loc % P        (on rank owner(loc))
    logical(phys, r) = ((phys // P) * N + r) * P + phys % P

Every method is pure tensor arithmetic on the input's device: no mask is
materialised on the host and nothing synchronises with the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_cp_hicache.validation import check_int, check_int_tensor as _check_locs

__all__ = ["DSA_PAGE_SIZE", "CpPlacement", "page_owner", "phase_owner"]

#: Tokens per KV page of SGLang's DSA pools: ``DSATokenToKVPool`` accepts no
#: other page size outside ROCm, and the DSA indexer stores whole pages.
DSA_PAGE_SIZE = 64


def page_owner(page, cp_size: int):
    """The CP rank that owns logical page(s) ``page`` (an int or a tensor of
    page ids): ``page % cp_size``. The one place the page-interleave owner
    rule is written; everything else asks here."""
    return page % cp_size


def phase_owner(phase: int, cp_size: int, page: int = 0) -> int:
    """The owner class of page ``page`` of an owner-cyclic run whose first
    page sits at rotation phase ``phase``: ``(phase + page) % cp_size``.

    SGLang 0.5.23's KV sharding draws every chain of pages (a tree path, a
    request's kv row, an L3 chain) owner-cyclically: a chain starts at its
    rotation base, a node or slice at the base plus its depth in pages (its
    phase), and each page after it belongs to the next class. Phases count
    pages, so this is :func:`page_owner` of the phase's page. The one place
    the phase -> owner class rule is written."""
    return page_owner(phase + page, cp_size)


@dataclass(frozen=True)
class CpPlacement:
    """Page-interleaved ownership of a logical KV pool across ``cp_size`` ranks."""

    page_size: int
    cp_size: int
    cp_rank: int

    def __post_init__(self) -> None:
        for name in ("page_size", "cp_size", "cp_rank"):
            check_int(name, getattr(self, name))
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.cp_size < 1:
            raise ValueError(f"cp_size must be >= 1, got {self.cp_size}")
        if not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(
                f"cp_rank must be in [0, cp_size={self.cp_size}), got {self.cp_rank}"
            )

    # ---- logical -> physical -------------------------------------------------
    def owner_of(self, locs: torch.Tensor) -> torch.Tensor:
        """Rank that owns each logical token location."""
        _check_locs("locs", locs)
        return page_owner(torch.div(locs, self.page_size, rounding_mode="floor"), self.cp_size)

    def owned_by_this_rank(self, locs: torch.Tensor) -> torch.Tensor:
        """Bool mask: which logical locations this rank owns."""
        return self.owner_of(locs) == self.cp_rank

    def logical_locs_to_physical(self, locs: torch.Tensor) -> torch.Tensor:
        """Physical slot of each logical location on its owner rank.

        Callers pass locations this rank owns; for others the result is the
        slot on *their* owner, which is meaningless here.
        """
        _check_locs("locs", locs)
        page = torch.div(locs, self.page_size, rounding_mode="floor")
        return (
            torch.div(page, self.cp_size, rounding_mode="floor") * self.page_size
            + locs % self.page_size
        )

    # ---- physical -> logical -------------------------------------------------
    def physical_locs_to_logical(self, phys: torch.Tensor) -> torch.Tensor:
        """Logical location of each of this rank's physical slots."""
        _check_locs("phys", phys)
        phys_page = torch.div(phys, self.page_size, rounding_mode="floor")
        return (phys_page * self.cp_size + self.cp_rank) * self.page_size + phys % self.page_size

    # ---- sizes ---------------------------------------------------------------
    def owned_pages(self, logical_num_pages: int) -> int:
        """How many of logical pages [0, logical_num_pages) this rank owns."""
        check_int("logical_num_pages", logical_num_pages, 0)
        if logical_num_pages <= self.cp_rank:
            return 0
        return (logical_num_pages - self.cp_rank + self.cp_size - 1) // self.cp_size

    def physical_size(self, logical_size: int) -> int:
        """Physical slots this rank needs to hold its share of a logical pool.

        A partial last page still takes a whole physical page.
        """
        check_int("logical_size", logical_size, 0)
        num_pages = (logical_size + self.page_size - 1) // self.page_size
        return self.owned_pages(num_pages) * self.page_size
