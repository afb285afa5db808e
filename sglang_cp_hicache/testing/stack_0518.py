"""Build one CP rank's real SGLang 0.5.18 HiCache stack (DSA pool, CP allocator,
:class:`CpHiRadixCache`) -- for embedding, the simulator and the tests.

Sizes are per rank and in pages: ``device_pages`` physical device pages (the
logical pool has ``device_pages * cp_size`` pages, page 0 being SGLang's
padding page), ``host_pages`` host pages.
"""

from __future__ import annotations

import atexit
import time
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from sglang_cp_hicache.placement import DSA_PAGE_SIZE
from sglang_cp_hicache.testing import cpu_support, env
from sglang_cp_hicache.validation import check_int

__all__ = ["CpStackConfig", "CpRankStack", "build_cp_rank_stack"]


@dataclass(frozen=True)
class CpStackConfig:
    cp_size: int = 2
    page_size: int = DSA_PAGE_SIZE
    num_layers: int = 2
    device_pages: int = 8  # physical, per rank
    host_pages: int = 16  # per rank
    host_layout: str = "layer_first"
    io_backend: str = "kernel"
    write_policy: str = "write_through"
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    index_head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16
    cp_mode: bool = True  # False: plain HiRadixCache over a plain allocator (comparison)
    device: str = "cpu"  # where the KV pools live ("cuda" on a GPU machine)
    # --hicache-storage-backend and its extra config (JSON), as a server passes them
    storage_backend: Optional[str] = None
    storage_extra_config: Optional[str] = None
    # more ServerArgs fields, as (name, value) pairs (model_path, served_model_name, revision, ...)
    server_args: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        for name in ("cp_size", "page_size", "num_layers", "device_pages", "host_pages"):
            check_int(name, getattr(self, name), 1)

    @property
    def logical_size(self) -> int:
        """Usable logical tokens (without the padding page)."""
        pages = self.device_pages * (self.cp_size if self.cp_mode else 1)
        return (pages - 1) * self.page_size

    def hicache_ratio(self) -> float:
        # HostKVCache: size = int(device_size * ratio), page_num = size // P + 1.
        # Half a page below the target keeps float rounding off the boundary.
        return (self.host_pages - 0.5) / self.device_pages


@dataclass
class CpRankStack:
    config: CpStackConfig
    cp_rank: int
    server_args: Any
    kv_pool: Any
    allocator: Any
    cache: Any
    build_seconds: float

    @property
    def host_pool(self):
        return self.cache.token_to_kv_pool_host

    def close(self) -> None:
        atexit.unregister(self.cache.shutdown)
        self.cache.release_host_resources()


def build_cp_rank_stack(
    config: CpStackConfig,
    cp_rank: int,
    *,
    cp_group: Optional[torch.distributed.ProcessGroup] = None,
    **overrides: Any,
) -> CpRankStack:
    """One rank's stack. ``cp_group``: the CP process group SGLang's
    consensus all-reduces run over (None: a one-process group, for ranks
    simulated in one process)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

    from sglang_cp_hicache.sglang_0518.hiradix import CpHiRadixCache

    config = replace(config, **overrides)
    if not 0 <= cp_rank < config.cp_size:
        raise ValueError(f"cp_rank must be in [0, {config.cp_size}), got {cp_rank}")
    start = time.perf_counter()
    cpu_support.install_cpu_support()
    server_args = env.make_cpu_server_args(
        page_size=config.page_size,
        hicache_mem_layout=config.host_layout,
        hicache_io_backend=config.io_backend,
        hicache_ratio=config.hicache_ratio(),
        hicache_write_policy=config.write_policy,
        device=config.device,
        hicache_storage_backend=config.storage_backend,
        hicache_storage_backend_extra_config=env.with_harness_deadlines(config.storage_extra_config),
        **dict(config.server_args),
    )
    env.publish_server_args(server_args)
    kv_pool = _make_kv_pool(config)
    group = cp_group if cp_group is not None else env.make_local_gloo_group()
    allocator = _make_allocator(config, cp_rank, kv_pool)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=allocator,
        page_size=config.page_size,
        tp_cache_group=group,
        attn_cp_cache_group=group,
        attn_cp_rank=cp_rank,
        attn_cp_size=config.cp_size,
    )
    cache = (CpHiRadixCache if config.cp_mode else HiRadixCache)(params, server_args)
    return CpRankStack(config, cp_rank, server_args, kv_pool, allocator, cache,
                       time.perf_counter() - start)


def _make_kv_pool(config: CpStackConfig) -> Any:
    """This rank's physical DSA device pool (KV + indexer)."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    return DSATokenToKVPool(
        size=config.device_pages * config.page_size,
        page_size=config.page_size,
        kv_lora_rank=config.kv_lora_rank,
        dtype=config.dtype,
        qk_rope_head_dim=config.qk_rope_head_dim,
        layer_num=config.num_layers,
        device=config.device,
        index_head_dim=config.index_head_dim,
        enable_memory_saver=False,
        kv_cache_dim=config.kv_lora_rank + config.qk_rope_head_dim,
    )


def _make_allocator(config: CpStackConfig, cp_rank: int, kv_pool: Any) -> Any:
    """The CP allocator over the logical pool, or (``cp_mode=False``) SGLang's
    plain paged allocator over this rank's physical pool."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    from sglang_cp_hicache.sglang_0518.allocator import CpSharedPagedTokenToKVPoolAllocator

    physical_size = config.device_pages * config.page_size
    if not config.cp_mode:
        return PagedTokenToKVPoolAllocator(
            size=physical_size, page_size=config.page_size, dtype=config.dtype,
            device=config.device, kvcache=kv_pool, need_sort=True,
        )
    return CpSharedPagedTokenToKVPoolAllocator(
        logical_size=config.logical_size,
        physical_size=physical_size,
        page_size=config.page_size,
        dtype=config.dtype,
        device=config.device,
        kvcache=kv_pool,
        need_sort=True,
        cp_size=config.cp_size,
        cp_rank=cp_rank,
    )
