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

from typing import Any, Optional

from sglang.srt.observability.metrics_collector import (
    STAT_LOGGER_ROLE_STORAGE,
    StorageMetrics,
    StorageMetricsCollector,
    resolve_collector_class,
)

from sglang_cp_hicache.l3.metrics import PrometheusL3Counters
from sglang_cp_hicache.l3.rank import RankL3
from sglang_cp_hicache.l3.storage_metrics import StorageCollectorSink, shared_collector, storage_labels

__all__ = ["install_metrics", "rank_labels"]


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


def rank_labels(cache: Any, placement: Any, storage_backend: Optional[str],
                extra_metric_labels: Optional[dict]) -> dict[str, Any]:
    """The labels SGLang gives its storage metrics (``_resolve_metrics_collector``)."""
    tp_rank, dp_rank = _tp_and_dp_rank(placement.cp_rank)
    return storage_labels(
        storage_backend=storage_backend, tp_rank=tp_rank, dp_rank=dp_rank, pp_rank=cache.pp_rank,
        pp_size=cache.pp_size, cp_rank=placement.cp_rank, cp_size=placement.cp_size,
        extra_metric_labels=extra_metric_labels,
    )


def install_metrics(cache: Any, l3: RankL3, port: Any, placement: Any,
                    storage_backend: Optional[str]) -> StorageCollectorSink:
    """Metrics for ``cache``'s L3 (``--enable-metrics``): the library's
    counters now; SGLang's storage collector when storage turns on (the
    cache's ``apply_runtime_config``, taken over on the instance: see the
    module doc); ``storage_backend``: the flag's value (None: no flag).
    ``cache.storage_metrics_collector`` is SGLang's name for the collector;
    ``cache.enable_storage_metrics`` stays False (it gates the feeds of
    SGLang's storage controller, which CP never attaches)."""
    labels = rank_labels(cache, placement, storage_backend or "none", getattr(cache, "extra_metric_labels", None))
    sink = StorageCollectorSink(PrometheusL3Counters(labels, l3.metrics.snapshot()), StorageMetrics)
    l3.attach_metrics(sink)
    port.metrics = sink
    attachment = cache._storage_attachment
    upstream = attachment.apply_runtime_config

    def apply_runtime_config(**kwargs: Any) -> None:
        upstream(**{**kwargs, "enable_storage_metrics": False})
        if kwargs.get("enable_storage_metrics"):
            labels = rank_labels(cache, placement, kwargs.get("storage_backend"), kwargs.get("extra_metric_labels"))
            cls = resolve_collector_class(STAT_LOGGER_ROLE_STORAGE, StorageMetricsCollector)
            cache.storage_metrics_collector = shared_collector(cls, labels)
            sink.attach_collector(cache.storage_metrics_collector)

    attachment.apply_runtime_config = apply_runtime_config
    return sink
