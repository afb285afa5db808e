"""The one record of what the library added to one sharded DSA stack.

:class:`~.strategy.LibraryDsaStrategy` builds it at the end of ``build`` and
hands it to the controller it built (:attr:`~.controller.LibraryCopyController.cp_stack`,
the one attribute the library's controller class declares for it); tools
and tests reach it through :func:`.controller.library_stack`. Nothing of it
is found by name on an SGLang object. This module imports nothing of the
controller: the record points down to its parts, the controller to it.

Methods the library replaces on SGLang instances when it builds a stack
(each kept and called as upstream's where the replacement falls back; every
one is listed in :data:`~.hooks.HOOKS` and checked at start-up):

* ``host_room`` (:class:`~.host_room.OwnerAwareHostRoom`): the cache's
  ``_execute_kv_backup``;
* ``device_frees`` (:class:`~.device_free.PhaseKnownDeviceFrees`): the FULL
  component's ``evict_component``, the device allocator's ``free``,
  ``free_segment`` and ``free_group_end``;
* ``run_frees`` (:class:`~.request_free.KnownRunFrees`): the cache's
  ``insert``, ``claim_kv_row``, ``free_kv_row`` and ``on_release``;
* ``l3`` (:class:`~.l3_cache.L3Driver`, only with L3 on): the cache's
  ``prefetch_from_storage``, ``check_prefetch_progress``,
  ``release_aborted_request``, ``check_hicache_events``,
  ``_sync_hicache_ready_counts``, ``_all_reduce``,
  ``_finish_write_through_ack``, ``reset`` and ``clear_storage_backend``; with
  ``--enable-metrics`` also the storage attachment's ``apply_runtime_config``
  (:func:`.l3_cache.install_metrics`);
* ``metrics`` (:class:`~.library_metrics.LibraryMetrics0523`, only with
  ``--enable-metrics``): the cache's ``check_hicache_events`` (wrapped last,
  to publish the library's counters each step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sglang_cp_hicache.kernels.compile import WarmupReport
from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.sglang_0523.device_free import PhaseKnownDeviceFrees
from sglang_cp_hicache.sglang_0523.host_room import OwnerAwareHostRoom
from sglang_cp_hicache.sglang_0523.l3_cache import L3Driver
from sglang_cp_hicache.sglang_0523.library_metrics import LibraryMetrics0523
from sglang_cp_hicache.sglang_0523.request_free import KnownRunFrees

__all__ = ["CpStack0523"]


@dataclass(frozen=True, eq=False)  # holds live objects: compared by identity
class CpStack0523:
    """What the library added to one sharded stack (one per cache, per rank)."""

    placement: CpPlacement
    host_room: OwnerAwareHostRoom  # owner-aware host room for backups
    device_frees: PhaseKnownDeviceFrees  # device frees from rotation phases
    run_frees: KnownRunFrees  # the runs those frees come from (inserts, request releases)
    warmup: WarmupReport  # the copy kernels' warm-up at build
    l3: Optional[L3Driver] = None  # the L3 driver (its port: ``l3.port``); None without L3
    metrics: Optional[LibraryMetrics0523] = None  # the library's live metrics; None without --enable-metrics
