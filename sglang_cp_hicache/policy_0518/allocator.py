"""Owner-lane paged allocator over LOGICAL pages of a CP shared KV pool.

Logical page ``p`` lives on rank ``page_owner(p, cp_size)`` (its *lane*). The allocator
is identical on every rank and must be driven by the same call sequence on
every rank, so every decision is deterministic (no hashing, no timing).

* ``alloc(need_size)`` -- new prefill: each page from the least loaded lane
  (optional ``lane_bias``), then the one with the most free pages, then
  round-robin, so a sequence spreads evenly over the ranks.
* ``alloc_pages_with_owners(owners)`` -- load-back: page ``i`` of the result
  has owner ``owners[i]``, so restored data lands on the rank that holds it.
* ``free(locs)`` -- deferred: pages go to per-lane release lists that are
  merged into the free lists (sorted) only when an allocation needs them,
  as SGLang's paged allocator does with ``need_sort``.

Page 0 is reserved (SGLang uses slot 0 as padding).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from sglang_cp_hicache.placement import page_owner
from sglang_cp_hicache.validation import check_int as _check_int
from sglang_cp_hicache.validation import check_int_tensor

__all__ = ["AllocatorCheckpoint", "AllocatorSnapshot", "OwnerLaneAllocator", "PageAllocation"]

_CHECKPOINT_SERIALS = itertools.count(1)  # next() is atomic under the GIL: threaded ranks share it


@dataclass(frozen=True)
class PageAllocation:
    """Pages handed out by one allocation, twice: ``locs`` (token locations
    on the allocator's device, for SGLang) and ``pages`` (the same logical
    pages as CPU int64, the mirror that the write and load paths read so they
    never read device memory back)."""

    locs: torch.Tensor
    pages: torch.Tensor


@dataclass(frozen=True)
class AllocatorCheckpoint:
    """A point :meth:`OwnerLaneAllocator.rollback` can return to: the length
    of the undo log when it was taken, and the round-robin cursor then.
    ``serial`` names it (unique in the process), so a closed checkpoint, or
    another allocator's, cannot be mistaken for an open one at its depth."""

    log_len: int
    rr_cursor: int
    depth: int
    serial: int


@dataclass(frozen=True)
class AllocatorSnapshot:
    """Everything :meth:`OwnerLaneAllocator.restore` needs to undo allocations
    exactly (free-list order included), so a rank that undoes stays identical
    to ranks that never allocated."""

    free: tuple[tuple[int, ...], ...]
    release: tuple[tuple[int, ...], ...]
    in_use: bytes
    rr_cursor: int


class OwnerLaneAllocator:
    """Paged allocator with one free list per owner class (``page_owner(page, cp_size)``)."""

    def __init__(
        self,
        logical_size: int,
        page_size: int,
        cp_size: int,
        device: str | torch.device = "cpu",
    ) -> None:
        self.page_size = _check_int("page_size", page_size, 1)
        self.cp_size = _check_int("cp_size", cp_size, 1)
        _check_int("logical_size", logical_size, 0)
        if logical_size % page_size != 0:
            raise ValueError(
                f"logical_size must be a multiple of page_size={page_size}, got {logical_size}"
            )
        self.logical_size = logical_size
        self.num_pages = logical_size // page_size
        self.device = torch.device(device)
        self.clear()

    # ---- state ------------------------------------------------------------
    def clear(self) -> None:
        n = self.cp_size
        self._free: list[list[int]] = [
            list(range(r if r > 0 else n, self.num_pages + 1, n)) for r in range(n)
        ]
        self._release: list[list[int]] = [[] for _ in range(n)]
        # in_use[p] is 1 while page p is handed out; catches double frees.
        self._in_use = bytearray(self.num_pages + 1)
        self._in_use[0] = 1  # reserved padding page, never freed
        self._rr_cursor = 0
        # Undo log, kept only while a checkpoint is open: ("take", lane, pages),
        # ("merge", lane, old_free, old_release) or ("free", pages).
        self._undo: list[tuple] = []
        self._close_all_checkpoints()
        # Optional per-lane load (e.g. host slots each rank holds): lanes with
        # less load are preferred. Must be identical on every rank.
        if not hasattr(self, "lane_bias"):
            self.lane_bias: Optional[Callable[[], Sequence[int]]] = None
        # Optional: lane_reclaim(lane, pages) evicts until ``lane`` has
        # ``pages`` free pages (the CP cache evicts the least recently used
        # device leaves holding one), returning the pages freed. Called only
        # when the least loaded lane is empty and another lane would leave
        # some load more than one page from the mean; never under an open
        # checkpoint (a rollback cannot undo an eviction).
        if not hasattr(self, "lane_reclaim"):
            self.lane_reclaim: Optional[Callable[[int, int], int]] = None
        self.lane_reclaims = 0  # lane_reclaim calls that freed pages
        self.uneven_picks = 0  # pages placed off balance: nothing left to reclaim

    # ---- sizes -----------------------------------------------------------
    def immediate_available_pages(self) -> int:
        return sum(len(lane) for lane in self._free)

    def deferred_available_pages(self) -> int:
        return sum(len(lane) for lane in self._release)

    def available_pages(self) -> int:
        return self.immediate_available_pages() + self.deferred_available_pages()

    def available_size(self) -> int:
        """Tokens available now, counting pages whose release is deferred."""
        return self.available_pages() * self.page_size

    def immediate_available_size(self) -> int:
        return self.immediate_available_pages() * self.page_size

    def deferred_available_size(self) -> int:
        return self.deferred_available_pages() * self.page_size

    def lane_available_pages(self) -> list[int]:
        """Free pages (immediate + deferred) per owner lane."""
        return [len(f) + len(r) for f, r in zip(self._free, self._release)]

    def pages_in_use(self) -> int:
        return self.num_pages - self.available_pages()

    def allocator_state_str(self) -> str:
        return (
            "allocator_available_size="
            f"{self.available_size()} "
            f"(allocator_free_size={self.immediate_available_size()} "
            f"[free_pages={self.immediate_available_pages()}] + "
            f"allocator_release_size={self.deferred_available_size()} "
            f"[release_pages={self.deferred_available_pages()}])"
        )

    # ---- allocation -------------------------------------------------------
    def _merge_lane(self, lane: int) -> None:
        if self._release[lane]:
            if self._open_checkpoints:  # a merge is O(lane) work already: so is its undo
                self._undo.append(("merge", lane, self._free[lane], self._release[lane]))
            self._free[lane] = sorted(self._free[lane] + self._release[lane])
            self._release[lane] = []

    # ---- undo log: take back allocations in O(pages touched) ---------------
    @property
    def _open_checkpoints(self) -> int:
        return len(self._open_serials)

    def _close_all_checkpoints(self) -> None:
        # Serials are never reused, so a checkpoint from before clear() or
        # restore() stays closed.
        self._open_serials: list[int] = []
        self._undo.clear()

    def checkpoint(self) -> AllocatorCheckpoint:
        """Start (or nest) an undo log; :meth:`rollback` returns here exactly
        (free-list order included), :meth:`commit` keeps what happened since.
        Costs O(pages touched), unlike a :meth:`snapshot` of every free list."""
        serial = next(_CHECKPOINT_SERIALS)
        self._open_serials.append(serial)
        return AllocatorCheckpoint(len(self._undo), self._rr_cursor, len(self._open_serials), serial)

    def _check_innermost(self, checkpoint: object) -> AllocatorCheckpoint:
        """Only the innermost open checkpoint may close: closing another (one
        already closed, or an outer one) would end a newer owner's undo log."""
        if not isinstance(checkpoint, AllocatorCheckpoint):
            raise TypeError(f"checkpoint must be an AllocatorCheckpoint, got {type(checkpoint).__name__}")
        if checkpoint.serial not in self._open_serials:
            raise ValueError(
                f"checkpoint {checkpoint.serial} is not open on this allocator (committed, rolled back, "
                "cleared, or taken from another allocator); nothing was changed"
            )
        if checkpoint.serial != self._open_serials[-1]:
            raise ValueError(
                f"checkpoint {checkpoint.serial} is not the innermost open checkpoint of this allocator "
                f"(checkpoint {self._open_serials[-1]} was taken after it and is still open); close that "
                "one first; nothing was changed"
            )
        return checkpoint

    def _close(self, checkpoint: AllocatorCheckpoint) -> None:
        self._open_serials.pop()
        if not self._open_serials:
            self._undo.clear()

    def rollback(self, checkpoint: AllocatorCheckpoint) -> None:
        """Undo every allocation and free since ``checkpoint`` and close it.
        Refused (``ValueError``, nothing changed) unless ``checkpoint`` is the
        innermost open one."""
        self._check_innermost(checkpoint)
        while len(self._undo) > checkpoint.log_len:
            entry = self._undo.pop()
            if entry[0] == "take":
                _, lane, pages = entry
                self._free[lane][:0] = pages
                for page in pages:
                    self._in_use[page] = 0
            elif entry[0] == "merge":
                _, lane, old_free, old_release = entry
                self._free[lane], self._release[lane] = old_free, old_release
            else:  # "free": the pages went to the end of their release lists
                _, pages = entry
                for page in reversed(pages):
                    self._release[page_owner(page, self.cp_size)].pop()
                    self._in_use[page] = 1
        self._rr_cursor = checkpoint.rr_cursor
        self._close(checkpoint)

    def commit(self, checkpoint: AllocatorCheckpoint) -> None:
        """Keep everything since ``checkpoint`` and close it. Refused
        (``ValueError``, nothing changed) unless ``checkpoint`` is the
        innermost open one."""
        self._close(self._check_innermost(checkpoint))

    def snapshot(self) -> AllocatorSnapshot:
        return AllocatorSnapshot(
            tuple(tuple(x) for x in self._free), tuple(tuple(x) for x in self._release),
            bytes(self._in_use), self._rr_cursor,
        )

    def restore(self, snapshot: AllocatorSnapshot) -> None:
        if not isinstance(snapshot, AllocatorSnapshot):
            raise TypeError(f"snapshot must be an AllocatorSnapshot, got {type(snapshot).__name__}")
        if len(snapshot.free) != self.cp_size or len(snapshot.in_use) != self.num_pages + 1:
            raise ValueError("snapshot was taken from an allocator of another size")
        self._free = [list(x) for x in snapshot.free]
        self._release = [list(x) for x in snapshot.release]
        self._in_use = bytearray(snapshot.in_use)
        self._rr_cursor = snapshot.rr_cursor
        self._close_all_checkpoints()

    def merge_free(self) -> None:
        """Move every deferred release into the sorted free lists now."""
        for lane in range(self.cp_size):
            self._merge_lane(lane)

    def _allocation(self, pages: list[int]) -> PageAllocation:
        p = torch.tensor(pages, dtype=torch.int64)
        locs = (p[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)
        return PageAllocation(locs=locs.to(self.device), pages=p)

    def _take(self, lane: int, count: int) -> list[int]:
        if len(self._free[lane]) < count:
            self._merge_lane(lane)
        taken = self._free[lane][:count]
        del self._free[lane][:count]
        for page in taken:
            self._in_use[page] = 1
        if self._open_checkpoints:
            self._undo.append(("take", lane, taken))
        return taken

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """Token locs for ``need_size`` tokens (a multiple of page_size), or None."""
        got = self.alloc_mirrored(need_size)
        return None if got is None else got.locs

    def alloc_mirrored(self, need_size: int) -> Optional[PageAllocation]:
        """:meth:`alloc`, with the CPU mirror of the pages handed out.

        Each page comes from the lane with the least ``lane_bias`` load (when
        set; the CP cache sets it to every rank's host slots in use, so host
        backups stay balanced), then the most free pages, then round-robin
        from where the previous allocation stopped.
        """
        _check_int("need_size", need_size, 0)
        if need_size % self.page_size != 0:
            raise ValueError(
                f"need_size must be a multiple of page_size={self.page_size}, got {need_size}"
            )
        need_pages = need_size // self.page_size
        if need_pages > self.available_pages():
            return None
        avail = self.lane_available_pages()
        biased = self.lane_bias is not None
        bias = list(self.lane_bias()) if biased else [0] * self.cp_size
        reclaim = self.lane_reclaim if biased and not self._open_checkpoints else None
        order: list[int] = []
        planned = [0] * self.cp_size
        cursor = self._rr_cursor
        n = self.cp_size
        for _ in range(need_pages):
            best = self._pick_lane(bias, avail, cursor)
            if biased and bias[best] > min(bias) and self._off_balance(bias, best):
                # A less loaded lane has no free page, and skipping it moves
                # some lane more than a page from the mean load.
                behind = self._pick_lane(bias, [1] * n, cursor)  # least loaded, free or not
                if reclaim is not None and reclaim(behind, planned[behind] + 1) > 0:
                    self.lane_reclaims += 1
                    # Eviction freed pages (of any lane): recount what is left.
                    avail = [a - p for a, p in zip(self.lane_available_pages(), planned)]
                    best = self._pick_lane(bias, avail, cursor)
                if bias[best] > min(bias) and self._off_balance(bias, best):
                    self.uneven_picks += 1
            avail[best] -= 1
            planned[best] += 1
            if biased:  # count this call's pages towards the lane's load
                bias[best] += self.page_size
            order.append(best)
            cursor = (best + 1) % n
        self._rr_cursor = cursor
        return self._take_in_order(order)

    def _pick_lane(self, bias: list[int], avail: list[int], cursor: int) -> int:
        """The lane with free pages and the least load, then the most free
        pages, then the first from ``cursor`` (round-robin)."""
        best = -1
        for i in range(self.cp_size):
            lane = (cursor + i) % self.cp_size
            if avail[lane] > 0 and (
                best < 0 or (bias[lane], -avail[lane]) < (bias[best], -avail[best])
            ):
                best = lane
        return best

    def _off_balance(self, bias: list[int], lane: int) -> bool:
        """Whether one more page on ``lane`` leaves some lane's load more than
        one page from the mean load (the loads are in slots)."""
        loads = list(bias)
        loads[lane] += self.page_size
        n = self.cp_size
        total = sum(loads)
        # |load * n - total| > page_size * n, in integers
        return any(abs(x * n - total) > self.page_size * n for x in loads)

    def _take_in_order(self, lanes_in_order: list[int]) -> PageAllocation:
        counts = [0] * self.cp_size
        for lane in lanes_in_order:
            counts[lane] += 1
        taken = {lane: iter(self._take(lane, c)) for lane, c in enumerate(counts) if c}
        pages = [next(taken[lane]) for lane in lanes_in_order]
        return self._allocation(pages)

    def alloc_pages_with_owners(
        self, owners: Sequence[int] | torch.Tensor
    ) -> Optional[torch.Tensor]:
        """Token locs whose i-th page is owned by ``owners[i]``; None (state
        unchanged) when any lane is short."""
        got = self.alloc_with_owners_mirrored(owners)
        return None if got is None else got.locs

    def alloc_with_owners_mirrored(
        self, owners: Sequence[int] | torch.Tensor
    ) -> Optional[PageAllocation]:
        """:meth:`alloc_pages_with_owners`, with the CPU mirror of the pages."""
        if isinstance(owners, torch.Tensor):
            check_int_tensor("owners", owners)
            if owners.device.type != "cpu":
                raise ValueError(f"owners must be a CPU tensor (a host-side list of ranks), got {owners.device}")
            if owners.dim() != 1:
                raise ValueError(f"owners must be 1-D, got shape {tuple(owners.shape)}")
            owners = owners.tolist()
        elif isinstance(owners, (str, bytes)) or not hasattr(owners, "__iter__"):
            raise TypeError(f"owners must be a sequence of ints, got {type(owners).__name__}")
        owner_list = [_check_int("owners", o, 0, self.cp_size - 1) for o in owners]
        counts = [0] * self.cp_size
        for o in owner_list:
            counts[o] += 1
        avail = self.lane_available_pages()
        if any(c > a for c, a in zip(counts, avail)):
            return None
        if not owner_list:
            return self._allocation([])
        return self._take_in_order(owner_list)

    def free(self, free_index: torch.Tensor) -> None:
        """Release every page touched by ``free_index`` (deferred)."""
        if not isinstance(free_index, torch.Tensor):
            raise TypeError(f"free_index must be a torch.Tensor, got {type(free_index).__name__}")
        if free_index.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"free_index must be int32/int64, got {free_index.dtype}")
        if free_index.numel() == 0:
            return
        # SGLang's scheduler frees device tensors: this read is the one place
        # the allocator looks at device memory. The CP cache frees through
        # free_mirrored() with its CPU mirror instead.
        pages = torch.div(free_index.reshape(-1).to("cpu", torch.int64), self.page_size, rounding_mode="floor")
        self._free_pages("free_index", pages)

    def free_mirrored(self, pages: torch.Tensor) -> None:
        """Release logical pages given on the CPU (deferred); duplicates are
        one release. Checks every page first, so a bad call frees nothing."""
        check_int_tensor("pages", pages)
        if pages.device.type != "cpu":
            raise ValueError(f"pages must be a CPU tensor, got {pages.device}")
        self._free_pages("pages", pages)

    def _free_pages(self, name: str, pages: torch.Tensor) -> None:
        if pages.numel() == 0:
            return
        pages = torch.unique(pages.reshape(-1).to(torch.int64)).tolist()
        for page in pages:
            if not 1 <= page <= self.num_pages:
                raise ValueError(
                    f"{name} holds page {page} outside [1, {self.num_pages}]"
                )
            if not self._in_use[page]:
                raise ValueError(f"{name} frees page {page}, which is not allocated")
        for page in pages:
            self._in_use[page] = 0
            self._release[page_owner(page, self.cp_size)].append(page)
        if self._open_checkpoints:
            self._undo.append(("free", pages))
