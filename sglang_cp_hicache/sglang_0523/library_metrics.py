"""The library's live metrics on SGLang 0.5.23's sharded stack
(``--enable-metrics``; names and meanings in :mod:`sglang_cp_hicache.library_metrics`).

Each step, after the cache's ``check_hicache_events`` (upstream's, or the
L3 driver's), one :class:`~sglang_cp_hicache.library_metrics.LibraryFigures`
is read from the counters the stack's parts keep as plain ints -- the
owner-aware host room (backups written, refused, kept by owner-aware
eviction, unfittable), the phase-known device frees (host reads of device
locs made and avoided), the library's controller (load-backs) -- and this
rank's own owner class of host pages, and published with the labels SGLang
gives the rank's storage metrics.

Declined load-backs are not counted here: on 0.5.23 the decision is
upstream's (``UnifiedRadixCache._load_back_transfers``: threshold, quota,
no device room), in code the library does not replace, and a decline never
reaches the controller.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from sglang_cp_hicache.l3.storage_metrics import rank_labels
from sglang_cp_hicache.library_metrics import RELEASE_COUNTERS, LibraryFigures, PrometheusLibraryMetrics
from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.sglang_0523.device_free import PhaseKnownDeviceFrees
from sglang_cp_hicache.sglang_0523.host_room import OwnerAwareHostRoom

__all__ = ["LibraryMetrics0523", "tp_and_dp_rank"]


def tp_and_dp_rank(cp_rank: int) -> tuple[int, int]:
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


class LibraryMetrics0523:
    """One sharded cache's library metrics, published once per step."""

    def __init__(self, cache: Any, controller: Any, placement: CpPlacement, host_room: OwnerAwareHostRoom,
                 device_frees: PhaseKnownDeviceFrees, storage_backend: Optional[str]) -> None:
        self.cache = cache
        self.controller = controller
        self.placement = placement
        self.host_room = host_room
        self.device_frees = device_frees
        labels = rank_labels(cache, placement, storage_backend or "none", getattr(cache, "extra_metric_labels", None),
                             tp_and_dp_rank)
        self.publisher = PrometheusLibraryMetrics(labels, RELEASE_COUNTERS["0.5.23"])
        # This rank's host pages: its pool's pages less local page 0, which
        # the sharded host allocator leaves unused (PageInterleaveHostPool.clear).
        anchor = controller.mem_pool_host.anchor_entry.host_pool
        self.host_pages_capacity = int(anchor.size) // placement.page_size - 1
        # The method the instance holds now (the L3 driver's when L3 is on):
        # build this last, then install.
        self._upstream_events: Callable[[], None] = cache.check_hicache_events

    def install(self) -> None:
        """Publish after the cache's ``check_hicache_events``."""
        self.cache.check_hicache_events = self.check_hicache_events

    def check_hicache_events(self) -> None:
        self._upstream_events()
        self.publish()

    def figures(self) -> LibraryFigures:
        room, frees = self.host_room.counters, self.device_frees.counters
        in_use = self.host_pages_capacity - self.host_room.host_class_free_pages()[self.placement.cp_rank]
        return LibraryFigures(
            counters={
                "backups": room.written,
                "backup_failures": room.refused,
                "backups_kept_by_host_room": room.room_made,
                "backups_kept_lost_upstream": room.room_made_lost_upstream,
                "backups_unfittable_evictions_spared": room.unfittable,
                "device_index_host_reads": frees.read_back,
                "device_index_host_reads_avoided": frees.reads_avoided,
                "load_backs": self.controller.load_backs,
                "load_back_tokens": self.controller.load_back_tokens,
            },
            gauges={"host_pages_in_use": in_use, "host_pages_capacity": self.host_pages_capacity},
        )

    def publish(self) -> None:
        """This step's figures (never raises: see ``publish_step``)."""
        self.publisher.publish_step(self.figures, self.placement.cp_rank)
