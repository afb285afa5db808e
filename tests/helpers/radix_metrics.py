"""SGLang's radix-cache metrics collector for ranks simulated in one process."""

from __future__ import annotations

from functools import partial


def per_cache_radix_collector() -> type:
    """SGLang's radix-cache collector registering in a registry of its own:
    it has no rank label, so ranks simulated in one process would register
    it twice (a server runs one cache per process). The storage collector
    and the library's counters stay in the default registry, as a server's."""
    import prometheus_client  # imported by the caller's importorskip first
    from sglang.srt.observability.metrics_collector import RadixCacheMetricsCollector

    class PerCacheRadixCollector(RadixCacheMetricsCollector):
        def __init__(self, labels):
            registry = prometheus_client.CollectorRegistry()
            self._counter_cls = partial(prometheus_client.Counter, registry=registry)
            self._gauge_cls = partial(prometheus_client.Gauge, registry=registry)
            self._histogram_cls = partial(prometheus_client.Histogram, registry=registry)
            super().__init__(labels)

    return PerCacheRadixCollector
