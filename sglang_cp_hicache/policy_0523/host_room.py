"""Owner-aware host room for a backup on a KV-sharded (page-interleaved) host pool.

Under page-interleave KV sharding every host page has an owner class (page
mod N), and a backup's host slots are drawn owner-cyclically: page ``j`` of a
run that starts at class ``s`` needs a free host page of class
``(s + j) mod N``. Freeing host room by a token count frees least-recently-used
pages of whatever class they are, which may leave the run short of one class
while evictable pages of that class remain. These functions decide by class
instead: how many pages of each class a run needs, which classes are short,
whether evicting a host leaf (its pages' classes) frees anything of a short
class, and whether everything evictable together could make the run fit at
all (when it could not, the write fails either way and evicting would only
lose pages), and how short a tail of the last leaf is enough (the pages
before it cannot help, so they stay).

Pure functions of ints (no torch, no SGLang). Every CP rank holds the same
host allocator state and the same tree, so every rank reaches the same
decisions without asking the others.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Optional

from sglang_cp_hicache.placement import phase_owner
from sglang_cp_hicache.validation import check_int, check_int_list

__all__ = [
    "HostRoom", "class_counts_of", "covering_tail", "cyclic_class_counts", "plan_host_room", "reach_counts",
    "shortest_tail",
]


def cyclic_class_counts(start_class: int, pages: int, cp_size: int) -> list[int]:
    """Pages of each class a cyclic run of ``pages`` pages from ``start_class``
    draws (class ``c`` gets ``pages // N`` plus one if it is among the first
    ``pages % N`` classes from ``start_class``)."""
    check_int("cp_size", cp_size, 1)
    check_int("start_class", start_class, 0, cp_size - 1)
    check_int("pages", pages, 0)
    counts = [pages // cp_size] * cp_size
    for page in range(pages % cp_size):
        counts[phase_owner(start_class, cp_size, page)] += 1
    return counts


def class_counts_of(owners: Iterable[int], cp_size: int) -> list[int]:
    """How many of ``owners`` (one owner class per page) fall in each class."""
    check_int("cp_size", cp_size, 1)
    counts = [0] * cp_size
    for i, owner in enumerate(owners):
        counts[check_int(f"owners[{i}]", owner, 0, cp_size - 1)] += 1
    return counts


def reach_counts(leaf: Sequence[int], ancestors: Sequence[tuple[Sequence[int], bool]]) -> list[int]:
    """Pages of each class that evicting a host leaf is the way to: its own
    (``leaf``) plus those of its ancestors, nearest first, as long as each can
    be cleared (``ancestors``: (pages of each class, clearable) per ancestor;
    clearable: host-only, unlocked, every descendant likewise, so evicting
    leaves below it eventually makes it a leaf). A tree holds no child without
    its parent: a host page of an inner node is freed only after every leaf
    below it."""
    total = check_int_list("leaf", leaf, minimum=0)
    for i, (counts, clearable) in enumerate(ancestors):
        counts = check_int_list(f"ancestors[{i}]", counts, length=len(total), minimum=0)
        if not clearable:
            break
        total = [t + c for t, c in zip(total, counts)]
    return total


@dataclass
class HostRoom:
    """The pages of each class a run still lacks (``shortfall``).

    ``need``: pages of each class the run draws; ``free``: free host pages of
    each class now. :meth:`helps` says whether freeing pages of the given
    classes reduces the shortfall; :meth:`take` accounts for them.
    """

    need: list[int]
    free: list[int]
    shortfall: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.need = check_int_list("need", self.need, minimum=0)
        self.free = check_int_list("free", self.free, length=len(self.need), minimum=0)
        if not self.need:
            raise ValueError("need must have one entry per owner class, got none")
        self.shortfall = [max(n - f, 0) for n, f in zip(self.need, self.free)]

    @property
    def satisfied(self) -> bool:
        return not any(self.shortfall)

    @property
    def short_classes(self) -> list[int]:
        return [c for c, short in enumerate(self.shortfall) if short]

    def can_fit(self, reachable: Sequence[int]) -> bool:
        """True iff freeing ``reachable`` (every page of each class eviction
        could free) leaves the run short of nothing."""
        reachable = check_int_list("reachable", reachable, length=len(self.need), minimum=0)
        return all(r >= short for r, short in zip(reachable, self.shortfall))

    def helps(self, freed: Sequence[int]) -> bool:
        """True iff ``freed`` (pages of each class a leaf would free) holds a
        page of a class the run is short of."""
        freed = check_int_list("freed", freed, length=len(self.need), minimum=0)
        return any(short and got for short, got in zip(self.shortfall, freed))

    def take(self, freed: Sequence[int]) -> None:
        """Account for ``freed`` pages of each class becoming free."""
        freed = check_int_list("freed", freed, length=len(self.need), minimum=0)
        self.free = [f + g for f, g in zip(self.free, freed)]
        self.shortfall = [max(n - f, 0) for n, f in zip(self.need, self.free)]


def shortest_tail(room: HostRoom, owners: Sequence[int]) -> Optional[int]:
    """The fewest last pages of a leaf whose pages have owner classes
    ``owners`` (in key order) that make the run fit once freed, or None when
    even the whole leaf leaves it short. Only a tail can go: a tree keeps a
    prefix of a node as the parent of the rest, never the other way round."""
    if not isinstance(room, HostRoom):
        raise TypeError(f"room must be a HostRoom, got {type(room).__name__}")
    if isinstance(owners, (str, bytes)) or not isinstance(owners, Sequence):
        raise TypeError(f"owners must be a list of ints, got {type(owners).__name__}")
    owners = [check_int(f"owners[{i}]", owner, 0, len(room.need) - 1) for i, owner in enumerate(owners)]
    if room.satisfied:
        return 0
    short = list(room.shortfall)
    missing = sum(1 for s in short if s)
    for length, owner in enumerate(reversed(owners), start=1):
        if short[owner]:
            short[owner] -= 1
            missing -= int(short[owner] == 0)
            if not missing:
                return length
    return None


def covering_tail(room: HostRoom, owners: Sequence[int]) -> Optional[int]:
    """How many last pages of a leaf (owner classes ``owners``, in key order)
    to evict so the run fits: the shortest tail that does
    (:func:`shortest_tail`) when the pages left before it hold a page of
    every owner class, else the whole leaf; None when even the whole leaf
    leaves the run short.

    A kept prefix keeps the leaf's recency, the oldest. One lacking some
    class is passed over by every later run short only of classes it lacks,
    and those runs evict newer leaves (and the other-class pages in their
    tails) while its old pages stay. A prefix holding every class helps
    whichever class a later run is short of, so it goes first, in LRU
    order; with N classes that is a prefix of at least N cyclic pages."""
    tail = shortest_tail(room, owners)
    if tail is None or tail == 0:
        return tail
    kept = set(owners[: len(owners) - tail])
    return tail if len(kept) == len(room.need) else len(owners)


def plan_host_room(need: Sequence[int], free: Sequence[int], leaves: Sequence[Sequence[int]]) -> tuple[list[int], bool]:
    """Which of ``leaves`` (each: pages of each class it holds, in eviction
    order) to evict for a run needing ``need`` pages of each class with
    ``free`` free: every leaf, in order, that holds a page of a class still
    short, until none is short. Returns (indices of the leaves to evict,
    whether the run then fits). A leaf that frees nothing of a short class is
    never taken; when all the leaves together cannot make the run fit, none
    is (the write fails either way)."""
    room = HostRoom(list(need), list(free))
    counts = [check_int_list(f"leaves[{i}]", leaf, length=len(room.need), minimum=0) for i, leaf in enumerate(leaves)]
    if not room.can_fit([sum(col) for col in zip(*counts, [0] * len(room.need))]):
        return [], False
    taken: list[int] = []
    for i, leaf in enumerate(counts):
        if room.satisfied:
            break
        if room.helps(leaf):
            room.take(leaf)
            taken.append(i)
    return taken, room.satisfied
