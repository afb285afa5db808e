"""SGLang 0.5.23's storage metrics on the KV-sharded stack, fed by the
library's L3.

With ``--enable-metrics`` and ``--hicache-storage-backend``, SGLang's cache
builds a ``StorageMetricsCollector`` when storage turns on
(``StorageAttachment.apply_runtime_config``), labelled from its storage
controller's config, and the controller feeds it. Under CP that controller
is never attached (the stack is built without a storage backend), so SGLang
could neither label nor feed the collector. The library takes that one call
over on the cache instance: upstream's runs with its metrics off, then the
collector is built as SGLang builds it (the class ``stat_loggers`` names for
the ``storage`` role, SGLang's labels) and fed from the rank's L3:

* each step: ``sglang:prefetched_tokens_total`` (logical tokens restored,
  every rank alike), ``sglang:backuped_tokens_total`` (tokens of this rank's
  own pages stored or found sound), ``sglang:hicache_backup_dropped_tokens_total``
  (own pages' writes dropped: queue full), and per fetch / store operation
  ``sglang:prefetch_pgs`` / ``sglang:backup_pgs`` and GB/s;
* by the port, when the query's MIN settles: ``sglang:storage_prefetch_hit_tokens_total``
  (tokens present on their owners) and ``sglang:storage_prefetch_unfulfilled_tokens_total``
  with reason ``host_capacity`` (no host room) or ``storage_transfer`` (fewer
  pages fetched and verified on their owners than were present: missing or
  refused objects, I/O errors, a deadline, or every waiting request aborted).

The library's counters go out beside them as ``sglang_cp_hicache:l3_*_total``.
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

from sglang_cp_hicache.l3.metrics import L3StepFigures, PrometheusL3Counters
from sglang_cp_hicache.l3.rank import L3MetricsSink, RankL3

__all__ = ["L3Metrics0523", "install_metrics", "storage_collector", "storage_labels"]

_SHARED: dict[type, Any] = {}
_SHARED_LOCK = threading.Lock()


def _tp_and_dp_rank(cp_rank: int) -> tuple[int, int]:
    """SGLang's ``tp_rank`` / ``dp_rank`` storage labels (its storage
    config's); without SGLang's model-parallel groups (the cache used
    directly: the simulator, tests) the CP rank and 0."""
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.runtime_context import get_parallel

    try:
        parallel = get_parallel()
        if is_dp_attention_enabled():
            return int(parallel.attn_tp_rank), int(parallel.attn_dp_rank)
        return int(parallel.tp_rank), 0
    except (AssertionError, RuntimeError):  # no model-parallel group / rank written in this process
        return cp_rank, 0


def storage_labels(cache: Any, layout: Any, storage_backend: Optional[str],
                   extra_metric_labels: Optional[dict]) -> dict[str, Any]:
    """The labels SGLang gives its storage metrics (``_resolve_metrics_collector``)."""
    tp_rank, dp_rank = _tp_and_dp_rank(layout.cp_rank)
    labels: dict[str, Any] = {
        "storage_backend": storage_backend,
        "tp_rank": tp_rank,
        "dp_rank": dp_rank,
        "pp_rank": cache.pp_rank,
        "pp_size": cache.pp_size,
        "attn_cp_rank": layout.cp_rank,
        "attn_cp_size": layout.cp_size,
    }
    if extra_metric_labels:
        labels.update(extra_metric_labels)
    return labels


def storage_collector(labels: dict[str, Any]) -> Any:
    """SGLang's storage collector with ``labels``; its metrics are registered
    once per process (ranks simulated in one process, or a stack built again,
    share them with their own labels, as SGLang relabels on re-attach)."""
    cls = resolve_collector_class(STAT_LOGGER_ROLE_STORAGE, StorageMetricsCollector)
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


class L3Metrics0523(L3MetricsSink):
    """One rank's L3 figures into SGLang's storage collector (None until
    storage turns on) and the library's counters."""

    def __init__(self, library: PrometheusL3Counters) -> None:
        self.collector: Optional[Any] = None
        self.library = library

    def publish(self, figures: L3StepFigures, totals: dict[str, float]) -> None:
        c = self.collector
        if c is not None and figures:
            c.log_prefetched_tokens(figures.restored_tokens)
            c.log_backuped_tokens(figures.backed_up_tokens)
            c.log_backup_dropped_tokens(figures.dropped_backup_tokens)
            reads = [s for s in figures.reads if s.pages]
            writes = [s for s in figures.writes if s.pages]
            if reads or writes:
                c.log_storage_metrics(StorageMetrics(
                    prefetch_pgs=[s.pages for s in reads], backup_pgs=[s.pages for s in writes],
                    prefetch_bandwidth=[s.gib_per_s for s in reads if s.seconds > 0],
                    backup_bandwidth=[s.gib_per_s for s in writes if s.seconds > 0],
                ))
        self.library.publish(totals)

    # ---- the port's figures (scheduler thread) ---------------------------------------
    def hit(self, tokens: int) -> None:
        if self.collector is not None:
            self.collector.log_storage_prefetch_hit_tokens(tokens)

    def unfulfilled(self, tokens: int, reason: str) -> None:
        if self.collector is not None:
            self.collector.log_storage_prefetch_unfulfilled_tokens(tokens, reason)


def install_metrics(cache: Any, l3: RankL3, port: Any, layout: Any, storage_backend: Optional[str]) -> L3Metrics0523:
    """Metrics for ``cache``'s L3 (``--enable-metrics``): the library's
    counters now; SGLang's storage collector when storage turns on (the
    cache's ``apply_runtime_config``, taken over on the instance: see the
    module doc); ``storage_backend``: the flag's value (None: no flag).
    ``cache.storage_metrics_collector`` is SGLang's name for the collector;
    ``cache.enable_storage_metrics`` stays False (it gates the feeds of
    SGLang's storage controller, which CP never attaches)."""
    labels = storage_labels(cache, layout, storage_backend or "none", getattr(cache, "extra_metric_labels", None))
    sink = L3Metrics0523(PrometheusL3Counters(labels, l3.metrics.snapshot()))
    l3.metrics_sink = sink
    port.metrics = sink
    attachment = cache._storage_attachment
    upstream = attachment.apply_runtime_config

    def apply_runtime_config(**kwargs: Any) -> None:
        upstream(**{**kwargs, "enable_storage_metrics": False})
        if kwargs.get("enable_storage_metrics"):
            labels = storage_labels(cache, layout, kwargs.get("storage_backend"), kwargs.get("extra_metric_labels"))
            sink.collector = cache.storage_metrics_collector = storage_collector(labels)

    attachment.apply_runtime_config = apply_runtime_config
    return sink
