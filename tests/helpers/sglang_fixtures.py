"""Real SGLang 0.5.18 HiCache "rank stacks" on CPU, plus byte-exact content helpers.

A rank stack is what one scheduler rank owns for DSA HiCache: published
``ServerArgs``, a ``DSATokenToKVPool``, a ``PagedTokenToKVPoolAllocator``,
``CacheInitParams`` and the ``HiRadixCache`` built from them (with its
``HybridCacheController`` and ``HostPoolGroup`` of ``MLATokenToKVPoolHost`` +
``DSAIndexerPoolHost``). Sizes default small: one build takes well under a
second once SGLang is imported (``build_seconds`` records it).

The stack is :func:`sglang_cp_hicache.testing.stack_0518.build_cp_rank_stack` with
``cp_mode=False``; the content helpers are re-exported from
:mod:`sglang_cp_hicache.testing.content`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from sglang_cp_hicache.testing.stack_0518 import CpRankStack, CpStackConfig, build_cp_rank_stack

#: DSATokenToKVPool asserts page_size == 64 unless SGLang runs on ROCm.
DSA_PAGE_SIZE = 64


def RankStackConfig(host_pages: int = 16, **fields: Any) -> CpStackConfig:
    """A one-rank, non-CP stack configuration (plain HiRadixCache)."""
    return CpStackConfig(cp_size=1, cp_mode=False, host_pages=host_pages, **fields)


@dataclass
class RankStack:
    """One non-CP rank: the library's stack plus accessors the tests use."""

    inner: CpRankStack

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def controller(self):
        return self.cache.cache_controller

    @property
    def host_group(self):
        return self.cache.token_to_kv_pool_host

    @property
    def kv_host(self):
        return self.host_group.anchor_entry.host_pool

    @property
    def indexer_host(self):
        from sglang.srt.mem_cache.hicache_storage import PoolName

        return self.host_group.get_pool(PoolName.INDEXER)


def build_rank_stack(config: Optional[CpStackConfig] = None, **overrides: Any) -> RankStack:
    """Build one CPU rank stack (real HiRadixCache, DSA pool, plain paged
    allocator); keyword overrides replace ``config`` fields."""
    config = config or RankStackConfig()
    stack = RankStack(build_cp_rank_stack(config, 0, **overrides))
    if stack.kv_host.page_num != stack.config.host_pages:
        raise AssertionError(f"host pool has {stack.kv_host.page_num} pages, wanted {stack.config.host_pages}")
    return stack


@contextlib.contextmanager
def rank_stack(config: Optional[RankStackConfig] = None, **overrides: Any) -> Iterator[RankStack]:
    """:func:`build_rank_stack`, closed on exit."""
    stack = build_rank_stack(config, **overrides)
    try:
        yield stack
    finally:
        stack.close()


# ---------------------------------------------------------------------------
# Deterministic content
# ---------------------------------------------------------------------------

# Deterministic content lives in the library (the simulator uses it too).
from sglang_cp_hicache.testing.content import (  # noqa: E402,F401
    POISON_BYTE,
    content_mismatches,
    pattern_bytes,
    poison_device,
    poisoned_elsewhere,
    token_positions,
    write_content,
)
