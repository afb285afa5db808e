"""SGLang-compatible CP shared KV token allocator (owner lanes, logical pages).

Wraps :class:`sglang_cp_hicache.policy_0518.allocator.OwnerLaneAllocator` behind SGLang's
``BaseTokenToKVPoolAllocator`` interface (constructor: logical and physical
sizes, page size, dtype, device, kvcache, need_sort, cp_size, cp_rank).
Allocations are decided on the CPU, so page owners are known there without
reading anything back from the GPU.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

from sglang_cp_hicache.policy_0518.allocator import AllocatorCheckpoint, OwnerLaneAllocator, PageAllocation
from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.sglang_0518.request_rows import ExtendSegment, RequestRows

__all__ = ["CpSharedPagedTokenToKVPoolAllocator"]


class CpSharedPagedTokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """Logical-page allocator shared (identically) by every CP rank.

    ``logical_size`` tokens of logical pool (pages 1..logical_size/page_size;
    page 0 is padding); this rank's device pool (``kvcache``) holds
    ``physical_size`` slots: its share of those pages.
    """

    def __init__(
        self,
        logical_size: int,
        physical_size: int,
        page_size: int,
        dtype: torch.dtype,
        device: str,
        kvcache,
        need_sort: bool,
        cp_size: int,
        cp_rank: int,
    ) -> None:
        super().__init__(logical_size, page_size, dtype, device, kvcache, need_sort)
        # The rank and CP size live here only (read through the properties below).
        self.placement = CpPlacement(page_size, cp_size, cp_rank)
        self.physical_size = physical_size
        self._lanes = OwnerLaneAllocator(logical_size, page_size, cp_size, device=device)
        # The CP cache's per-request page rows (None: no cache listens).
        self._rows: Optional[RequestRows] = None
        self.num_pages = self._lanes.num_pages
        # Logical pages 0..num_pages live on this rank at physical pages < needed.
        needed = self.placement.physical_size((self.num_pages + 1) * page_size)
        if physical_size < needed:
            raise ValueError(
                f"physical_size={physical_size} is too small: cp_rank {cp_rank} owns "
                f"{needed // page_size} of the {self.num_pages + 1} logical pages "
                f"({needed} slots)"
            )
        if kvcache is not None and getattr(kvcache, "size", physical_size) < physical_size:
            raise ValueError(
                f"kvcache holds {kvcache.size} slots, fewer than physical_size={physical_size}"
            )

    @property
    def cp_rank(self) -> int:
        return self.placement.cp_rank

    @property
    def cp_size(self) -> int:
        return self.placement.cp_size

    @staticmethod
    def physical_size_for(logical_size: int, page_size: int, cp_size: int) -> int:
        """Per-rank device pool size that fits every rank's share (equal on
        all ranks, so host pools sized from it are equal too)."""
        pages = logical_size // page_size + 1  # + the padding page
        return -(-pages // cp_size) * page_size

    # ---- BaseTokenToKVPoolAllocator -------------------------------------
    def clear(self) -> None:
        self._lanes.clear()
        self.is_not_in_free_group = True
        self.free_group = []

    def available_size(self) -> int:
        return self._lanes.available_size()

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        return self._lanes.alloc(need_size)

    def alloc_mirrored(self, need_size: int) -> Optional[PageAllocation]:
        """:meth:`alloc` plus the CPU mirror of the pages (for
        ``CpInsertParams.value_pages``)."""
        return self._lanes.alloc_mirrored(need_size)

    def alloc_with_owners_mirrored(self, owners: Sequence[int]) -> Optional[PageAllocation]:
        return self._lanes.alloc_with_owners_mirrored(owners)

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if self.is_not_in_free_group:
            self._lanes.free(free_index)
        else:
            self.free_group.append(self._copy_for_free_group(free_index))

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """SGLang frees slices of a request's row this way: while the CP cache
        serves that request's ``cache_*_req``, its CPU row names the pages
        (no device read); otherwise upstream's ``free`` (which reads them)."""
        pages = None if self._rows is None else self._rows.pages_to_free(start_pos, free_index.numel())
        if pages is None:
            self.free(free_index)
        else:
            self.free_mirrored(pages)

    def set_request_rows(self, rows: Optional[RequestRows]) -> None:
        """Report extend and decode allocations to ``rows`` (the CP cache's)."""
        self._rows = rows

    def free_mirrored(self, pages: torch.Tensor) -> None:
        """Free logical pages named by their CPU mirror (no device read)."""
        if self.is_not_in_free_group:
            self._lanes.free_mirrored(pages)
        else:
            P = self.page_size
            locs = (pages.to(torch.int64)[:, None] * P + torch.arange(P)).reshape(-1)
            self.free_group.append(locs)

    def merge_and_sort_free(self) -> None:
        self._lanes.merge_free()

    def checkpoint(self) -> AllocatorCheckpoint:
        return self._lanes.checkpoint()

    def rollback(self, checkpoint: AllocatorCheckpoint) -> None:
        self._lanes.rollback(checkpoint)

    def commit(self, checkpoint: AllocatorCheckpoint) -> None:
        self._lanes.commit(checkpoint)

    @property
    def rr_cursor(self) -> int:
        """Where the next allocation's round-robin starts (identical on every rank)."""
        return self._lanes._rr_cursor

    def rewind_rr_cursor(self, cursor: int) -> None:
        """Put the round-robin back where it was before a step's load-backs:
        a step that raised frees what they and the requests built on them
        allocated, and a rank that allocated differently in that step (its
        own allocation failed) must pick lanes like every other rank again."""
        if not isinstance(cursor, int) or not 0 <= cursor < self.cp_size:
            raise ValueError(f"cursor must be an int in [0, {self.cp_size}), got {cursor!r}")
        self._lanes._rr_cursor = cursor

    # ---- paged extend/decode for the scheduler ----------------------------
    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        num_new_pages: Optional[int] = None,
    ) -> Optional[torch.Tensor]:
        """Per request: fill the partial last page, then whole new pages."""
        P = self.page_size
        prefix = prefix_lens_cpu.tolist()
        seq = seq_lens_cpu.tolist()
        last = last_loc.to("cpu").tolist()
        new_pages = [(-(-s // P)) - (-(-p // P)) for p, s in zip(prefix, seq)]
        asked = sum(s - p for p, s in zip(prefix, seq))
        if asked != extend_num_tokens:  # checked before taking anything: no leak
            raise ValueError(
                f"extend_num_tokens={extend_num_tokens} but the lengths ask for {asked}"
            )
        if sum(new_pages) > self._lanes.available_pages():
            return None
        got = self._lanes.alloc_mirrored(sum(new_pages) * P)
        fresh_pages = got.pages.tolist()  # the CPU mirror: no read of the device locs
        out: list[int] = []
        segments: list[ExtendSegment] = []
        cursor = 0
        for p, s, l, k in zip(prefix, seq, last, new_pages):
            tail = min(s, -(-p // P) * P) - p  # tokens that fit in the open page
            out.extend(range(l + 1, l + 1 + tail))
            remaining = s - p - tail
            for page in fresh_pages[cursor : cursor + k]:
                take = min(P, remaining)
                out.extend(range(page * P, page * P + take))
                remaining -= take
            segments.append(ExtendSegment(p, s, fresh_pages[cursor : cursor + k]))
            cursor += k
        if self._rows is not None:
            self._rows.extended(segments)
        return torch.tensor(out, dtype=torch.int64, device=self.device)

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> Optional[torch.Tensor]:
        P = self.page_size
        seq = seq_lens_cpu.tolist()
        last = last_loc.to("cpu").tolist()
        need_new = [(s - 1) % P == 0 for s in seq]  # token s-1 starts a page
        count = sum(need_new)
        if count > self._lanes.available_pages():
            return None
        fresh_pages = iter(self._lanes.alloc_mirrored(count * P).pages.tolist() if count else [])
        steps = [((l // P), next(fresh_pages) if new else None) for new, l in zip(need_new, last)]
        if self._rows is not None:
            self._rows.decoded(steps)
        out = [page * P if page is not None else l + 1 for (_, page), l in zip(steps, last)]
        return torch.tensor(out, dtype=torch.int64, device=self.device)

    def set_lane_bias(self, lane_bias) -> None:
        """Per-rank load (identical on every rank) that ``alloc`` balances."""
        self._lanes.lane_bias = lane_bias

    def set_lane_reclaim(self, lane_reclaim) -> None:
        """``lane_reclaim(lane, pages) -> pages freed``: evicts until
        ``lane`` has ``pages`` free pages, when the least loaded lane is
        empty (identical on every rank)."""
        self._lanes.lane_reclaim = lane_reclaim

    @property
    def lane_reclaims(self) -> int:
        """Evictions made for a lane that was short (host balance)."""
        return self._lanes.lane_reclaims

    @property
    def uneven_picks(self) -> int:
        """Pages placed off balance because nothing of that lane was evictable."""
        return self._lanes.uneven_picks

    # ---- accounting (what SGLang prints on KV OOM) ------------------------
    def lane_available_pages(self) -> list[int]:
        return self._lanes.lane_available_pages()

    def allocator_state_str(self) -> str:
        return self._lanes.allocator_state_str()

    def pages_in_use(self) -> int:
        return self._lanes.pages_in_use()
