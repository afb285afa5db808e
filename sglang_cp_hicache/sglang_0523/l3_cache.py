"""L3 on the KV-sharded DSA cache (SGLang 0.5.23), driven by SGLang's scheduler.

UPSTREAM CONTRACT (pinned against the installed source by
``tests/sglang_0523/test_l3_upstream_contract_0523.py``): the lookup words
ride upstream's ready-ack all-reduce. ``_sync_hicache_ready_counts`` builds
one 1-D int64 tensor and MIN-reduces it with one ``self._all_reduce`` call,
then reads it back by position; the driver recognises that call as the
one MIN ``_all_reduce`` of a 1-D tensor made while the sync runs, appends
the words and copies upstream's part back. A release that reduces the
counts another way, twice, or not as a MIN breaks this silently: the test
fails first. Where upstream reduces through ``_all_reduce_attn_groups``
instead (buffer-only host memory under PP), no word rides and one MIN of
the words runs at ``check_hicache_events``, on every rank alike.

SGLang's own storage controller stays off (the stack is built without a
storage backend: its threads would write rank-local rows under logical slots
and key objects by rank). :class:`L3Driver` instead serves, on the cache
instance, the calls SGLang's scheduler makes when ``--hicache-storage-backend``
is set, with the library's prefetch protocol (:mod:`sglang_cp_hicache.l3.prefetch`,
this release's side in :mod:`.l3_port`) -- no collective of its own, every
L3 read and write on the rank's L3 I/O threads:

* ``prefetch_from_storage`` (a request arrives, alike on every rank): the
  whole pages past the matched prefix are looked up, when that prefix ends
  at the root or at a node whose host copy is final; a request whose chain
  is already being looked up under the same anchor waits on that lookup.
* ``check_hicache_events`` (every step): the words of the pending lookups
  ride the MIN all-reduce of ready acks SGLang already runs (one word per
  pending lookup, the same count on every rank), and the protocol acts on
  the agreed values.
* ``check_prefetch_progress`` is False while a request waits on a lookup;
  then ``pop_prefetch_loaded_span`` reports the restored span to the request
  that started it (upstream's own bookkeeping), and the normal load-back
  brings the node to the device.
* ``release_aborted_request``: the request stops waiting; a lookup no
  request waits on any more answers 0 at the next MIN on every rank.
* Write: when a node's write-through ack is consumed (every rank consumes
  the same acks), each rank stores the pages of the node it owns.

Keys with an ``extra_key`` or cache salt, and EAGLE bigram keys, stay out of L3.

Opening the tier is the wing's (:func:`sglang_cp_hicache.l3.opening.open_l3`);
this release binds it (:func:`l3_binding`): SGLang's page hash, and host
slots that are LOGICAL (identical on every rank): logical slot ``h`` belongs
to rank ``(h // P) % N`` at local row ``(h // (N * P)) * P + h % P`` of the
native host pools (MLA KV and DSA indexer), which hold local rows only.
Pages are keyed as on 0.5.18 (page hash + namespace digest, never CP rank or
size), so deployments of any CP size -- and the 0.5.18 adapter, for an
identical configuration -- share one store. The strategy opens L3 after the
host pools are built and before the CP ranks' start-up agreement, which
then includes both namespace digests; :func:`install_l3` puts the driver on
the cache once the ranks agree.

With ``--enable-metrics`` (:func:`install_metrics`), SGLang's cache builds
its ``StorageMetricsCollector`` when storage turns on
(``StorageAttachment.apply_runtime_config``), labelled and fed by its storage
controller -- which CP never attaches. The library takes that one call over
on the cache instance: upstream's runs with its metrics off, then the
collector is built as SGLang builds it and fed from the rank's L3 (which
series, and what each counts under CP: docs/l3.md, Metrics).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.utils import get_hash_str
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.observability.metrics_collector import (
    STAT_LOGGER_ROLE_STORAGE, StorageMetrics, StorageMetricsCollector, resolve_collector_class,
)

from sglang_cp_hicache.l3.location import L3Location
from sglang_cp_hicache.l3.opening import L3Binding, storage_segment_ranks
from sglang_cp_hicache.l3.rank import RankL3
from sglang_cp_hicache.l3.prefetch import CpL3PrefetchAborted, plain_key
from sglang_cp_hicache.l3.storage_metrics import StorageCollectorSink, attach_storage_metrics, rank_labels, shared_collector
from sglang_cp_hicache.l3_backends import store_opener
from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.sglang_0523.copy_engine import kv_host_pool_of
from sglang_cp_hicache.sglang_0523.l3_port import L3Port0523, path_tokens
from sglang_cp_hicache.sglang_0523.library_metrics import tp_and_dp_rank

logger = logging.getLogger(__name__)

__all__ = [
    "CpL3LookupAborted", "L3Driver", "install_l3", "install_metrics", "l3_binding", "local_row", "source_text",
]

_MIN = torch.distributed.ReduceOp.MIN

#: The one exception of a failed lookup MIN, under the name this adapter used.
CpL3LookupAborted = CpL3PrefetchAborted


@dataclass
class _Riding:
    """The words of this step's lookups, put on the ready-ack all-reduce."""

    words: list[int] = field(default_factory=list)
    agreed: Optional[list[int]] = None
    active: bool = False

    def stop(self) -> None:
        self.active = False

    def settle(self, agreed: list[int]) -> None:
        self.active, self.agreed = False, agreed


class L3Driver:
    """Serves the scheduler's storage calls on one cache instance."""

    def __init__(self, cache: Any, l3: RankL3, port: L3Port0523) -> None:
        self.cache = cache
        self.l3 = l3
        self.port = port
        self.tier = l3.tier
        self.placement = l3.tier.placement
        self.prefetcher = l3.prefetcher
        self._riding = _Riding()
        self._upstream: dict[str, Callable[..., Any]] = {}

    # ---- installation --------------------------------------------------------
    _REPLACED = ("prefetch_from_storage", "check_prefetch_progress", "release_aborted_request",
                 "check_hicache_events", "_sync_hicache_ready_counts", "_all_reduce", "_finish_write_through_ack",
                 "reset", "clear_storage_backend")

    def install(self) -> None:
        """Shadow the cache's methods on the instance (upstream's are kept and called)."""
        for name in self._REPLACED:
            self._upstream[name] = getattr(self.cache, name)
            setattr(self.cache, name, getattr(self, name))

    @property
    def counters(self) -> Any:
        return self.tier.counters

    @property
    def pending(self) -> list:
        return self.prefetcher.pending

    def wait_io(self, timeout: Optional[float] = None) -> bool:
        """Block until this rank's L3 I/O is done (tools and tests)."""
        return self.l3.wait_io(timeout)

    def reset(self) -> None:
        """A cache reset (flush, alike on every rank) clears the tree and the
        host pools: pending lookups go with them (their anchor locks and host
        slots no longer exist; their I/O writes nothing more)."""
        self._upstream["reset"]()
        self.prefetcher.reset()
        self._riding = _Riding()

    # ---- host -> L3 --------------------------------------------------------------
    def _finish_write_through_ack(self, ack_id: int) -> None:
        pending = self.cache.ongoing_write_through.get(ack_id)
        nodes = [] if pending is None else [self.cache.tree_core.node_by_id(i) for i in pending.publish_node_ids]
        self._upstream["_finish_write_through_ack"](ack_id)
        for node in nodes:
            self._store_node(node)

    def _store_node(self, node: Any) -> None:
        """Store this rank's pages of ``node`` (its host copy is final)."""
        host = node.component_data[ComponentType.FULL].host_value
        if host is None or not plain_key(node.key) or len(host) == 0:
            return
        P, rank = self.tier.page_size, self.placement.cp_rank
        try:
            tokens = path_tokens(node)
            firsts = host[::P].to(torch.int64)  # logical host slots: their owner is their page's
            owners = self.placement.owner_of(firsts).tolist()
        except Exception:  # L3 is a cache: a failed write is a later miss, never an error
            logger.exception("sglang-cp-hicache L3: storing node %s failed on cp_rank %d", node.id, rank)
            self.counters.add(write_failures=1)
            return
        own_slots = [int(s) for s, o in zip(firsts.tolist(), owners) if o == rank]
        self.l3.store_chain(tokens, len(node.key), owners, own_slots)

    # ---- L3 -> host: the scheduler's calls ------------------------------------------------
    def prefetch_from_storage(
        self, request: Any, last_host_node_id: Any, new_input_tokens: Any, last_hash: Optional[str] = None,
        prefix_keys: Optional[list[str]] = None, matched_prefix_tokens: Optional[list[int]] = None,
        extra_key: Optional[str] = None, cache_salt: Optional[str] = None, storage_hit_end: Optional[int] = None,
    ) -> None:
        """Look the request's pages past its matched prefix up in L3, or wait
        on the lookup of the same chain (called alike on every rank).
        Returns None: no pipeline-parallel ticket."""
        if extra_key is not None or cache_salt is not None or self.cache.tree_core.is_eagle:
            return None
        if self.prefetcher.is_waiting(request):
            return None
        P = self.tier.page_size
        first_page = tuple(int(t) for t in new_input_tokens[:P])
        if len(first_page) == P and self.prefetcher.join(last_host_node_id, first_page, request):
            return None
        # A local failure (hashing) is this rank's "miss from here" inside the
        # plan: which lookups exist is decided alike on every rank.
        plan = self.port.plan(last_host_node_id, new_input_tokens, list(matched_prefix_tokens or []),
                              int(getattr(self.cache, "prefetch_threshold", 0) or 0))
        if plan is not None:
            self.prefetcher.start(plan, request)
        return None

    def check_prefetch_progress(self, request: Any) -> bool:
        """False while the request waits on a lookup (alike on every rank)."""
        if self.prefetcher.is_waiting(request):
            return False
        return self._upstream["check_prefetch_progress"](request)

    def release_aborted_request(self, request: Any) -> None:
        self.prefetcher.abort(request)
        self._upstream["release_aborted_request"](request)

    # ---- the step's MIN ---------------------------------------------------------------
    def _sync_hicache_ready_counts(self) -> Any:
        self._riding = _Riding(words=self.prefetcher.words(), active=bool(self.prefetcher.pending))
        try:
            return self._upstream["_sync_hicache_ready_counts"]()
        finally:
            self._riding.stop()

    def _all_reduce(self, data: torch.Tensor, tp_reduce_op: Any) -> None:
        """Upstream's all-reduce; during the ready-ack sync it carries this
        step's lookup words too (the same count on every rank)."""
        riding = self._riding
        if not riding.active or tp_reduce_op != _MIN or data.dim() != 1:
            return self._upstream["_all_reduce"](data, tp_reduce_op)
        riding.stop()  # one ride per step
        words = torch.tensor(riding.words, dtype=data.dtype)
        both = torch.cat([data, words])
        try:
            self._upstream["_all_reduce"](both, tp_reduce_op)
        except Exception as exc:
            raise self._abandon(exc) from exc
        data.copy_(both[: data.numel()])
        riding.settle([int(v) for v in both[data.numel():].tolist()])

    def check_hicache_events(self) -> None:
        self._upstream["check_hicache_events"]()
        if self.prefetcher.pending:
            self._settle_lookups()
        self.l3.publish_metrics()  # this step's L3 figures (--enable-metrics)

    def _settle_lookups(self) -> None:
        agreed = self._riding.agreed
        if agreed is None:
            # The ready-ack sync did not run this step (a path without it):
            # one MIN of the lookup words, on every rank alike.
            words = torch.tensor(self.prefetcher.words(), dtype=torch.int64)
            try:
                self.cache._all_reduce_attn_groups(words, _MIN)
            except Exception as exc:
                raise self._abandon(exc) from exc
            agreed = [int(v) for v in words.tolist()]
        self._riding = _Riding()
        self.prefetcher.commit(agreed)

    # ---- the admin API ----------------------------------------------------------------
    def clear_storage_backend(self) -> bool:
        """``clear_hicache_storage``: remove every object of this deployment's
        L3 namespaces (alike on every rank, see :meth:`RankL3.clear`); True
        when this rank's pass left none it could see behind."""
        return self.l3.clear().ok

    def _abandon(self, error: BaseException) -> CpL3PrefetchAborted:
        self._riding = _Riding()
        return self.prefetcher.abandon(error)


# ---- opening and installing ----------------------------------------------------------------
def local_row(placement: CpPlacement, logical_slot: int) -> int:
    """This rank's local host row of an owned logical host slot."""
    return int(placement.logical_locs_to_physical(torch.tensor([logical_slot], dtype=torch.int64))[0])


def l3_binding(host_pool_group: Any, server_args: Any, layer_start: int) -> L3Binding:
    """This release's L3 binding for one rank: SGLang's page hash, the native
    host pools of ``host_pool_group`` at local rows, the Mooncake segment
    shared by the storage TP ranks times the PP size."""
    anchor = host_pool_group.anchor_entry.host_pool
    placement = CpPlacement(anchor.page_size, anchor.shard_size, anchor.shard_rank)
    return L3Binding(
        placement, get_hash_str, kv_host_pool_of(anchor), host_pool_group.entry_map[PoolName.INDEXER].host_pool,
        store_opener("0.5.23", storage_segment_ranks(server_args, placement.cp_size, times_pp=True),
                     placement.cp_rank),
        layer_start=layer_start, host_row=partial(local_row, placement),
    )


def source_text(location: L3Location) -> str:
    """What chose the store, as the start-up log and an unusable store's message name it."""
    if not location.scheduler_driven:
        return location.source
    if location.backend == "file":
        return f"--hicache-storage-backend file (directory from {location.source})"
    return f"--hicache-storage-backend {location.backend} (settings from {location.source})"


def install_l3(cache: Any, tier: Any, location: L3Location, host_room: Any, *,
               enable_metrics: bool = False) -> L3Driver:
    """Put the L3 driver on ``cache`` (the scheduler's storage calls);
    ``enable_metrics`` (``--enable-metrics``): SGLang's storage metrics and
    the library's counters, fed by this L3 (:func:`install_metrics`)."""
    port = L3Port0523(cache, tier, host_room)
    driver = L3Driver(cache, RankL3(tier, port, location), port)
    driver.install()
    if enable_metrics:
        install_metrics(cache, driver.l3, port, tier.placement, location.backend if location.scheduler_driven else None)
    timeouts = location.timeouts
    where = location.directory if location.backend == "file" else f"a {location.backend} store"
    logger.info(
        "sglang-cp-hicache: L3 in %s (%s; model %s; %s), deadline %.1f s + %.2f s per 1024 tokens (at most "
        "%.0f s), cp_rank %d of %d writes and reads its own pages",
        where, source_text(location), tier.model_label, tier.describe(), timeouts.base_s,
        timeouts.per_ki_token_s, timeouts.max_s, tier.placement.cp_rank, tier.placement.cp_size,
    )
    return driver


def install_metrics(cache: Any, l3: RankL3, port: Any, placement: Any,
                    storage_backend: Optional[str]) -> StorageCollectorSink:
    """Metrics for ``cache``'s L3 (``--enable-metrics``): the library's
    counters now; SGLang's storage collector when storage turns on (the
    cache's ``apply_runtime_config``, taken over on the instance: see the
    module doc); ``storage_backend``: the flag's value (None: no flag).
    ``cache.storage_metrics_collector`` is SGLang's name for the collector;
    ``cache.enable_storage_metrics`` stays False (it gates the feeds of
    SGLang's storage controller, which CP never attaches)."""
    labels = rank_labels(cache, placement, storage_backend or "none", getattr(cache, "extra_metric_labels", None),
                         tp_and_dp_rank)
    sink = attach_storage_metrics(l3, labels, StorageMetrics)
    port.metrics = sink
    attachment = cache._storage_attachment
    upstream = attachment.apply_runtime_config

    def apply_runtime_config(**kwargs: Any) -> None:
        upstream(**{**kwargs, "enable_storage_metrics": False})
        if kwargs.get("enable_storage_metrics"):
            labels = rank_labels(cache, placement, kwargs.get("storage_backend"), kwargs.get("extra_metric_labels"),
                                 tp_and_dp_rank)
            cls = resolve_collector_class(STAT_LOGGER_ROLE_STORAGE, StorageMetricsCollector)
            cache.storage_metrics_collector = shared_collector(cls, labels)
            sink.attach_collector(cache.storage_metrics_collector)

    attachment.apply_runtime_config = apply_runtime_config
    return sink
