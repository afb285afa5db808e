"""L3 under CP is observable and clearable on SGLang 0.5.18 (threaded ranks
on gloo, real SGLang stacks, SGLang's own scheduler and metric classes).

* ``--enable-metrics``: SGLang's ``sglang:backuped_tokens_total`` moves by
  the tokens each rank wrote (summed over ranks: every page once), and
  ``sglang:prefetched_tokens_total`` by the tokens restored through SGLang's
  scheduler, with the per-operation histograms; the library's counters are
  exported beside them as ``sglang_cp_hicache:l3_*_total``;
* ``clear_hicache_storage`` (SGLang's scheduler handler) removes every
  object of this deployment's namespaces on every rank alike, each object
  once, and leaves another namespace's objects alone; a later lookup misses.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_cp_hicache import settings
from sglang_cp_hicache.testing.stack_0518 import CpStackConfig

from tests.helpers.cp_cluster import CpCluster
from tests.helpers.radix_metrics import per_cache_radix_collector
from tests.sglang_0518 import test_l3_scheduler as sched

prometheus_client = pytest.importorskip("prometheus_client")
REGISTRY = prometheus_client.REGISTRY

P = sched.P
PAGES = sched.PAGES
TOKENS = sched.TOKENS


@pytest.fixture(autouse=True)
def _only_the_flag(monkeypatch):
    monkeypatch.delenv(settings.L3_DIR.name, raising=False)
    monkeypatch.delenv(settings.SGLANG_FILE_DIR.name, raising=False)


def cluster(n: int, directory: Path, *, metrics: bool = True) -> CpCluster:
    config = CpStackConfig(
        cp_size=n, device_pages=8, host_pages=10, storage_backend="file", enable_metrics=metrics,
        storage_extra_config=json.dumps({"file_storage_path": str(directory)}),
        server_args=(("stat_loggers", {"radix_cache": per_cache_radix_collector()}),),
    )
    return CpCluster(config, threaded=True, timeout_s=30)


def labels(cache) -> dict[str, str]:
    return {k: str(v) for k, v in cache.storage_metrics_collector.labels.items()}


def sample(name: str, cache) -> float:
    return REGISTRY.get_sample_value(name, labels(cache)) or 0.0


def samples(cl: CpCluster, name: str) -> list[float]:
    return [sample(name, c) for c in cl.caches]


def write(cl: CpCluster) -> None:
    cl.insert(TOKENS)
    cl.step()
    assert all(cl.each(lambda s: s.cache.l3_wait_io(timeout=10)))
    cl.each(lambda s: s.cache.check_hicache_events())  # the next step publishes what the writes did


def own_objects(directory: Path, cache) -> list[Path]:
    digests = (cache.cp_l3.tier.kv_ns.digest(), cache.cp_l3.tier.indexer_ns.digest())
    # page keys: <page hash>_<namespace digest>_<parent link>
    return [p for p in directory.rglob("*.bin") if p.stem.split("_")[1] in digests]


def test_sglangs_storage_metrics_move_with_cp_l3_traffic(tmp_path):
    cl = cluster(2, tmp_path)
    try:
        c0 = cl.caches[0]
        assert c0.enable_storage_metrics is False  # SGLang's own feeds stay off: no storage controller
        assert [labels(c)["attn_cp_rank"] for c in cl.caches] == ["0", "1"]
        assert labels(c0)["storage_backend"] == "file" and labels(c0)["attn_cp_size"] == "2"
        before = {n: samples(cl, n) for n in ("sglang:backuped_tokens_total", "sglang:backup_pgs_count",
                                                "sglang_cp_hicache:l3_written_pages_total",
                                                "sglang_cp_hicache:l3_written_bytes_total")}
        write(cl)
        grown = {n: [a - b for a, b in zip(samples(cl, n), was)] for n, was in before.items()}
        written = [c.cp_l3.counters.written_pages for c in cl.caches]
        assert sum(written) == PAGES and all(written)
        # Each rank counts the tokens of the pages it stored; every page once over the ranks.
        assert grown["sglang:backuped_tokens_total"] == [w * P for w in written]
        assert grown["sglang_cp_hicache:l3_written_pages_total"] == written
        page_bytes = c0.cp_l3.tier.kv_ns.page_bytes + c0.cp_l3.tier.indexer_ns.page_bytes
        assert grown["sglang_cp_hicache:l3_written_bytes_total"] == [w * page_bytes for w in written]
        assert all(n >= 1 for n in grown["sglang:backup_pgs_count"])  # one sample per store operation
    finally:
        cl.close()

    # A second deployment restores the chain through SGLang's scheduler.
    cl = cluster(2, tmp_path)
    try:
        names = ("sglang:prefetched_tokens_total", "sglang:prefetch_pgs_sum", "sglang:prefetch_bandwidth_count",
                 "sglang_cp_hicache:l3_restored_pages_total", "sglang_cp_hicache:l3_read_bytes_total",
                 "sglang_cp_hicache:l3_read_seconds_total")
        before = {n: samples(cl, n) for n in names}
        queues = sched.arrive(cl, ["a"])
        assert sched.waiting_pass(cl, queues) == [[], []]
        assert sched.waiting_pass(cl, queues) == [["a"], ["a"]]
        assert all(q["a"].storage_hit_length == PAGES * P for q in queues)
        grown = {n: [a - b for a, b in zip(samples(cl, n), was)] for n, was in before.items()}
        restored = [c.cp_l3.counters.restored_pages for c in cl.caches]
        assert sum(restored) == PAGES
        # SGLang counts a prefetch's tokens on every rank alike (logical tokens inserted).
        assert grown["sglang:prefetched_tokens_total"] == [PAGES * P, PAGES * P]
        assert grown["sglang:prefetch_pgs_sum"] == restored  # own pages per fetch operation
        assert all(n >= 1 for n in grown["sglang:prefetch_bandwidth_count"])
        assert grown["sglang_cp_hicache:l3_restored_pages_total"] == restored
        page_bytes = cl.caches[0].cp_l3.tier.kv_ns.page_bytes + cl.caches[0].cp_l3.tier.indexer_ns.page_bytes
        assert grown["sglang_cp_hicache:l3_read_bytes_total"] == [r * page_bytes for r in restored]
        assert all(s > 0 for s in grown["sglang_cp_hicache:l3_read_seconds_total"])
        text = prometheus_client.generate_latest(REGISTRY).decode()
        assert 'sglang:prefetched_tokens_total{attn_cp_rank="1",attn_cp_size="2"' in text
        assert "sglang_cp_hicache:l3_joined_requests_total{" in text
    finally:
        cl.close()


def test_without_enable_metrics_nothing_is_built(tmp_path):
    cl = cluster(2, tmp_path, metrics=False)
    try:
        assert all(c.cp_l3.metrics_sink is None for c in cl.caches)
        write(cl)  # publishing is a no-op
    finally:
        cl.close()


def test_clear_hicache_storage_removes_this_deployments_namespaces_on_every_rank(tmp_path):
    from sglang.srt.managers.io_struct import ClearHiCacheReqInput
    from sglang.srt.managers.scheduler import Scheduler

    from sglang_cp_hicache.l3.store import FilePageStore

    cl = cluster(2, tmp_path)
    try:
        write(cl)
        ours = own_objects(tmp_path, cl.caches[0])
        assert len(ours) == 2 * PAGES
        # Another deployment's objects (another namespace) in the same directory.
        other = FilePageStore(tmp_path)
        foreign = [f"{i:064x}_{'ab' * 8}_root" for i in range(3)]
        assert other.put(foreign, [b"x" * 10] * 3) == [True] * 3
        before = samples(cl, "sglang_cp_hicache:l3_cleared_objects_total")

        def clear(s):  # SGLang's own handler of POST /hicache/storage-backend/clear
            handler = SimpleNamespace(enable_hierarchical_cache=True, tree_cache=s.cache)
            return Scheduler.clear_hicache_storage_wrapped(handler, ClearHiCacheReqInput()).success

        assert cl.each(clear) == [True, True]
        assert cl.each(lambda s: s.cache.clear_storage_backend()) == [True, True]  # and again: nothing left
        assert own_objects(tmp_path, cl.caches[0]) == []
        assert other.exists(foreign) == [True] * 3
        cl.each(lambda s: s.cache.check_hicache_events())  # the next step publishes
        cleared = [a - b for a, b in zip(samples(cl, "sglang_cp_hicache:l3_cleared_objects_total"), before)]
        assert sum(cleared) == 2 * PAGES  # every object removed once, by one rank or the other
    finally:
        cl.close()
    cl = cluster(2, tmp_path)  # a new deployment finds nothing of the chain
    try:
        queues = sched.arrive(cl, ["m"])
        assert sched.waiting_pass(cl, queues) == [["m"], ["m"]]
        assert all(q["m"].storage_hit_length == 0 for q in queues)
    finally:
        cl.close()


def test_clear_without_l3_says_not_enabled(tmp_path):
    cl = CpCluster(CpStackConfig(cp_size=2, device_pages=8, host_pages=10), threaded=True, timeout_s=30)
    try:
        assert cl.each(lambda s: s.cache.clear_storage_backend()) == [False, False]
    finally:
        cl.close()
