"""SGLang 0.5.18's storage metrics, fed by the CP cache's L3.

With ``--enable-metrics`` and ``--hicache-storage-backend``, SGLang builds a
``StorageMetricsCollector`` and its storage controller feeds it. Under CP
that controller is never built (the base cache is built without the flag),
so this module builds the collector the way ``HiRadixCache`` does -- the
class ``stat_loggers`` names for the ``storage`` role, SGLang's labels --
and feeds it from the rank's L3 each step:

* ``sglang:prefetched_tokens_total``: logical tokens restored from L3 (every
  rank alike, as SGLang counts its prefetch);
* ``sglang:backuped_tokens_total``: tokens of this rank's own pages stored
  in L3 or found sound there;
* ``sglang:prefetch_pgs`` / ``sglang:backup_pgs``: own pages per fetch /
  store operation; ``sglang:prefetch_bandwidth`` / ``sglang:backup_bandwidth``:
  their GB/s (2**30 bytes per second).

The library's counters go out beside them as ``sglang_cp_hicache:l3_*_total``
with the same labels (:class:`~sglang_cp_hicache.l3.metrics.PrometheusL3Counters`).
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Optional

from sglang.srt.observability.metrics_collector import (
    STAT_LOGGER_ROLE_STORAGE,
    StorageMetrics,
    StorageMetricsCollector,
    resolve_collector_class,
)
from sglang.srt.runtime_context import get_server_args

from sglang_cp_hicache.l3.metrics import L3StepFigures, PrometheusL3Counters
from sglang_cp_hicache.l3.rank import L3MetricsSink, RankL3

__all__ = ["L3Metrics0518", "install_metrics", "storage_collector", "storage_labels"]

_SHARED: dict[type, Any] = {}
_SHARED_LOCK = threading.Lock()


def _tp_and_dp_rank(cp_rank: int) -> tuple[int, int]:
    """SGLang's ``tp_rank`` / ``dp_rank`` storage labels (attention TP and DP
    ranks under DP attention); without SGLang's model-parallel groups (the
    cache used directly: the simulator, tests) the CP rank and 0."""
    from sglang.srt.layers.dp_attention import get_attention_dp_rank, is_dp_attention_enabled
    from sglang.srt.runtime_context import get_parallel

    try:
        if is_dp_attention_enabled():
            return int(get_parallel().attn_tp_rank), int(get_attention_dp_rank())
        return int(get_parallel().tp_rank), 0
    except (AssertionError, RuntimeError):  # no model-parallel group / rank written in this process
        return cp_rank, 0


def storage_labels(cache: Any, storage_backend: str, extra_metric_labels: Optional[dict]) -> dict[str, Any]:
    """The labels ``HiRadixCache`` gives its storage metrics."""
    tp_rank, dp_rank = _tp_and_dp_rank(cache.cp_layout.cp_rank)
    labels: dict[str, Any] = {
        "storage_backend": storage_backend,
        "tp_rank": tp_rank,
        "dp_rank": dp_rank,
        "pp_rank": cache.pp_rank,
        "pp_size": cache.pp_size,
        "attn_cp_rank": cache.cp_layout.cp_rank,
        "attn_cp_size": cache.cp_layout.cp_size,
    }
    if extra_metric_labels:
        labels.update(extra_metric_labels)
    return labels


def storage_collector(labels: dict[str, Any]) -> Any:
    """SGLang's storage collector with ``labels``. Its metrics are registered
    once per process (several ranks simulated in one process share them,
    each with its own labels), as SGLang relabels its collector on re-attach."""
    cls = resolve_collector_class(get_server_args(), STAT_LOGGER_ROLE_STORAGE, StorageMetricsCollector)
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


class L3Metrics0518(L3MetricsSink):
    """One rank's L3 figures into SGLang's storage collector (None: no
    storage flag) and the library's counters."""

    def __init__(self, collector: Optional[Any], library: PrometheusL3Counters) -> None:
        self.collector = collector
        self.library = library

    def publish(self, figures: L3StepFigures, totals: dict[str, float]) -> None:
        if self.collector is not None and figures:
            c = self.collector
            c.log_prefetched_tokens(figures.restored_tokens)
            c.log_backuped_tokens(figures.backed_up_tokens)
            reads = [s for s in figures.reads if s.pages]
            writes = [s for s in figures.writes if s.pages]
            if reads or writes:
                c.log_storage_metrics(StorageMetrics(
                    prefetch_pgs=[s.pages for s in reads], backup_pgs=[s.pages for s in writes],
                    prefetch_bandwidth=[s.gib_per_s for s in reads if s.seconds > 0],
                    backup_bandwidth=[s.gib_per_s for s in writes if s.seconds > 0],
                ))
        self.library.publish(totals)


def install_metrics(cache: Any, l3: RankL3, server_args: Any) -> L3Metrics0518:
    """Metrics for ``cache``'s L3 (``--enable-metrics``): SGLang's storage
    collector when the storage flag is set, the library's counters always.
    Sets ``cache.storage_metrics_collector`` as SGLang names it (its own
    feeds stay off: ``enable_storage_metrics`` gates SGLang's storage
    controller, which CP never builds)."""
    backend = getattr(server_args, "hicache_storage_backend", None)
    labels = storage_labels(cache, backend or "none", getattr(server_args, "extra_metric_labels", None))
    collector = storage_collector(labels) if backend is not None else None
    cache.storage_metrics_collector = collector
    counter_cls = getattr(collector, "_counter_cls", None)
    library = PrometheusL3Counters(labels, l3.metrics.snapshot(), counter_cls)
    sink = L3Metrics0518(collector, library)
    l3.metrics_sink = sink
    return sink
