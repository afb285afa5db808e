"""Real SGLang 0.5.18 HiCache "rank stacks" on CPU, plus byte-exact content helpers.

A rank stack is what one scheduler rank owns for DSA HiCache: published
``ServerArgs``, a ``DSATokenToKVPool``, a ``PagedTokenToKVPoolAllocator``,
``CacheInitParams`` and the ``HiRadixCache`` built from them (with its
``HybridCacheController`` and ``HostPoolGroup`` of ``MLATokenToKVPoolHost`` +
``DSAIndexerPoolHost``). Sizes default small: one build takes well under a
second once SGLang is imported (``build_seconds`` records it).

Content is a pure function of (token position, seed, layer), so bytes can be
checked after they moved to other device slots: ``write_content`` fills the
KV row and the indexer key/scale bytes of each location, ``content_mismatches``
lists every (pool, layer) whose bytes differ, bitwise (``torch.equal`` on
``uint8`` views: a bf16 NaN pattern must compare equal to itself).
"""

from __future__ import annotations

import atexit
import contextlib
import time
from dataclasses import dataclass, replace
from typing import Any, Iterator, Optional

import torch

from sglang_cp_hicache.sglang import cpu_support, env

#: DSATokenToKVPool asserts page_size == 64 unless SGLang runs on ROCm.
DSA_PAGE_SIZE = 64
POISON_BYTE = 0xA5


@dataclass(frozen=True)
class RankStackConfig:
    page_size: int = DSA_PAGE_SIZE
    num_layers: int = 2
    device_pages: int = 8
    # Exact number of host pages; when None the host size comes from
    # hicache_ratio (or hicache_size_gb, which overrides the ratio).
    host_pages: Optional[int] = None
    hicache_ratio: float = 2.0
    hicache_size_gb: int = 0
    host_layout: str = "layer_first"
    io_backend: str = "kernel"
    write_policy: str = "write_through"
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    index_head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16

    def ratio(self) -> float:
        if self.host_pages is None:
            return self.hicache_ratio
        if self.host_pages < 1:
            raise ValueError(f"host_pages must be >= 1, got {self.host_pages}")
        # HostKVCache: size = int(device_size * ratio); page_num = size // P + 1.
        # Half a page below the target keeps float rounding off the boundary.
        return (self.host_pages - 0.5) / self.device_pages


@dataclass
class RankStack:
    config: RankStackConfig
    server_args: Any
    kv_pool: Any  # DSATokenToKVPool
    allocator: Any  # PagedTokenToKVPoolAllocator
    params: Any  # CacheInitParams
    cache: Any  # HiRadixCache
    tp_group: Any
    build_seconds: float

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

    def close(self) -> None:
        """Drop the atexit hook HiRadixCache registers and its host buffers.

        The stack is unusable afterwards.
        """
        atexit.unregister(self.cache.shutdown)
        self.cache.release_host_resources()


def build_rank_stack(config: Optional[RankStackConfig] = None, **overrides: Any) -> RankStack:
    """Build one CPU rank stack; keyword overrides replace ``config`` fields."""
    config = replace(config or RankStackConfig(), **overrides)
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    start = time.perf_counter()
    cpu_support.install_cpu_support()
    server_args = env.make_cpu_server_args(
        page_size=config.page_size,
        hicache_mem_layout=config.host_layout,
        hicache_io_backend=config.io_backend,
        hicache_ratio=config.ratio(),
        hicache_size=config.hicache_size_gb,
        hicache_write_policy=config.write_policy,
    )
    env.publish_server_args(server_args)
    size = config.device_pages * config.page_size
    kv_pool = DSATokenToKVPool(
        size=size,
        page_size=config.page_size,
        kv_lora_rank=config.kv_lora_rank,
        dtype=config.dtype,
        qk_rope_head_dim=config.qk_rope_head_dim,
        layer_num=config.num_layers,
        device="cpu",
        index_head_dim=config.index_head_dim,
        enable_memory_saver=False,
        kv_cache_dim=config.kv_lora_rank + config.qk_rope_head_dim,
    )
    allocator = PagedTokenToKVPoolAllocator(
        size=size,
        page_size=config.page_size,
        dtype=config.dtype,
        device="cpu",
        kvcache=kv_pool,
        need_sort=False,
    )
    tp_group = env.make_local_gloo_group()
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=allocator,
        page_size=config.page_size,
        tp_cache_group=tp_group,
    )
    cache = HiRadixCache(params, server_args)
    stack = RankStack(
        config=config,
        server_args=server_args,
        kv_pool=kv_pool,
        allocator=allocator,
        params=params,
        cache=cache,
        tp_group=tp_group,
        build_seconds=time.perf_counter() - start,
    )
    if config.host_pages is not None and stack.kv_host.page_num != config.host_pages:
        raise AssertionError(f"host pool has {stack.kv_host.page_num} pages, wanted {config.host_pages}")
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

_PART_KV, _PART_INDEX_K, _PART_INDEX_SCALE = 1, 2, 3


def pattern_bytes(positions: torch.Tensor, width: int, *, seed: int, layer: int, part: int) -> torch.Tensor:
    """``(len(positions), width)`` uint8, a mixing hash of (position, byte, seed, layer, part)."""
    pos = positions.to(torch.int64).reshape(-1, 1)
    col = torch.arange(width, dtype=torch.int64).reshape(1, -1)
    x = pos * 1_000_003 + col * 7_919 + (seed * 104_729 + layer * 4_099 + part * 613)
    x = x ^ (x >> 7)
    x = (x * 2_654_435_761) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    return (x & 0xFF).to(torch.uint8)


def _kv_bytes(kv_pool, layer: int) -> torch.Tensor:
    return kv_pool.kv_buffer[layer].view(torch.uint8)  # (slots, 1, row_bytes)


def _index_geometry(kv_pool) -> tuple[int, int]:
    key_bytes = kv_pool.index_head_dim  # fp8 keys: one byte each
    scale_bytes = kv_pool.index_head_dim // kv_pool.quant_block_size * 4  # fp32 scales
    return key_bytes, scale_bytes


def _index_cells(kv_pool, locs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row and column indices of each token's key bytes and scale bytes.

    A device indexer page is ``P * key_bytes`` fp8 keys followed by
    ``P * scale_bytes`` scale bytes (DSATokenToKVPool's page-major layout).
    """
    page_size = kv_pool.page_size
    key_bytes, scale_bytes = _index_geometry(kv_pool)
    locs = locs.to(torch.int64)
    page = (locs // page_size).reshape(-1, 1)
    offset = (locs % page_size).reshape(-1, 1)
    key_cols = offset * key_bytes + torch.arange(key_bytes).reshape(1, -1)
    scale_cols = page_size * key_bytes + offset * scale_bytes + torch.arange(scale_bytes).reshape(1, -1)
    return page, key_cols, scale_cols


def write_content(kv_pool, locs: torch.Tensor, positions: torch.Tensor, *, seed: int) -> None:
    """Fill KV rows and indexer key/scale bytes of ``locs`` for ``positions``."""
    if locs.numel() != positions.numel():
        raise ValueError("locs and positions differ in length")
    locs = locs.to(torch.int64)
    key_bytes, scale_bytes = _index_geometry(kv_pool)
    page, key_cols, scale_cols = _index_cells(kv_pool, locs)
    for layer in range(kv_pool.layer_num):
        kv = _kv_bytes(kv_pool, layer)
        kv[locs, 0] = pattern_bytes(positions, kv.shape[-1], seed=seed, layer=layer, part=_PART_KV)
        index = kv_pool.index_k_with_scale_buffer[layer]
        index[page, key_cols] = pattern_bytes(positions, key_bytes, seed=seed, layer=layer, part=_PART_INDEX_K)
        index[page, scale_cols] = pattern_bytes(
            positions, scale_bytes, seed=seed, layer=layer, part=_PART_INDEX_SCALE
        )


def content_mismatches(kv_pool, locs: torch.Tensor, positions: torch.Tensor, *, seed: int) -> list[str]:
    """Every ``"kv[layer]"`` / ``"index_k[layer]"`` / ``"index_scale[layer]"`` whose bytes differ."""
    if locs.numel() != positions.numel():
        raise ValueError("locs and positions differ in length")
    locs = locs.to(torch.int64)
    key_bytes, scale_bytes = _index_geometry(kv_pool)
    page, key_cols, scale_cols = _index_cells(kv_pool, locs)
    bad = []
    for layer in range(kv_pool.layer_num):
        kv = _kv_bytes(kv_pool, layer)
        want = pattern_bytes(positions, kv.shape[-1], seed=seed, layer=layer, part=_PART_KV)
        if not torch.equal(kv[locs, 0], want):
            bad.append(f"kv[{layer}]")
        index = kv_pool.index_k_with_scale_buffer[layer]
        want = pattern_bytes(positions, key_bytes, seed=seed, layer=layer, part=_PART_INDEX_K)
        if not torch.equal(index[page, key_cols], want):
            bad.append(f"index_k[{layer}]")
        want = pattern_bytes(positions, scale_bytes, seed=seed, layer=layer, part=_PART_INDEX_SCALE)
        if not torch.equal(index[page, scale_cols], want):
            bad.append(f"index_scale[{layer}]")
    return bad


def poison_device(kv_pool, byte: int = POISON_BYTE) -> None:
    """Overwrite every device KV and indexer byte (padding page included)."""
    for layer in range(kv_pool.layer_num):
        _kv_bytes(kv_pool, layer).fill_(byte)
        kv_pool.index_k_with_scale_buffer[layer].fill_(byte)


def poisoned_elsewhere(kv_pool, written_locs: torch.Tensor, byte: int = POISON_BYTE) -> list[str]:
    """Buffers holding a non-poison byte outside ``written_locs`` (and their pages)."""
    written_locs = written_locs.to(torch.int64)
    bad = []
    for layer in range(kv_pool.layer_num):
        kv = _kv_bytes(kv_pool, layer)
        keep = torch.ones(kv.shape[0], dtype=torch.bool)
        keep[written_locs] = False
        if not bool((kv[keep] == byte).all()):
            bad.append(f"kv[{layer}]")
        index = kv_pool.index_k_with_scale_buffer[layer]
        keep = torch.ones(index.shape[0], dtype=torch.bool)
        keep[torch.unique(written_locs // kv_pool.page_size)] = False
        if not bool((index[keep] == byte).all()):
            bad.append(f"index[{layer}]")
    return bad


def token_positions(start: int, stop: int) -> torch.Tensor:
    return torch.arange(start, stop, dtype=torch.int64)
