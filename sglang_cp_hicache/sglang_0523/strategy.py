"""The seam: a HiCache stack strategy for SGLang 0.5.23's sharded DSA pool.

``hybrid_pool_assembler.attach_hybrid_pool_to_unified_cache`` builds a
``UnifiedRadixCache``'s host side through the first registered
``StackStrategy`` that matches the device pool; ``register_stack_strategy``
prepends one. :class:`LibraryDsaStrategy` matches exactly the KV-sharded DSA
pool (``PageInterleaveDSATokenToKVPool``) and builds what upstream's
``_DsaStrategy`` builds -- the same host pool group (``PageInterleaveHostPool``
+ ``DSAIndexerPoolHost``), the same controller arguments -- with
:class:`~.controller.LibraryCopyController` in place of
``HybridCacheController``, and on the cache's instances the owner-aware
host room for backups (:mod:`.host_room`) and device frees of evicted nodes,
insert duplicates and request pages from their rotation phase
(:mod:`.device_free`, :mod:`.request_free`), and L3 when it is on. No
upstream class or function is patched; the methods replaced on the stack's
instances (the cache, its FULL component, the device allocator, the storage
attachment) are listed in :mod:`.stack`, whose one record
(:class:`~.stack.CpStack0523`) the build hands to the controller.
:class:`UpstreamDsaStrategy` builds upstream's own
stack for a rank on ``SGLANG_CP_HICACHE_COPY=upstream`` and only joins the
start-up agreement, so ranks on different copy paths are refused.

Start-up, all inside ``build`` (so a failure aborts the cache and the server
refuses to start): every SGLang name the adapter depends on is present and
unchanged (:func:`~.hooks.check_hooks`, before any of them is used); the CP
ranks agree on what they were started with (:func:`~.startup.agree_at_start_up`,
one all-gather, before the controller exists); then
:func:`verify_library_stack` checks that the stack is one
the kernels support (kernel io, ``layer_first``/``page_first``, no DCP, no
layer sharding, no packed MTP drafts, every layer with an indexer), and an
empty write and an empty load sent through upstream's own entry points
(``_move_write_operation`` / ``_move_op_indices`` and
``l2_transfer_engine.submit_*``) reach this adapter's overrides. A seam that
did not take -- a renamed private method upstream, another strategy or plugin
that replaced ours -- is refused by name instead of silently falling back to
upstream's copies. Last, the four copy kernels are compiled (CUDA) or
loaded (interpreter) for the stack's pools (:mod:`.warmup`).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable, Optional

import torch
from sglang.srt.managers.cache_controller import CacheOperation
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler
from sglang.srt.mem_cache.hybrid_cache.host_pool_config import prepare_host_pool_config
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveKVPoolMixin
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.runtime_context import get_memory

from sglang_cp_hicache.kernels import HOST_LAYOUTS
from sglang_cp_hicache.l3.location import L3Location, L3Timeouts, l3_location, parse_extra_config
from sglang_cp_hicache.l3.opening import check_served, open_l3
from sglang_cp_hicache.l3.rank import L3Opening
from sglang_cp_hicache.sglang_0523 import check_sglang_version
from sglang_cp_hicache.sglang_0523.controller import LibraryCopyController
from sglang_cp_hicache.sglang_0523.copy_engine import LibraryL2TransferEngine, kv_host_pool_of
from sglang_cp_hicache.sglang_0523.device_free import PhaseKnownDeviceFrees
from sglang_cp_hicache.sglang_0523.hooks import check_hooks
from sglang_cp_hicache.sglang_0523.l3_cache import install_l3, l3_binding, source_text
from sglang_cp_hicache.sglang_0523.host_room import OwnerAwareHostRoom
from sglang_cp_hicache.sglang_0523.library_metrics import LibraryMetrics0523
from sglang_cp_hicache.sglang_0523.request_free import KnownRunFrees
from sglang_cp_hicache.sglang_0523.stack import CpStack0523
from sglang_cp_hicache.sglang_0523.startup import agree_at_start_up
from sglang_cp_hicache.sglang_0523.warmup import warm_up_copies

__all__ = [
    "LibraryDsaStrategy", "LibraryStackError", "UpstreamDsaStrategy", "install_strategy", "installed_copy_path",
    "strategy_installed", "uninstall_strategy", "verify_library_stack",
]

logger = logging.getLogger(__name__)


#: SGLang 0.5.23's prefetch timeout defaults (it has no maximum: the
#: library keeps its own, so no lookup waits more than 30 s).
TIMEOUT_DEFAULTS = L3Timeouts(base_s=1.0, per_ki_token_s=0.25, max_s=30.0)


def with_release_timeouts(location: L3Location) -> L3Location:
    """``location`` with the deadlines of the server's extra config as
    written (SGLang 0.5.23 hands the strategy the config with its prefetch
    keys already taken out), on 0.5.23's defaults."""
    raw = get_memory().hicache_storage_backend_extra_config
    timeouts = L3Timeouts.from_extra_config(parse_extra_config(raw), TIMEOUT_DEFAULTS)
    return replace(location, timeouts=timeouts)


class LibraryStackError(RuntimeError):
    """The sharded stack cannot run the library's copies; the server must not start."""


class _ShardedDsaStrategy(assembler._DsaStrategy):
    """Upstream's DSA strategy, taken only for the KV-sharded (page-interleave) pool."""

    def matches(self, kvcache: Any, components: set) -> bool:
        return isinstance(kvcache, PageInterleaveKVPoolMixin) and super().matches(kvcache, components)


class LibraryDsaStrategy(_ShardedDsaStrategy):
    """``_DsaStrategy`` for the KV-sharded DSA pool, with the library's copies."""

    def build(self, *, cache, kvcache, params, server_args, load_cache_event, storage_backend=None,
              storage_backend_extra_config=None, prefetch_threshold=256, model_name=None,
              enable_storage_metrics=False) -> assembler.StackBuildResult:
        check_sglang_version()
        check_hooks()
        # The library serves L3 itself (SGLang's storage controller stays off:
        # it would key objects by rank and read rank-local rows as logical
        # slots); any backend it cannot serve (``file``, ``mooncake``) is
        # refused here, naming the flag.
        location = with_release_timeouts(l3_location(storage_backend, storage_backend_extra_config))
        check_served(location, "0.5.23")
        opened: list[L3Opening] = []

        def open_rank_l3(host_pool_group: Any) -> L3Opening:
            layer_start = int(getattr(kvcache, "start_layer", 0) or 0)
            opened.append(open_l3(location, source_text(location),
                                  lambda: l3_binding(host_pool_group, server_args, layer_start), server_args=server_args))
            return opened[-1]

        result = _build_dsa_stack(
            LibraryCopyController, "library", kvcache=kvcache, params=params, load_cache_event=load_cache_event,
            storage_backend=None, storage_backend_extra_config=None,
            prefetch_threshold=prefetch_threshold, model_name=model_name,
            enable_storage_metrics=enable_storage_metrics, l3_opener=open_rank_l3,
        )
        verify_library_stack(result, kvcache, params)
        controller = result.cache_controller
        placement = controller.placement
        # The tree-facing bookkeeping: owner-aware host room for backups, and
        # device frees (evicted nodes, insert duplicates, request pages) from
        # their rotation phase.
        host_room = OwnerAwareHostRoom(cache, placement)
        host_room.install()
        device_frees = PhaseKnownDeviceFrees(cache, params.token_to_kv_pool_allocator, placement)
        device_frees.install()
        run_frees = KnownRunFrees(cache, device_frees)
        run_frees.install()
        warmup = warm_up_copies(result.host_pool_group, placement.cp_rank, placement.cp_size)
        l3 = None
        if opened and opened[0].tier is not None:
            l3 = install_l3(cache, opened[0].tier, location, host_room, enable_metrics=bool(enable_storage_metrics))
        metrics = None
        if enable_storage_metrics:  # --enable-metrics: the library's own counters, labelled as L3's
            backend = location.backend if l3 is not None and location.scheduler_driven else None
            metrics = LibraryMetrics0523(cache, controller, placement, host_room, device_frees, backend)
            metrics.install()  # last: it wraps the L3 driver's check_hicache_events
        controller.cp_stack = CpStack0523(placement, host_room, device_frees, run_frees, warmup, l3, metrics)
        logger.info(
            "sglang-cp-hicache: library copy kernels on the sharded DSA HiCache path "
            "(cp_rank %d of %d, host layout %s). Copy path: library (SGLANG_CP_HICACHE_COPY=library)",
            placement.cp_rank, placement.cp_size, result.host_pool_group.layout,
        )
        return result


class UpstreamDsaStrategy(_ShardedDsaStrategy):
    """Upstream's sharded DSA stack, for a rank on ``SGLANG_CP_HICACHE_COPY=upstream``.

    It builds what upstream's ``_DsaStrategy`` builds (the same calls, the
    same ``HybridCacheController``, nothing replaced) and takes part in the
    CP ranks' start-up agreement at the point where the library's build does,
    so a deployment whose ranks run different copy paths is refused on every
    rank instead of leaving the library ranks waiting for a peer that never
    joins the all-gather.
    """

    def build(self, *, cache, kvcache, params, server_args, load_cache_event, storage_backend=None,
              storage_backend_extra_config=None, prefetch_threshold=256, model_name=None,
              enable_storage_metrics=False) -> assembler.StackBuildResult:
        result = _build_dsa_stack(
            HybridCacheController, "upstream", kvcache=kvcache, params=params, load_cache_event=load_cache_event,
            storage_backend=storage_backend, storage_backend_extra_config=storage_backend_extra_config,
            prefetch_threshold=prefetch_threshold, model_name=model_name,
            enable_storage_metrics=enable_storage_metrics,
        )
        logger.info(
            "sglang-cp-hicache: SGLang's own copies on the sharded DSA HiCache path (cp_rank %d of %d, "
            "host layout %s). Copy path: upstream (SGLANG_CP_HICACHE_COPY=upstream)",
            kvcache.shard_rank, kvcache.shard_size, result.host_pool_group.layout,
        )
        return result


def _build_dsa_stack(
    controller_class: type, copy_path: str, *, kvcache: Any, params: Any, load_cache_event: Any,
    storage_backend: Any, storage_backend_extra_config: Any, prefetch_threshold: int, model_name: Any,
    enable_storage_metrics: bool, l3_opener: Optional[Callable[[Any], L3Opening]] = None,
) -> assembler.StackBuildResult:
    """Upstream ``_DsaStrategy.build`` (0.5.23) line for line, with
    ``controller_class`` and the start-up agreement (after the host pools,
    before the controller, whose construction makes process groups); with
    ``l3_opener`` the rank's L3 is opened first and joins the agreement,
    and an unusable L3 is raised once the ranks agree."""
    config = prepare_host_pool_config(
        decls=kvcache.host_pool_decls(),
        full_layer_mapping={i: i for i in range(kvcache.layer_num)},
        transfer_layer_id_max=kvcache.layer_num,
        transfer_page_size=params.page_size,
        packed_draft_device_pools=params.mtp_draft_device_pools,
    )
    host_pool_group = assembler.build_host_pool_group(config=config)
    # Before anything a rank could refuse alone: every rank reaches the all-gather.
    l3 = l3_opener(host_pool_group) if l3_opener is not None else None
    agree_at_start_up(kvcache, host_pool_group, copy_path=copy_path, l3=l3.view if l3 is not None else "off")
    if l3 is not None:
        l3.raise_if_unusable()
    memory = get_memory()
    cache_controller = controller_class(
        params.token_to_kv_pool_allocator,
        host_pool_group,
        config.transfer_page_size,
        params.tp_cache_group,
        load_cache_event=load_cache_event,
        attn_cp_group=params.attn_cp_cache_group,
        attn_tp_group=params.attn_tp_cache_group,
        pp_group=params.pp_cache_group,
        write_policy=memory.hicache_write_policy,
        io_backend=memory.hicache_io_backend,
        storage_backend=storage_backend,
        prefetch_threshold=prefetch_threshold,
        model_name=model_name,
        storage_backend_extra_config=storage_backend_extra_config,
        transfer_layer_id_max=kvcache.layer_num,
        enable_storage_metrics=enable_storage_metrics,
        host_memory_mode=memory.hicache_host_memory_mode,
    )
    return assembler.StackBuildResult(
        host_pool_group=host_pool_group,
        cache_controller=cache_controller,
        component_host_pools={
            ComponentType.FULL: host_pool_group.get_pool(PoolName.KV),
        },
        sidecars=[c.decl.sidecar_spec() for c in config.pools if not c.decl.is_primary],
        pools_desc=" + ".join(c.decl.pool_name.value.upper() for c in config.pools),
        pool_declarations=tuple(c.decl for c in config.pools),
    )


# ---- start-up check ---------------------------------------------------------


def _refuse(problem: str) -> None:
    raise LibraryStackError(
        f"sglang-cp-hicache cannot run the library copy kernels on this stack: {problem}. "
        "Set SGLANG_CP_HICACHE_COPY=upstream to keep SGLang's own copy path."
    )


def _check_supported(result: Any, kvcache: Any, params: Any) -> None:
    controller = result.cache_controller
    group = result.host_pool_group
    if controller.io_backend != "kernel":
        _refuse(f"hicache io backend {controller.io_backend!r} (needs 'kernel')")
    if group.layout not in HOST_LAYOUTS:
        _refuse(f"host layout {group.layout!r} (supported: {HOST_LAYOUTS})")
    if params.mtp_draft_device_pools:
        _refuse("packed MTP draft pools")
    if getattr(kvcache, "layer_shard_enabled", False):
        _refuse("a layer-sharded device pool")
    names = sorted(entry.name.value for entry in group.entries)
    if names != ["indexer", "kv"]:
        _refuse(f"host pools {names} (expected kv + indexer)")
    kv_pool = kv_host_pool_of(group.anchor_entry.host_pool)
    if kv_pool is None:
        _refuse(f"anchor host pool {type(group.anchor_entry.host_pool).__name__}")
    if kv_pool.dcp_size != 1:
        _refuse(f"decode context parallel (dcp_size={kv_pool.dcp_size})")
    # The owner-aware host room replaces the branch of _execute_kv_backup
    # that upstream takes without a shared host allocation domain.
    anchor = group.anchor_entry
    if anchor.host_pool.shared_allocation_domain is not None or anchor.host_evict_fn is not None:
        _refuse("a host pool in a shared allocation domain")
    if not isinstance(params.token_to_kv_pool_allocator, PageInterleavePoolAllocator):
        _refuse(f"device allocator {type(params.token_to_kv_pool_allocator).__name__} "
                "(needs PageInterleavePoolAllocator)")
    layers = list(range(kvcache.layer_num))
    # The engine addresses host layer l with device layer l: both maps must be identity.
    if list(kv_pool._target_layer_indices) != layers or len(kv_pool.device_kv_buffers) != len(layers):
        _refuse(f"KV layer map {list(kv_pool._target_layer_indices)} is not 0..{len(layers) - 1}")
    index_pool = group.entry_map[PoolName.INDEXER].host_pool
    if not isinstance(index_pool, DSAIndexerPoolHost):
        _refuse(f"indexer host pool {type(index_pool).__name__}")
    if list(index_pool._live_target_layers) != layers or index_pool.layer_num != len(layers):
        _refuse(f"indexer layers {list(index_pool._live_target_layers)} are not 0..{len(layers) - 1}")
    if index_pool.layout != group.layout:
        _refuse(f"indexer layout {index_pool.layout!r} differs from the KV layout {group.layout!r}")


def _check_seams_reached(controller: Any) -> None:
    """Send an empty write and an empty load through upstream's entry points;
    each must run this adapter's preparation and engine."""
    engine = controller.l2_transfer_engine
    if not isinstance(controller, LibraryCopyController):
        _refuse(f"the controller is {type(controller).__name__}, not LibraryCopyController")
    if not isinstance(engine, LibraryL2TransferEngine):
        _refuse(f"the transfer engine is {type(engine).__name__}, not LibraryL2TransferEngine")
    empty = torch.empty((0,), dtype=torch.int64)
    device_empty = empty.to(controller.device)
    before = (controller.prepared_operations, engine.counters.d2h_submissions, engine.counters.h2d_submissions)
    host, device, pools = controller._move_write_operation(CacheOperation(empty, device_empty, -1))
    engine.submit_device_to_host(controller._l2_transfers(host, device, pools)).finish_event.synchronize()
    host, device, pools = controller._move_op_indices(CacheOperation(empty, device_empty, -1))
    engine.submit_host_to_device(
        controller._l2_load_transfers(host, device, pools),
        transfer_layer_id_max=controller.transfer_layer_id_max,
    ).finish_event.synchronize()
    after = (controller.prepared_operations, engine.counters.d2h_submissions, engine.counters.h2d_submissions)
    missed = [
        name
        for name, b, a, want in zip(
            ("HybridCacheController._move_kv_shard_indices", "L2TransferEngine.submit_device_to_host",
             "L2TransferEngine.submit_host_to_device"),
            before, after, (2, 1, 1),
        )
        if a - b != want
    ]
    if missed:
        _refuse(f"upstream's write/load paths did not reach the overrides of {missed}")


def verify_library_stack(result: Any, kvcache: Any, params: Any) -> None:
    """Raise :class:`LibraryStackError` unless every seam took (see module doc)."""
    _check_supported(result, kvcache, params)
    _check_seams_reached(result.cache_controller)


# ---- registration -----------------------------------------------------------

_strategy: LibraryDsaStrategy | UpstreamDsaStrategy | None = None
_STRATEGY_FOR = {"library": LibraryDsaStrategy, "upstream": UpstreamDsaStrategy}


def strategy_installed() -> bool:
    """True while one of this adapter's strategies is first in SGLang's list."""
    return _strategy is not None and assembler._STRATEGIES[:1] == [_strategy]


def installed_copy_path() -> str | None:
    """``library`` or ``upstream`` while :func:`strategy_installed`, else None."""
    return ("library" if isinstance(_strategy, LibraryDsaStrategy) else "upstream") if strategy_installed() else None


def install_strategy(copy_path: str = "library") -> LibraryDsaStrategy | UpstreamDsaStrategy:
    """Register the strategy of ``copy_path`` (idempotent; replaces the other
    one). Raises unless it ends up first."""
    global _strategy
    if copy_path not in _STRATEGY_FOR:
        raise ValueError(f"copy_path must be one of {tuple(_STRATEGY_FOR)}, got {copy_path!r}")
    wanted = _STRATEGY_FOR[copy_path]
    if _strategy is not None and type(_strategy) is not wanted:
        uninstall_strategy()
    if _strategy is None or _strategy not in assembler._STRATEGIES:
        _strategy = wanted()
        assembler.register_stack_strategy(_strategy)
    if not strategy_installed():
        raise LibraryStackError(
            "another HiCache stack strategy was registered ahead of sglang-cp-hicache's"
        )
    return _strategy


def uninstall_strategy() -> None:
    """Remove the strategy: later stacks are built by upstream's own strategies."""
    global _strategy
    if _strategy is not None and _strategy in assembler._STRATEGIES:
        assembler._STRATEGIES.remove(_strategy)
    _strategy = None
