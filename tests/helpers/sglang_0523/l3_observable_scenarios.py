"""L3 metrics and clearing on SGLang 0.5.23's sharded stack, in 2 rank
processes (:func:`observable_suite`), with ``--hicache-storage-backend file``
and ``--enable-metrics`` as a server passes them:

1. CP 2 serves a workload (writes through to L3), then a second CP 2 stack
   on the same directory serves it again (restores from L3); after each, the
   rank reads SGLang's own metric objects (the default Prometheus registry,
   as a server's scheduler process has it) and the library's counters;
2. SGLang's own admin handler (``Scheduler.clear_hicache_storage_wrapped``)
   clears the L3 on both ranks; what is left in the directory is returned.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests.helpers.sglang_0523.l3_scenarios import DEVICE_PAGES, HOST_PAGES, _requests

#: SGLang's and the library's metric names the suite reads.
NAMES = (
    "sglang:prefetched_tokens_total", "sglang:backuped_tokens_total", "sglang:storage_prefetch_hit_tokens_total",
    "sglang:prefetch_pgs_sum", "sglang:prefetch_pgs_count", "sglang:backup_pgs_sum", "sglang:backup_pgs_count",
    "sglang:prefetch_bandwidth_count", "sglang:backup_bandwidth_count",
    "sglang_cp_hicache:l3_written_pages_total", "sglang_cp_hicache:l3_kept_pages_total",
    "sglang_cp_hicache:l3_restored_pages_total", "sglang_cp_hicache:l3_restored_tokens_total",
    "sglang_cp_hicache:l3_read_bytes_total", "sglang_cp_hicache:l3_written_bytes_total",
    "sglang_cp_hicache:l3_cleared_objects_total",
)
#: A namespace digest no deployment of the suite has.
FOREIGN = "ab" * 8


def _per_cache_radix_collector() -> type:
    """SGLang's radix-cache collector in a registry of its own: the suite
    builds two stacks in one process, and that collector has no label that
    tells them apart (a server runs one cache per process)."""
    from functools import partial

    import prometheus_client
    from sglang.srt.observability.metrics_collector import RadixCacheMetricsCollector

    class PerCacheRadixCollector(RadixCacheMetricsCollector):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            registry = prometheus_client.CollectorRegistry()
            self._counter_cls = partial(prometheus_client.Counter, registry=registry)
            self._gauge_cls = partial(prometheus_client.Gauge, registry=registry)
            self._histogram_cls = partial(prometheus_client.Histogram, registry=registry)
            super().__init__(*args, **kwargs)

    return PerCacheRadixCollector


def _stack(rank: int, group: Any, directory: str) -> Any:
    from sglang_cp_hicache.testing.stack_0523 import ShardedStackConfig, build_sharded_rank_stack

    config = ShardedStackConfig(
        cp_size=2, device_pages=DEVICE_PAGES, host_pages=HOST_PAGES, copy_path="library",
        storage_backend="file", storage_extra_config=json.dumps({"file_storage_path": directory}),
        enable_metrics=True, server_args=(("stat_loggers", {"radix_cache": _per_cache_radix_collector()}),),
    )
    return build_sharded_rank_stack(config, rank, cp_group=group)


def _values(cache: Any) -> dict[str, float]:
    from prometheus_client import REGISTRY

    labels = {k: str(v) for k, v in cache.storage_metrics_collector.labels.items()}
    return {name: REGISTRY.get_sample_value(name, labels) or 0.0 for name in NAMES}


def _serve(rank: int, group: Any, directory: str) -> dict[str, Any]:
    from sglang_cp_hicache.sim.engine_0523 import ShardedSimRankEngine

    stack = _stack(rank, group, directory)
    cache, driver = stack.cache, stack.cp.l3
    before = _values(cache)
    engine = ShardedSimRankEngine(stack, content_seed=1)
    records = [engine.serve(i, r.tokens) for i, r in enumerate(_requests())]
    engine.totals()  # waits for the last writes
    cache.check_hicache_events()  # the step after them publishes what they did
    after = _values(cache)
    out = {
        "grown": {name: after[name] - before[name] for name in NAMES},
        "counters": driver.counters.as_dict(),
        "labels": dict(cache.storage_metrics_collector.labels),
        "enable_storage_metrics": cache.enable_storage_metrics,
        "loaded_tokens": sum(r.loaded_tokens for r in records),
        "corrupted_pages": sum(r.corrupted_pages for r in records),
        "page_bytes": driver.tier.kv_ns.page_bytes + driver.tier.indexer_ns.page_bytes,
        "digests": [driver.tier.kv_ns.digest(), driver.tier.indexer_ns.digest()],
    }
    stack.close()
    return out


def _clear(rank: int, group: Any, directory: str) -> dict[str, Any]:
    from sglang.srt.managers.io_struct import ClearHiCacheReqInput

    from tests.helpers.scheduler_import import scheduler_class

    Scheduler = scheduler_class()

    stack = _stack(rank, group, directory)
    cache = stack.cache
    before = _values(cache)
    handler = SimpleNamespace(enable_hierarchical_cache=True, enable_lmcache=False, tree_cache=cache)
    success = Scheduler.clear_hicache_storage_wrapped(handler, ClearHiCacheReqInput()).success
    again = cache.clear_storage_backend()
    cache.check_hicache_events()
    cleared = _values(cache)["sglang_cp_hicache:l3_cleared_objects_total"]
    stack.close()
    return {"success": success, "again": again,
            "cleared": cleared - before["sglang_cp_hicache:l3_cleared_objects_total"]}


def observable_suite(rank: int, world: int, *, l3_root: str) -> dict[str, Any]:
    from tests.helpers.sglang_0523.scenarios import _setup

    _setup()
    import torch.distributed as dist

    from sglang_cp_hicache.l3.store import FilePageStore

    assert world == 2
    directory = str(Path(l3_root) / "l3")
    out: dict[str, Any] = {"write": _serve(rank, dist.group.WORLD, directory)}
    dist.barrier()
    out["read"] = _serve(rank, dist.group.WORLD, directory)
    dist.barrier()
    if rank == 0:  # another deployment's objects in the same directory
        foreign = [f"{i:064x}_{FOREIGN}_root" for i in range(3)]
        assert FilePageStore(directory).put(foreign, [b"x" * 10] * 3) == [True] * 3
        out["objects_before_clear"] = len(list(Path(directory).rglob("*.bin")))
    dist.barrier()
    out["clear"] = _clear(rank, dist.group.WORLD, directory)
    dist.barrier()
    out["left"] = sorted(p.stem.split("_")[1] for p in Path(directory).rglob("*.bin"))
    return out
