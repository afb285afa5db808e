"""Owner-lane paged allocator over LOGICAL pages of a CP shared KV pool.

Logical page ``p`` lives on rank ``p % cp_size`` (its *lane*). The allocator
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

from typing import Callable, Optional, Sequence

import torch

__all__ = ["OwnerLaneAllocator"]


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class OwnerLaneAllocator:
    """Paged allocator with one free list per owner class (``page % cp_size``)."""

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
        # Optional per-lane load (e.g. host slots each rank holds): lanes with
        # less load are preferred. Must be identical on every rank.
        if not hasattr(self, "lane_bias"):
            self.lane_bias: Optional[Callable[[], Sequence[int]]] = None

    def lane_of_page(self, page: int) -> int:
        return page % self.cp_size

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
            self._free[lane] = sorted(self._free[lane] + self._release[lane])
            self._release[lane] = []

    def _pages_to_locs(self, pages: list[int]) -> torch.Tensor:
        p = torch.tensor(pages, dtype=torch.int64)
        locs = (p[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)
        return locs.to(self.device)

    def _take(self, lane: int, count: int) -> list[int]:
        if len(self._free[lane]) < count:
            self._merge_lane(lane)
        taken = self._free[lane][:count]
        del self._free[lane][:count]
        for page in taken:
            self._in_use[page] = 1
        return taken

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """Token locs for ``need_size`` tokens (a multiple of page_size), or None.

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
        order: list[int] = []
        cursor = self._rr_cursor
        n = self.cp_size
        for _ in range(need_pages):
            best = -1
            for i in range(n):
                lane = (cursor + i) % n
                if avail[lane] > 0 and (
                    best < 0
                    or (bias[lane], -avail[lane]) < (bias[best], -avail[best])
                ):
                    best = lane
            avail[best] -= 1
            if biased:  # count this call's pages towards the lane's load
                bias[best] += self.page_size
            order.append(best)
            cursor = (best + 1) % n
        self._rr_cursor = cursor
        return self._take_in_order(order)

    def _take_in_order(self, lanes_in_order: list[int]) -> torch.Tensor:
        counts = [0] * self.cp_size
        for lane in lanes_in_order:
            counts[lane] += 1
        taken = {lane: iter(self._take(lane, c)) for lane, c in enumerate(counts) if c}
        pages = [next(taken[lane]) for lane in lanes_in_order]
        return self._pages_to_locs(pages)

    def alloc_pages_with_owners(
        self, owners: Sequence[int] | torch.Tensor
    ) -> Optional[torch.Tensor]:
        """Token locs whose i-th page is owned by ``owners[i]``; None (state
        unchanged) when any lane is short."""
        if isinstance(owners, torch.Tensor):
            if owners.dtype.is_floating_point or owners.dtype.is_complex or owners.dtype == torch.bool:
                raise TypeError(f"owners must hold integers, got {owners.dtype}")
            if owners.dim() != 1:
                raise ValueError(f"owners must be 1-D, got shape {tuple(owners.shape)}")
            owners = owners.tolist()
        elif isinstance(owners, (str, bytes)) or not hasattr(owners, "__iter__"):
            raise TypeError(f"owners must be a sequence of ints, got {type(owners).__name__}")
        owner_list = []
        for o in owners:
            if isinstance(o, bool) or not isinstance(o, int):
                raise TypeError(f"owners must hold ints, got {type(o).__name__}")
            if not 0 <= o < self.cp_size:
                raise ValueError(f"owners must be in [0, cp_size={self.cp_size}), got {o}")
            owner_list.append(o)
        counts = [0] * self.cp_size
        for o in owner_list:
            counts[o] += 1
        avail = self.lane_available_pages()
        if any(c > a for c, a in zip(counts, avail)):
            return None
        if not owner_list:
            return torch.empty((0,), dtype=torch.int64, device=self.device)
        return self._take_in_order(owner_list)

    def free(self, free_index: torch.Tensor) -> None:
        """Release every page touched by ``free_index`` (deferred)."""
        if not isinstance(free_index, torch.Tensor):
            raise TypeError(f"free_index must be a torch.Tensor, got {type(free_index).__name__}")
        if free_index.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"free_index must be int32/int64, got {free_index.dtype}")
        if free_index.numel() == 0:
            return
        pages = torch.unique(
            torch.div(free_index.reshape(-1).to("cpu", torch.int64), self.page_size, rounding_mode="floor")
        ).tolist()
        for page in pages:
            if not 1 <= page <= self.num_pages:
                raise ValueError(
                    f"free_index holds page {page} outside [1, {self.num_pages}]"
                )
            if not self._in_use[page]:
                raise ValueError(f"free_index frees page {page}, which is not allocated")
        for page in pages:
            self._in_use[page] = 0
            self._release[page % self.cp_size].append(page)

    def is_page_in_use(self, page: int) -> bool:
        return bool(self._in_use[page])
