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
with the same labels (:class:`~sglang_cp_hicache.l3.metrics.PrometheusL3Counters`);
what both releases share is :mod:`sglang_cp_hicache.l3.storage_metrics`.
"""

from __future__ import annotations

from typing import Any, Optional

from sglang.srt.observability.metrics_collector import (
    STAT_LOGGER_ROLE_STORAGE,
    StorageMetrics,
    StorageMetricsCollector,
    resolve_collector_class,
)
from sglang.srt.runtime_context import get_server_args

from sglang_cp_hicache.l3.metrics import PrometheusL3Counters
from sglang_cp_hicache.l3.rank import RankL3
from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.l3.storage_metrics import StorageCollectorSink, shared_collector, storage_labels

__all__ = ["install_metrics", "rank_labels"]


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


def rank_labels(
    cache: Any, placement: CpPlacement, storage_backend: str, extra_metric_labels: Optional[dict]
) -> dict[str, Any]:
    """The labels ``HiRadixCache`` gives its storage metrics."""
    tp_rank, dp_rank = _tp_and_dp_rank(placement.cp_rank)
    return storage_labels(
        storage_backend=storage_backend, tp_rank=tp_rank, dp_rank=dp_rank, pp_rank=cache.pp_rank,
        pp_size=cache.pp_size, cp_rank=placement.cp_rank, cp_size=placement.cp_size,
        extra_metric_labels=extra_metric_labels,
    )


def install_metrics(cache: Any, placement: CpPlacement, l3: RankL3, server_args: Any) -> StorageCollectorSink:
    """Metrics for ``cache``'s L3 (``--enable-metrics``): SGLang's storage
    collector when the storage flag is set, the library's counters always.
    Sets ``cache.storage_metrics_collector`` as SGLang names it (its own
    feeds stay off: ``enable_storage_metrics`` gates SGLang's storage
    controller, which CP never builds)."""
    backend = getattr(server_args, "hicache_storage_backend", None)
    labels = rank_labels(cache, placement, backend or "none", getattr(server_args, "extra_metric_labels", None))
    collector = None
    if backend is not None:
        cls = resolve_collector_class(get_server_args(), STAT_LOGGER_ROLE_STORAGE, StorageMetricsCollector)
        collector = shared_collector(cls, labels)
    cache.storage_metrics_collector = collector
    counter_cls = getattr(collector, "_counter_cls", None)
    library = PrometheusL3Counters(labels, l3.metrics.snapshot(), counter_cls)
    sink = StorageCollectorSink(library, StorageMetrics, collector)
    l3.attach_metrics(sink)
    return sink
