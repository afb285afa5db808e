"""The library's live counters on SGLang 0.5.18's CP cache, two ranks in one
process (``--enable-metrics``): a declined load-back and a performed one
move their counters by one chain and its logical tokens on every rank, the
host gauge follows each rank's own pages, and without the flag nothing is
built. (The counters against the simulator's report: tests/sim/test_simulate_metrics.py.)"""

from __future__ import annotations

import pytest

from sglang_cp_hicache import settings
from sglang_cp_hicache.testing.stack_0518 import CpStackConfig
from tests.helpers.cp_cluster import P, CpCluster, seq
from tests.helpers.radix_metrics import per_cache_radix_collector

prometheus_client = pytest.importorskip("prometheus_client")
N = 2


@pytest.fixture(autouse=True)
def _no_l3(monkeypatch):
    monkeypatch.delenv(settings.L3_DIR.name, raising=False)


def _values(cl: CpCluster, name: str) -> list[float]:
    return [prometheus_client.REGISTRY.get_sample_value(name, c.cp_metrics.publisher.labels) or 0.0
            for c in cl.caches]


def _grown(before: list[float], cl: CpCluster, name: str) -> list[float]:
    return [a - b for a, b in zip(_values(cl, name), before)]


def test_load_backs_declined_and_performed_are_counted_on_every_rank():
    # SGLang's radix collector has no rank label: one registry per cache (ranks share this process)
    config = CpStackConfig(cp_size=N, device_pages=6, host_pages=10, enable_metrics=True,
                           server_args=(("stat_loggers", {"radix_cache": per_cache_radix_collector()}),))
    with CpCluster(config, threaded=True, timeout_s=30) as cl:
        names = {n: f"sglang_cp_hicache:{n}_total" for n in
                 ("backups", "load_backs", "load_back_tokens", "load_backs_declined", "load_back_declined_tokens",
                  "device_index_host_reads", "device_index_host_reads_avoided")}
        before = {n: _values(cl, m) for n, m in names.items()}
        tokens = seq(300, 3)
        cl.insert(tokens)
        cl.step()
        cl.evict_device(len(tokens))
        assert all(locs.numel() == 0 for locs in cl.device_locs(tokens))

        def declined(s):  # no device quota: the load-back is declined
            assert CpCluster.start_load_back(s, tokens, mem_quota=0) == 0
            s.cache.check_hicache_events()

        cl.each(declined)
        assert _grown(before["load_backs_declined"], cl, names["load_backs_declined"]) == [1] * N
        assert _grown(before["load_back_declined_tokens"], cl, names["load_back_declined_tokens"]) == [3 * P] * N
        assert _grown(before["load_backs"], cl, names["load_backs"]) == [0] * N

        cl.load_back(tokens)
        cl.each(lambda s: s.cache.check_hicache_events())
        assert _grown(before["load_backs"], cl, names["load_backs"]) == [1] * N
        assert _grown(before["load_back_tokens"], cl, names["load_back_tokens"]) == [3 * P] * N
        assert _grown(before["backups"], cl, names["backups"]) == [1] * N
        assert _grown(before["device_index_host_reads"], cl, names["device_index_host_reads"]) == [0] * N
        assert all(g >= 1 for g in _grown(before["device_index_host_reads_avoided"], cl,
                                           names["device_index_host_reads_avoided"]))
        # each rank's gauge: its own pages of the backed-up node (3 pages over 2 ranks)
        in_use = _values(cl, "sglang_cp_hicache:host_pages_in_use")
        assert sum(in_use) == 3 and sorted(in_use) == [1, 2]
        assert [c.cp_metrics.publisher.labels["attn_cp_rank"] for c in cl.caches] == ["0", "1"]


def test_without_enable_metrics_nothing_is_built():
    with CpCluster(CpStackConfig(cp_size=N, device_pages=6, host_pages=10), threaded=True, timeout_s=30) as cl:
        assert all(c.cp_metrics is None for c in cl.caches)
        cl.insert(seq(300, 1))
        cl.each(lambda s: s.cache.check_hicache_events())
