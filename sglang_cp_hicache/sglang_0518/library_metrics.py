"""The library's live metrics on SGLang 0.5.18's CP cache
(``--enable-metrics``; names and meanings in :mod:`sglang_cp_hicache.library_metrics`).

Each step, after upstream's ``check_hicache_events``, the cache's counters
(:class:`~.counters.CpHiCacheCounters`, plain ints its collaborators bump)
and this rank's row of the host ledger are published with the labels SGLang
gives the rank's storage metrics. Counters a take-back lowers
(``write_backups``, ``load_backs``) are exported with what was taken back
added again, so the exported counters only grow.

Not on 0.5.18: ``backups_kept_by_host_room``, ``backups_kept_lost_upstream``
and ``backups_unfittable_evictions_spared`` -- upstream 0.5.18 has no CP-sharded
host pool whose backups could be lost (every backup here is the library's,
room decided by its host ledger; a refusal is ``backup_failures``).
"""

from __future__ import annotations

from typing import Any, Optional

from sglang_cp_hicache.l3.storage_metrics import rank_labels
from sglang_cp_hicache.library_metrics import RELEASE_COUNTERS, LibraryFigures, PrometheusLibraryMetrics
from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.sglang_0518.counters import CpHiCacheCounters
from sglang_cp_hicache.sglang_0518.host_tier import HostTier

__all__ = ["LibraryMetrics0518", "tp_and_dp_rank"]


def tp_and_dp_rank(cp_rank: int) -> tuple[int, int]:
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


class LibraryMetrics0518:
    """One CP cache's library metrics (``publish`` once per step)."""

    def __init__(self, cache: Any, placement: CpPlacement, counters: CpHiCacheCounters, host: HostTier,
                 server_args: Any) -> None:
        self.placement = placement
        self.counters = counters
        self.host = host
        backend: Optional[str] = getattr(server_args, "hicache_storage_backend", None)
        labels = rank_labels(cache, placement, backend or "none", getattr(server_args, "extra_metric_labels", None),
                             tp_and_dp_rank)
        self.publisher = PrometheusLibraryMetrics(labels, RELEASE_COUNTERS["0.5.18"])

    def figures(self) -> LibraryFigures:
        c, P, rank = self.counters, self.placement.page_size, self.placement.cp_rank
        ledger = self.host.ledger  # read each step: a reset replaces it
        return LibraryFigures(
            counters={
                "backups": c.write_backups + c.write_takebacks,
                "backup_failures": c.write_failures,
                "device_index_host_reads": c.device_page_reads,
                "device_index_host_reads_avoided": c.device_page_reads_avoided,
                "load_backs": c.load_backs + c.load_back_takebacks,
                "load_back_tokens": c.load_back_tokens + c.load_back_takeback_tokens,
                "load_backs_declined": c.load_backs_declined,
                "load_back_declined_tokens": c.load_back_declined_tokens,
            },
            gauges={"host_pages_in_use": ledger.used[rank] // P, "host_pages_capacity": ledger.capacity[rank] // P},
        )

    def publish(self) -> None:
        """This step's figures (never raises: see ``publish_step``)."""
        self.publisher.publish_step(self.figures, self.placement.cp_rank)
