"""L3 on the KV-sharded DSA cache (SGLang 0.5.23), driven by SGLang's scheduler.

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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from sglang_cp_hicache.l3.prefetch import CpL3PrefetchAborted, chain_hashes, plain_key
from sglang_cp_hicache.l3.rank import RankL3
from sglang_cp_hicache.sglang_0523.l3_port import L3Port0523, path_tokens

logger = logging.getLogger(__name__)

__all__ = ["CpL3LookupAborted", "L3Driver"]

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
            first = (len(tokens) - len(node.key)) // P
            hashes, parent = chain_hashes(self.tier, tokens, first)
            firsts = host[::P].to(torch.int64)
            owners = self.placement.owner_of(firsts).tolist()
        except Exception:  # L3 is a cache: a failed write is a later miss, never an error
            logger.exception("sglang-cp-hicache L3: storing node %s failed on cp_rank %d", node.id, rank)
            self.counters.add(write_failures=1)
            return
        self.l3.writer.write(hashes, owners, [int(s) for s, o in zip(firsts.tolist(), owners) if o == rank], parent)

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
