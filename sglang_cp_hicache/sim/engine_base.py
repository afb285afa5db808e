"""What the simulator's rank engines share, whichever SGLang stack they
drive: CPU-time accounting, and writing / verifying / corrupting the
deterministic content of this rank's pages (:mod:`.content`)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.sim.content import corrupted_token_mask, write_content
from sglang_cp_hicache.sim.records import AckCounts

__all__ = ["RankEngineBase"]


class RankEngineBase:
    """Subclasses call :meth:`_bind_stack` first."""

    layout: CpPlacement
    kv_pool: Any
    page_size: int
    content_seed: int

    def _bind_stack(self, stack: Any, layout: CpPlacement, content_seed: int) -> None:
        """The stack's parts every engine uses, and zeroed accounting."""
        self.stack = stack
        self.cache = stack.cache
        self.allocator = stack.allocator
        self.kv_pool = stack.kv_pool
        self.page_size = stack.config.page_size
        self.layout = layout
        self.content_seed = content_seed
        self.acks = AckCounts()
        self.collective_cpu_seconds = 0.0  # inside the cache's all-reduce (part of cache_cpu_seconds)
        self.collective_calls = 0
        self.cache_cpu_seconds = 0.0
        self.content_cpu_seconds = 0.0
        self.indexer_pages_verified = 0  # every page check covers its indexer row too
        # Test hook: flip one byte ("kv" row or "indexer" row) of the next
        # restored page this rank owns.
        self.corrupt_next_restore = False
        self.corrupt_part = "kv"

    @contextmanager
    def _cache_time(self) -> Iterator[None]:
        start = time.process_time()
        try:
            yield
        finally:
            self.cache_cpu_seconds += time.process_time() - start

    @contextmanager
    def _content_time(self) -> Iterator[None]:
        start = time.process_time()
        try:
            yield
        finally:
            self.content_cpu_seconds += time.process_time() - start

    def _write(self, locs: torch.Tensor, keys: torch.Tensor) -> None:
        """Write the content of the tokens at ``locs`` that this rank owns."""
        mask = self.layout.owned_by_this_rank(locs)
        write_content(self.kv_pool, self.layout.logical_locs_to_physical(locs[mask]), keys[mask],
                      seed=self.content_seed)

    def _verify(self, locs: torch.Tensor, keys: torch.Tensor, restored_from: int) -> tuple[int, int, int]:
        """(owned pages checked, of which restored, corrupted) over ``locs``
        (page-aligned); tokens at ``>= restored_from`` were just loaded back."""
        if locs.numel() == 0:
            return 0, 0, 0
        P = self.page_size
        mask = self.layout.owned_by_this_rank(locs)
        if not bool(mask.any()):
            return 0, 0, 0
        bad = corrupted_token_mask(
            self.kv_pool, self.layout.logical_locs_to_physical(locs[mask]), keys[mask], seed=self.content_seed
        )
        page_of_token = torch.arange(locs.numel(), dtype=torch.int64)[mask] // P
        pages = torch.unique(page_of_token)
        bad_pages = torch.unique(page_of_token[bad])
        restored = int((pages * P >= restored_from).sum())
        self.indexer_pages_verified += int(pages.numel())
        return int(pages.numel()), restored, int(bad_pages.numel())

    def _corrupt_one_byte(self, restored_locs: torch.Tensor) -> None:
        mask = self.layout.owned_by_this_rank(restored_locs)
        if not bool(mask.any()):
            return  # wait for a restore that lands on this rank
        slot = int(self.layout.logical_locs_to_physical(restored_locs[mask][:1]))
        if self.corrupt_part == "indexer":
            self.kv_pool.index_k_with_scale_buffer[0][slot // self.page_size, 0] ^= 0x01
        else:
            self.kv_pool.kv_buffer[0].view(torch.uint8)[slot, 0, 0] ^= 0x01
        self.corrupt_next_restore = False

    def _root(self) -> Any:
        return self.cache.root_node

    def _nodes(self) -> list[Any]:
        """Every node of the tree but the root."""
        out, stack = [], [self._root()]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                out.append(child)
                stack.append(child)
        return out
