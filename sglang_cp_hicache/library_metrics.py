"""Live metrics for what the library adds beside upstream's cache, both
releases (release-neutral; each adapter reads its own counters into a
:class:`LibraryFigures` and publishes it once per scheduler step).

With ``--enable-metrics`` every CP rank exports, labelled like SGLang's
storage metrics of that rank (:func:`~sglang_cp_hicache.l3.storage_metrics.rank_labels`:
``tp_rank``, ``dp_rank``, ``pp_rank``, ``pp_size``, ``attn_cp_rank``,
``attn_cp_size``, ``storage_backend``; ``none`` without L3), next to the
L3 counters ``sglang_cp_hicache:l3_*_total``:

* counters ``sglang_cp_hicache:<name>_total`` (:data:`COUNTER_HELP`);
* gauges ``sglang_cp_hicache:<name>`` (:data:`GAUGE_HELP`): this rank's
  host pages in use and its host page capacity, so the imbalance between
  CP ranks shows.

A counter a release cannot count is not exported there
(:data:`RELEASE_COUNTERS`). The adapters count with plain int increments
on the scheduler thread; :class:`PrometheusLibraryMetrics` adds what each
value grew by since the last step, as the L3 counters do.
``prometheus_client`` is imported only when one is built.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from sglang_cp_hicache.l3.metrics import LIBRARY_PREFIX, CounterGrowth, L3IoMeter, counter_names, metric_family

logger = logging.getLogger(__name__)

__all__ = [
    "COUNTER_HELP", "GAUGE_HELP", "RELEASE_COUNTERS", "LibraryFigures", "PrometheusLibraryMetrics",
    "exported_metric_names", "library_counter_name", "library_gauge_name",
]

#: What each library counter counts (the exported metric's help text).
COUNTER_HELP = {
    "backups": "Host backups of device nodes the library started on this rank (write-through; "
               "own pages copied, a zero-owned rank queues an empty one).",
    "backup_failures": "Backups refused on this rank: no host room for the node (or, 0.5.18, taken back "
                       "at the step's all-reduce after a local failure).",
    "backups_kept_by_host_room": "0.5.23: backups whose owner-cyclic run of host pages did not fit on "
                                 "arrival and fitted after the library's owner-aware host eviction -- the "
                                 "backups upstream's one token-sized evict_host puts at risk (it keeps one only "
                                 "when the LRU pages it frees happen to be of the short owner classes).",
    "backups_kept_lost_upstream": "0.5.23: of backups_kept_by_host_room, those upstream's rule loses for certain: "
                                  "its token floor asks evict_host for more tokens than every evictable host page "
                                  "holds, so it falls short and drops the backup.",
    "backups_unfittable_evictions_spared": "0.5.23: backups that could not fit even after evicting every "
                                           "evictable host page, where the library evicted nothing (upstream "
                                           "evicts pages and still loses the backup).",
    "device_index_host_reads": "Device locs read back on the host (one device-to-host sync each on a GPU): "
                               "0.5.23 upstream's allocator.free outside a free group; 0.5.18 inserts "
                               "without the CPU page mirror.",
    "device_index_host_reads_avoided": "Device-loc reads the library did without: 0.5.23 frees split from "
                                       "their rotation phase where upstream's free (or free-group end) "
                                       "reads the locs; 0.5.18 inserts whose pages came from the CPU mirror.",
    "load_backs": "Host-to-device load-backs this rank performed (logical chains restored).",
    "load_back_tokens": "Logical tokens of those load-backs.",
    "load_backs_declined": "0.5.18: load-backs the cache declined (below the threshold, over the memory "
                           "quota, or no owner lane room even after evicting).",
    "load_back_declined_tokens": "0.5.18: logical host tokens of the declined load-backs.",
}
#: What each gauge shows.
GAUGE_HELP = {
    "host_pages_in_use": "Host pages this rank holds now (its own pages of backed-up nodes).",
    "host_pages_capacity": "Host pages this rank can hold.",
}
#: The counters each release exports (a release that cannot see the event
#: exports nothing for it; docs/metrics.md says why).
RELEASE_COUNTERS = {
    "0.5.18": ("backups", "backup_failures", "device_index_host_reads", "device_index_host_reads_avoided",
               "load_backs", "load_back_tokens", "load_backs_declined", "load_back_declined_tokens"),
    "0.5.23": ("backups", "backup_failures", "backups_kept_by_host_room", "backups_kept_lost_upstream",
               "backups_unfittable_evictions_spared",
               "device_index_host_reads", "device_index_host_reads_avoided", "load_backs", "load_back_tokens"),
}


def library_counter_name(name: str) -> str:
    return f"{LIBRARY_PREFIX}{name}_total"


def library_gauge_name(name: str) -> str:
    return f"{LIBRARY_PREFIX}{name}"


def exported_metric_names(l3_fields: Mapping[str, Any]) -> set[str]:
    """Every metric name the library exports on either release: its own
    counters and gauges, and the L3 counters of ``l3_fields`` (an
    :class:`~sglang_cp_hicache.l3.host_tier.L3Counters`' fields) with the
    I/O totals."""
    names = {library_counter_name(n) for n in COUNTER_HELP} | {library_gauge_name(n) for n in GAUGE_HELP}
    return names | set(counter_names({**dict(l3_fields), **L3IoMeter().totals()}).values())


@dataclass
class LibraryFigures:
    """One rank's library figures now: monotonic counts (``counters``, by
    :data:`COUNTER_HELP` name) and gauges (``gauges``, by :data:`GAUGE_HELP` name)."""

    counters: dict[str, int] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)


class PrometheusLibraryMetrics:
    """One rank's library figures as Prometheus metrics, created the way
    SGLang creates its collectors (``prometheus_client``'s default registry,
    so its multiprocess mode collects them). ``counters``: the names this
    release exports (:data:`RELEASE_COUNTERS`); ``counter_cls`` /
    ``gauge_cls``: classes with ``prometheus_client``'s interface (SGLang's
    stat-logger hook), None for prometheus_client's own."""

    def __init__(self, labels: Mapping[str, Any], counters: tuple[str, ...],
                 counter_cls: Optional[Any] = None, gauge_cls: Optional[Any] = None) -> None:
        unknown = [n for n in counters if n not in COUNTER_HELP]
        if unknown:
            raise ValueError(f"unknown library counters {unknown}")
        if counter_cls is None or gauge_cls is None:
            from prometheus_client import Counter, Gauge

            counter_cls, gauge_cls = counter_cls or Counter, gauge_cls or Gauge
        self.labels = {k: str(v) for k, v in labels.items()}
        names = tuple(self.labels)
        self.counter_names = {n: library_counter_name(n) for n in counters}
        self.gauge_names = {n: library_gauge_name(n) for n in GAUGE_HELP}
        self._counters = CounterGrowth({
            n: metric_family(counter_cls, names, m, COUNTER_HELP[n]).labels(**self.labels)
            for n, m in self.counter_names.items()
        })
        self._gauges = {
            # multiprocess_mode as SGLang's gauges
            n: metric_family(gauge_cls, names, m, GAUGE_HELP[n], multiprocess_mode="mostrecent").labels(**self.labels)
            for n, m in self.gauge_names.items()
        }

    def publish_step(self, figures: Callable[[], LibraryFigures], cp_rank: int) -> None:
        """:meth:`publish` ``figures()`` once a scheduler step. Never raises:
        a metrics failure is logged, the step goes on."""
        try:
            self.publish(figures())
        except Exception:
            logger.exception("sglang-cp-hicache: publishing the library's metrics failed on cp_rank %d", cp_rank)

    def publish(self, figures: LibraryFigures) -> None:
        """Add what each counter grew by since the last call; set the gauges."""
        self._counters.publish(figures.counters)
        for name, value in figures.gauges.items():
            gauge = self._gauges.get(name)
            if gauge is not None:
                gauge.set(value)
