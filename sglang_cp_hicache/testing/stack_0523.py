"""Build one rank of SGLang 0.5.23's KV-sharded DSA HiCache stack on CPU.

The pieces, built as the 0.5.23 PD-prefill path builds them
(``kv_cache_configurator``: ``PageInterleaveDSATokenToKVPool`` +
``PageInterleavePoolAllocator``; ``registry.create_tree_cache`` ->
``UnifiedRadixCache.init_hicache`` -> the assembler's DSA strategy ->
``PageInterleaveHostPool`` (MLA host) + ``DSAIndexerPoolHost`` +
``HybridCacheController(is_kv_sharded=True)``), with fp8_e4m3 latent rows of
576 bytes (the TRTLLM layout KV sharding requires) and page 64.

Ranks must be separate processes: SGLang's runtime context is process-global.
Each calls :func:`build_sharded_rank_stack` with the same config and its
rank, over a gloo group of ``cp_size`` processes (the pool asserts
``shard_size > 1``, so there is no one-rank sharded stack).

``copy_path``: ``"upstream"`` builds upstream's stack (``owned_rows`` + the
stock ops, emulated in :mod:`.cpu_0523`, and upstream's bookkeeping) through
upstream's strategies alone, or with ``upstream_via_plugin`` through
:class:`~sglang_cp_hicache.sglang_0523.strategy.UpstreamDsaStrategy` (the
same stack; it joins the start-up agreement); ``"library"`` builds it
through :class:`~sglang_cp_hicache.sglang_0523.strategy.LibraryDsaStrategy`
(this library's kernels, host room and device frees). The strategy is
registered only for the build. A build through either strategy makes the
start-up agreement's one all-gather over ``cp_group``, so every rank builds
those stacks in the same order.

Sizes are per rank and in pages: ``device_pages`` allocatable physical pages
(plus SGLang's padding page), ``host_pages`` allocatable host pages.

:func:`build_plain_rank_stack` builds the same release's plain (non-sharded)
DSA HiCache stack -- ``DSATokenToKVPool`` + ``PagedTokenToKVPoolAllocator``
-> ``UnifiedRadixCache`` -> upstream's DSA strategy (``MLATokenToKVPoolHost``
+ ``DSAIndexerPoolHost``) -- with the same rows: the baseline a CP run's hits
are read against (one process, or each rank of a TP group holding the whole
pool).
"""

from __future__ import annotations

import atexit
import os
import time
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from sglang_cp_hicache import settings
from sglang_cp_hicache.placement import DSA_PAGE_SIZE, CpPlacement
from sglang_cp_hicache.testing import cpu_0523, env
from sglang_cp_hicache.validation import check_int

__all__ = [
    "COPY_PATHS",
    "PlainStackConfig",
    "ShardedRankStack",
    "ShardedStackConfig",
    "build_plain_rank_stack",
    "build_sharded_rank_stack",
]

COPY_PATHS = settings.COPY.choices
_TREE_CORE_ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"


@dataclass(frozen=True)
class ShardedStackConfig:
    cp_size: int = 2
    page_size: int = DSA_PAGE_SIZE  # KV sharding requires 64
    num_layers: int = 2
    device_pages: int = 8  # allocatable physical pages per rank
    host_pages: int = 16  # allocatable host pages per rank
    host_layout: str = "layer_first"  # sharded DSA HiCache: layer_first or page_first
    write_policy: str = "write_through"
    copy_path: str = "upstream"
    # copy_path "upstream" only: build through this plugin's UpstreamDsaStrategy
    # (as a server with the plugin and SGLANG_CP_HICACHE_COPY=upstream does),
    # which joins the start-up agreement; False: upstream's strategies alone.
    upstream_via_plugin: bool = False
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    index_head_dim: int = 128  # DSATokenToKVPool asserts 128
    # --hicache-storage-backend and its extra config (JSON), as a server passes them
    storage_backend: Optional[str] = None
    storage_extra_config: Optional[str] = None
    enable_metrics: bool = False  # --enable-metrics (CacheInitParams.enable_metrics)
    # more ServerArgs fields, as (name, value) pairs
    server_args: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        for name in ("cp_size", "page_size", "num_layers", "device_pages", "host_pages"):
            check_int(name, getattr(self, name), 1)
        if self.cp_size < 2:
            raise ValueError(f"cp_size must be >= 2 (the sharded pool needs shard_size > 1), got {self.cp_size}")
        if self.host_layout not in ("layer_first", "page_first"):
            raise ValueError(f"host_layout must be layer_first or page_first, got {self.host_layout!r}")
        if self.copy_path not in COPY_PATHS:
            raise ValueError(f"copy_path must be one of {COPY_PATHS}, got {self.copy_path!r}")
        if self.upstream_via_plugin and self.copy_path != "upstream":
            raise ValueError("upstream_via_plugin needs copy_path='upstream'")

    @property
    def kv_row_bytes(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim  # fp8: one byte per element

    @property
    def logical_pages(self) -> int:
        """Allocatable logical pages (all ranks)."""
        return self.device_pages * self.cp_size

    def hicache_ratio(self) -> float:
        # Host rows = int(device rows * ratio) rounded to pages, plus a padding
        # page the sharded slot allocator leaves unused: half a page above the
        # target keeps float rounding off the boundary.
        return (self.host_pages + 0.5) / self.device_pages


@dataclass(frozen=True)
class PlainStackConfig:
    """A plain (non-sharded) DSA HiCache stack: one pool holding every page."""

    page_size: int = DSA_PAGE_SIZE
    num_layers: int = 2
    device_pages: int = 16  # allocatable device pages (plus SGLang's padding page)
    host_pages: int = 32  # allocatable host pages
    host_layout: str = "layer_first"
    write_policy: str = "write_through"
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    index_head_dim: int = 128

    def __post_init__(self) -> None:
        for name in ("page_size", "num_layers", "device_pages", "host_pages"):
            check_int(name, getattr(self, name), 1)
        if self.host_layout not in ("layer_first", "page_first"):
            raise ValueError(f"host_layout must be layer_first or page_first, got {self.host_layout!r}")

    cp_size = 1  # one pool owns every page
    copy_path = "upstream"  # a plain stack copies through upstream's ops
    storage_backend = None  # no L3: a plain stack stands for the L1/L2 capacity only
    storage_extra_config = None
    enable_metrics = False
    server_args: tuple[tuple[str, Any], ...] = ()

    @property
    def kv_row_bytes(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def hicache_ratio(self) -> float:
        # Host rows = int(device rows * ratio) floored to pages, plus one page
        # that a plain host pool allocates like any other: aim half a page
        # below host_pages - 1 pages' worth, off the float rounding boundary.
        return (self.host_pages - 0.5) / self.device_pages


@dataclass
class ShardedRankStack:
    config: Any  # ShardedStackConfig, or PlainStackConfig for a plain stack
    cp_rank: int
    server_args: Any
    kv_pool: Any  # PageInterleaveDSATokenToKVPool
    allocator: Any  # PageInterleavePoolAllocator
    cache: Any  # UnifiedRadixCache
    build_seconds: float

    @property
    def controller(self) -> Any:
        return self.cache.cache_controller

    @property
    def cp(self) -> Any:
        """What the library added to this stack (a ``CpStack0523``: host
        room, device frees, run frees, warm-up, L3), None on upstream's."""
        from sglang_cp_hicache.sglang_0523.controller import library_stack

        return library_stack(self.cache)

    @property
    def host_group(self) -> Any:
        return self.controller.mem_pool_host

    @property
    def kv_host(self) -> Any:
        """The sharded anchor (``PageInterleaveHostPool``)."""
        return self.host_group.anchor_entry.host_pool

    @property
    def index_host(self) -> Any:
        from sglang.srt.mem_cache.hicache_storage import PoolName

        return self.host_group.entry_map[PoolName.INDEXER].host_pool

    @property
    def placement(self) -> CpPlacement:
        return CpPlacement(self.config.page_size, self.config.cp_size, self.cp_rank)

    def close(self) -> None:
        atexit.unregister(self.cache.shutdown)
        self.cache.release_host_resources()


class _TpWorkerStandIn:
    """The one method ``create_tree_cache`` calls on the TP worker."""

    def register_hicache_layer_transfer_counter(self, counter: Any) -> None:
        self.counter = counter


def _server_args(config: Any) -> Any:
    """Server args of a CPU HiCache stack, published for the process."""
    from sglang.srt import runtime_context

    server_args = env.make_cpu_server_args(
        page_size=config.page_size,
        hicache_mem_layout=config.host_layout,
        hicache_io_backend="kernel",
        hicache_ratio=config.hicache_ratio(),
        hicache_write_policy=config.write_policy,
        hicache_storage_backend=config.storage_backend,
        hicache_storage_backend_extra_config=env.with_harness_deadlines(config.storage_extra_config),
        **dict(config.server_args),
    )
    env.publish_server_args(server_args)
    # The DSA pool sizes its indexer from attn_dcp_size, which only a real
    # parallel setup fills in.
    runtime_context.get_parallel().override_permanently(attn_dcp_size=1)
    return server_args


def _shard_group(cp_group: torch.distributed.ProcessGroup, cp_rank: int, cp_size: int) -> cpu_0523.CpuShardGroup:
    size = torch.distributed.get_world_size(group=cp_group)
    if size != cp_size:
        raise ValueError(f"cp_group has {size} ranks, config.cp_size is {cp_size}")
    return cpu_0523.CpuShardGroup(world_size=cp_size, rank_in_group=cp_rank, cpu_group=cp_group, device_group=cp_group)


def _create_cache(ctx: Any, config: ShardedStackConfig) -> Any:
    from sglang.srt.mem_cache.registry import create_tree_cache

    from sglang_cp_hicache.sglang_0523 import strategy

    if config.copy_path == "upstream" and not config.upstream_via_plugin:
        if strategy.strategy_installed():
            raise RuntimeError("copy_path='upstream' but a strategy of this plugin is registered in this process")
        return create_tree_cache(ctx)
    strategy.install_strategy(config.copy_path)
    try:
        return create_tree_cache(ctx)
    finally:
        strategy.uninstall_strategy()


def build_sharded_rank_stack(
    config: ShardedStackConfig,
    cp_rank: int,
    *,
    cp_group: torch.distributed.ProcessGroup,
    **overrides: Any,
) -> ShardedRankStack:
    """One rank's stack over ``cp_group`` (gloo, ``cp_size`` processes)."""
    config = replace(config, **overrides)
    if not 0 <= cp_rank < config.cp_size:
        raise ValueError(f"cp_rank must be in [0, {config.cp_size}), got {cp_rank}")
    start = time.perf_counter()
    # KV sharding forces the Python tree core (the Rust core has no rotation bases).
    os.environ.setdefault(_TREE_CORE_ENV, "python")
    cpu_0523.install_cpu_support()

    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.page_interleave import PageShardSpec
    from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveDSATokenToKVPool
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

    P, N = config.page_size, config.cp_size
    server_args = _server_args(config)
    if config.enable_metrics:  # metric labels name the rank, as a server's parallel groups say it
        from sglang.srt import runtime_context

        runtime_context.get_parallel().override_permanently(
            tp_rank=cp_rank, tp_size=N, attn_cp_rank=cp_rank, attn_cp_size=N, moe_tp_size=N, pp_rank=0, pp_size=1,
        )

    shard_group = _shard_group(cp_group, cp_rank, N)
    spec = PageShardSpec(
        shard_rank=cp_rank, shard_size=N, page_size=P,
        max_prefix_tokens=2 * N * P, chunk_tokens=4 * P,  # forward-pass scratch: unused here
    )
    physical_size = config.device_pages * P
    kv_pool = PageInterleaveDSATokenToKVPool(
        physical_size, page_size=P, dtype=torch.float8_e4m3fn,
        kv_lora_rank=config.kv_lora_rank, qk_rope_head_dim=config.qk_rope_head_dim,
        layer_num=config.num_layers, device="cpu", kv_cache_dim=config.kv_row_bytes,
        enable_memory_saver=False, start_layer=0, end_layer=config.num_layers,
        index_head_dim=config.index_head_dim, index_kpool=1, index_kpool_compress=False,
        tail_extra_slots=0, max_running_requests=4, shard_spec=spec, shard_group=shard_group,
    )
    allocator = PageInterleavePoolAllocator(
        physical_size, physical_page_size=P, shard_size=N, dtype=torch.float8_e4m3fn,
        device="cpu", kvcache=kv_pool, need_sort=True, shard_spec=spec,
    )
    params = CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator, page_size=P,
        tp_cache_group=cp_group, attn_cp_cache_group=cp_group, attn_tp_cache_group=None,
        attn_cp_rank=cp_rank, attn_cp_size=N, enable_metrics=config.enable_metrics,
    )
    ctx = TreeCacheBuildContext(
        server_args=server_args, params=params, is_hybrid_swa=False, is_hybrid_ssm=False,
        enable_hierarchical_cache=True, disable_radix_cache=False, tp_worker=_TpWorkerStandIn(),
        model_config=None, tp_size=N, tp_rank=cp_rank, tp_group=cp_group, is_dsa=True,
    )
    cache = _create_cache(ctx, config)
    cpu_0523.register_stack_buffers(cache.cache_controller.mem_pool_host)
    return ShardedRankStack(config, cp_rank, server_args, kv_pool, allocator, cache, time.perf_counter() - start)


def build_plain_rank_stack(
    config: PlainStackConfig,
    *,
    tp_rank: int = 0,
    tp_group: Optional[torch.distributed.ProcessGroup] = None,
) -> ShardedRankStack:
    """A plain DSA HiCache stack (upstream's own strategy and copies); with
    ``tp_group``, one TP rank of a group whose every rank holds the whole pool
    (the cache all-reduces its acks over the group)."""
    start = time.perf_counter()
    os.environ.setdefault(_TREE_CORE_ENV, "python")
    cpu_0523.install_cpu_support()

    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache

    from sglang_cp_hicache.sglang_0523 import strategy

    if strategy.strategy_installed():
        raise RuntimeError("a plain stack is upstream's: a strategy of this plugin is registered in this process")
    P = config.page_size
    tp_size = 1 if tp_group is None else torch.distributed.get_world_size(group=tp_group)
    server_args = _server_args(config)
    size = config.device_pages * P
    kv_pool = DSATokenToKVPool(
        size, page_size=P, dtype=torch.float8_e4m3fn, kv_lora_rank=config.kv_lora_rank,
        qk_rope_head_dim=config.qk_rope_head_dim, layer_num=config.num_layers, device="cpu",
        kv_cache_dim=config.kv_row_bytes, enable_memory_saver=False, start_layer=0, end_layer=config.num_layers,
        index_head_dim=config.index_head_dim, index_kpool=1, index_kpool_compress=False, tail_extra_slots=0,
        max_running_requests=4,
    )
    allocator = PagedTokenToKVPoolAllocator(
        size, page_size=P, dtype=torch.float8_e4m3fn, device="cpu", kvcache=kv_pool, need_sort=True
    )
    params = CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator, page_size=P,
        tp_cache_group=tp_group, attn_cp_cache_group=None, attn_tp_cache_group=None,
    )
    ctx = TreeCacheBuildContext(
        server_args=server_args, params=params, is_hybrid_swa=False, is_hybrid_ssm=False,
        enable_hierarchical_cache=True, disable_radix_cache=False, tp_worker=_TpWorkerStandIn(),
        model_config=None, tp_size=tp_size, tp_rank=tp_rank, tp_group=tp_group, is_dsa=True,
    )
    cache = create_tree_cache(ctx)
    host = cache.cache_controller.mem_pool_host
    cpu_0523.register_stack_buffers(host)
    if host.anchor_entry.host_pool.available_size() != config.host_pages * P:
        raise RuntimeError(f"the plain host pool holds {host.anchor_entry.host_pool.available_size()} tokens, "
                           f"not host_pages * page_size = {config.host_pages * P}")
    return ShardedRankStack(config, 0, server_args, kv_pool, allocator, cache, time.perf_counter() - start)
