"""Which pages of a chain each CP rank writes to and reads from L3.

Only a page's owner touches it: on a write the owner stores the page (every
rank its own pages, disjoint keys, no writer election); on a prefetch the
rank that *will* own the page checks and fetches it. The owners come from the
adapter, chosen identically on every rank (0.5.23: the rotation phase,
``(base + i) % N`` = :func:`interleaved_owners`; 0.5.18: the balanced lane
choice, any list).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sglang_cp_hicache.l3.keys import check_page_key
from sglang_cp_hicache.placement import phase_owner
from sglang_cp_hicache.validation import check_int, check_int_list

__all__ = [
    "L3ReadPlan", "L3WritePlan", "interleaved_owners", "read_plan", "write_plan",
]


@dataclass(frozen=True)
class _OwnedPages:
    """This rank's pages of a chain of ``num_pages`` pages: their indices in
    the chain (strictly increasing) and their keys, in chain order."""

    cp_rank: int
    num_pages: int
    page_indices: tuple[int, ...]
    keys: tuple[str, ...]

    def __post_init__(self) -> None:
        check_int("cp_rank", self.cp_rank, 0)
        check_int("num_pages", self.num_pages, 0)
        if len(self.page_indices) != len(self.keys):
            raise ValueError(
                f"page_indices and keys must have one entry per page, got "
                f"{len(self.page_indices)} and {len(self.keys)}"
            )
        previous = -1
        for i, index in enumerate(self.page_indices):
            check_int(f"page_indices[{i}]", index, previous + 1, self.num_pages - 1)
            previous = index


@dataclass(frozen=True)
class L3WritePlan(_OwnedPages):
    """The pages of a chain this rank stores (host -> L3)."""


@dataclass(frozen=True)
class L3ReadPlan(_OwnedPages):
    """The pages of a chain this rank checks and fetches (L3 -> host)."""


def interleaved_owners(first_page: int, num_pages: int, cp_size: int) -> list[int]:
    """Owners of ``num_pages`` consecutive chain pages whose first page sits
    at page-interleave phase ``first_page`` (0.5.23: rotation base + the
    chain's page offset)."""
    check_int("first_page", first_page, 0)
    check_int("num_pages", num_pages, 0)
    check_int("cp_size", cp_size, 1)
    return [phase_owner(first_page, cp_size, i) for i in range(num_pages)]


def _check_chain(keys: Sequence[str], owners: Sequence[int], cp_size: int) -> list[int]:
    check_int("cp_size", cp_size, 1)
    if isinstance(keys, str) or not isinstance(keys, Sequence):
        raise TypeError(f"keys must be a list of page keys, got {type(keys).__name__}")
    owner_list = check_int_list("owners", owners, length=len(keys), minimum=0)
    for i, owner in enumerate(owner_list):
        if owner >= cp_size:
            raise ValueError(f"owners[{i}] must be < cp_size={cp_size}, got {owner}")
    seen: dict[str, int] = {}
    for i, key in enumerate(keys):
        check_page_key(f"keys[{i}]", key)
        if key in seen:
            raise ValueError(f"keys[{i}] repeats keys[{seen[key]}] ({key!r})")
        seen[key] = i
    return owner_list


def _owned(keys: Sequence[str], owners: list[int], cp_rank: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    indices = tuple(i for i, owner in enumerate(owners) if owner == cp_rank)
    return indices, tuple(keys[i] for i in indices)


def write_plan(keys: Sequence[str], owners: Sequence[int], cp_size: int, cp_rank: int) -> L3WritePlan:
    """This rank's pages of a chain to store: those it owns."""
    owner_list = _check_chain(keys, owners, cp_size)
    check_int("cp_rank", cp_rank, 0, cp_size - 1)
    return L3WritePlan(cp_rank, len(keys), *_owned(keys, owner_list, cp_rank))


def read_plan(keys: Sequence[str], owners: Sequence[int], cp_size: int, cp_rank: int) -> L3ReadPlan:
    """This rank's pages of a prefetch to check and fetch: those it will own.

    ``keys``/``owners``: the pages to prefetch, in chain order (page 0 = the
    first page not yet cached).
    """
    owner_list = _check_chain(keys, owners, cp_size)
    check_int("cp_rank", cp_rank, 0, cp_size - 1)
    return L3ReadPlan(cp_rank, len(keys), *_owned(keys, owner_list, cp_rank))
