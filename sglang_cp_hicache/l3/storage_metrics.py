"""SGLang's own storage metrics, fed from the CP L3 tier: the part both
releases share (SGLang-free; each adapter passes in its release's classes).

SGLang's HiCache logs its storage traffic through one collector per
scheduler process (``StorageMetricsCollector``: ``sglang:prefetched_tokens_total``,
``sglang:backuped_tokens_total``, ``sglang:prefetch_pgs``, bandwidth
histograms, storage hits). Under CP SGLang's storage controller never runs,
so nothing would feed it; :class:`StorageCollectorSink` does, from the
per-step figures of :class:`~.metrics.L3MetricsSource`, and publishes the
library's own counters beside them.
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Callable, Mapping, Optional

from sglang_cp_hicache.l3.metrics import L3StepFigures, PrometheusL3Counters
from sglang_cp_hicache.l3.rank import L3MetricsSink, RankL3

__all__ = ["StorageCollectorSink", "attach_storage_metrics", "rank_labels", "shared_collector"]

_SHARED: dict[type, Any] = {}
_SHARED_LOCK = threading.Lock()


def rank_labels(
    cache: Any, placement: Any, storage_backend: Optional[str], extra_metric_labels: Optional[Mapping[str, Any]],
    tp_and_dp_rank: Callable[[int], tuple[int, int]],
) -> dict[str, Any]:
    """The labels SGLang gives ``cache``'s storage metrics on this CP rank
    (both releases name the same ones), plus the operator's
    ``extra_metric_labels``; ``tp_and_dp_rank(cp_rank)``: the release's
    reading of its TP and DP ranks (its model-parallel state)."""
    tp_rank, dp_rank = tp_and_dp_rank(placement.cp_rank)
    labels: dict[str, Any] = {
        "storage_backend": storage_backend,
        "tp_rank": tp_rank,
        "dp_rank": dp_rank,
        "pp_rank": cache.pp_rank,
        "pp_size": cache.pp_size,
        "attn_cp_rank": placement.cp_rank,
        "attn_cp_size": placement.cp_size,
    }
    if extra_metric_labels:
        labels.update(extra_metric_labels)
    return labels


def shared_collector(cls: type, labels: Mapping[str, Any]) -> Any:
    """An instance of SGLang's collector class ``cls`` with ``labels``.
    Prometheus registers a metric name once per process, so the first
    caller builds the collector and later ones (several ranks simulated in
    one process, a stack built again) get a copy relabelled with their own
    labels, as SGLang relabels its collector on re-attach."""
    with _SHARED_LOCK:
        base = _SHARED.get(cls)
        if base is None:
            base = _SHARED[cls] = cls(labels=dict(labels))
            return base
    if set(base.labels) != set(labels):
        raise ValueError(f"storage metric labels {sorted(labels)} differ from this process's "
                         f"{sorted(base.labels)} (extra_metric_labels must be the same for every cache)")
    view = copy.copy(base)
    view.labels = dict(labels)
    return view


class StorageCollectorSink(L3MetricsSink):
    """One rank's L3 figures into SGLang's storage collector (``collector``;
    None: storage metrics off, or not on yet) and the library's counters.
    ``storage_metrics``: the release's ``StorageMetrics`` class. Figures a
    release's collector cannot log (0.5.18 has no dropped-backup or
    storage-hit counters) are left out."""

    def __init__(self, library: PrometheusL3Counters, storage_metrics: Callable[..., Any],
                 collector: Optional[Any] = None) -> None:
        self.collector = collector
        self.library = library
        self._storage_metrics = storage_metrics

    def attach_collector(self, collector: Any) -> None:
        """Feed ``collector`` (SGLang's, once storage turns on) from the next step on."""
        self.collector = collector

    def publish(self, figures: L3StepFigures, totals: dict[str, float]) -> None:
        c = self.collector
        if c is not None and figures:
            c.log_prefetched_tokens(figures.restored_tokens)
            c.log_backuped_tokens(figures.backed_up_tokens)
            if hasattr(c, "log_backup_dropped_tokens"):
                c.log_backup_dropped_tokens(figures.dropped_backup_tokens)
            reads = [s for s in figures.reads if s.pages]
            writes = [s for s in figures.writes if s.pages]
            if reads or writes:
                c.log_storage_metrics(self._storage_metrics(
                    prefetch_pgs=[s.pages for s in reads], backup_pgs=[s.pages for s in writes],
                    prefetch_bandwidth=[s.gib_per_s for s in reads if s.seconds > 0],
                    backup_bandwidth=[s.gib_per_s for s in writes if s.seconds > 0],
                ))
        self.library.publish(totals)

    # ---- a port's storage-hit figures (scheduler thread) ---------------------------
    def hit(self, tokens: int) -> None:
        if self.collector is not None and hasattr(self.collector, "log_storage_prefetch_hit_tokens"):
            self.collector.log_storage_prefetch_hit_tokens(tokens)

    def unfulfilled(self, tokens: int, reason: str) -> None:
        if self.collector is not None and hasattr(self.collector, "log_storage_prefetch_unfulfilled_tokens"):
            self.collector.log_storage_prefetch_unfulfilled_tokens(tokens, reason)


def attach_storage_metrics(
    l3: RankL3, labels: Mapping[str, Any], storage_metrics: Callable[..., Any], collector: Optional[Any] = None,
) -> StorageCollectorSink:
    """Export ``l3``'s figures from the next step on: the library's counters
    with ``labels`` (as ``collector``'s counter class where it has one:
    SGLang's multiprocess-safe counters) and SGLang's storage ``collector``
    (None: none yet)."""
    library = PrometheusL3Counters(dict(labels), l3.metrics.snapshot(), getattr(collector, "_counter_cls", None))
    sink = StorageCollectorSink(library, storage_metrics, collector)
    l3.attach_metrics(sink)
    return sink
