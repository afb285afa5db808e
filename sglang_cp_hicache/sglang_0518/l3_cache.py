"""L3 in SGLang 0.5.18's CP cache: where SGLang calls in.

The protocol is the shared one (:mod:`sglang_cp_hicache.l3.prefetch`:
query -> MIN -> fetch -> MIN -> insert, deadlines, joins, aborts); this
release's side of it is :class:`~.l3_port.L3Port0518`, and its words ride
the step's MIN all-reduce (:mod:`.step_protocol`, one word per pending
lookup, the same count on every rank). No collective of its own, no L3
membership state. Opening the tier is the wing's
(:func:`sglang_cp_hicache.l3.opening.open_l3`); this release binds it
(:func:`l3_binding`): SGLang's page hash, host slots that are host rows, the
CP copy targets' host pools.

* Write (:class:`L3Cache`): when a node's write-through ack is consumed
  (every rank consumes the same acks, and only acks of writes no rank took
  back), each rank copies the pages of the node it owns out of its host
  pools and stores them on its L3 write threads. A failed put leaves that
  page absent (objects are renamed into place whole) or refused by its
  envelope; a later lookup decides from what each owner finds.
* Prefetch (:meth:`L3Cache.prefetch`, called alike on every rank for a
  request whose match ends before its whole pages do, when that match ends
  at the root or at a node whose host copy is final).
* The scheduler's storage calls (:class:`L3Requests`), made under
  ``--hicache-storage-backend file``: ``prefetch_from_storage`` on arrival
  (the deepest node whose host copy is final, the whole-page tokens past
  the match), ``check_prefetch_progress`` until it says True, then
  upstream's ``pop_prefetch_loaded_tokens`` as the storage hit;
  ``release_aborted_request`` on an abort. An aborted request's lookup stays
  pending (its word rides the step's MIN, the same count on every rank) and
  answers 0, so the MIN drops it on every rank alike -- slots, ledger charge
  and the anchor's protection given back -- even on a rank that has not
  seen the abort.

Requests with an ``extra_key`` (a LoRA adapter) or a ``cache_salt`` never
look up L3: their pages are another namespace's. The scheduler does not pass
them to ``prefetch_from_storage`` (only the request id, the node and the
tokens past the match), but it matches the request's key (which carries
both) just before: the cache's ``match_prefix`` hands every key and its
result to :meth:`L3Requests.remember_match`, which keeps the last one. A
lookup serves from that match (one ``match_prefix`` per lookup) and is
skipped unless it is this request's: the same node, the tokens past the
match, a plain key.

SGLang's own storage controller, threads and backends are never built (the
base cache is built without the flag): attaching or detaching a storage
backend at runtime is refused. With ``--enable-metrics`` SGLang's storage
collector is built as ``HiRadixCache`` builds it and fed from this L3
(:func:`install_metrics`; the shared part is
:mod:`sglang_cp_hicache.l3.storage_metrics`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Hashable, List, Optional, Sequence

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode
from sglang.srt.mem_cache.utils import get_hash_str
from sglang.srt.observability.metrics_collector import STAT_LOGGER_ROLE_STORAGE, StorageMetrics
from sglang.srt.observability.metrics_collector import StorageMetricsCollector, resolve_collector_class
from sglang.srt.runtime_context import get_server_args

from sglang_cp_hicache.l3.location import L3Location
from sglang_cp_hicache.l3.opening import L3Binding, storage_segment_ranks
from sglang_cp_hicache.l3.rank import RankL3
from sglang_cp_hicache.l3.storage_metrics import (
    StorageCollectorSink, attach_storage_metrics, rank_labels, shared_collector,
)
from sglang_cp_hicache.l3_backends import store_opener
from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.settings import SGLANG_FILE_DIR
from sglang_cp_hicache.sglang_0518.l3_port import path_length, path_tokens, plain_key
from sglang_cp_hicache.sglang_0518.library_metrics import tp_and_dp_rank

logger = logging.getLogger(__name__)

__all__ = [
    "L3Cache", "L3Requests", "install_metrics", "l3_binding", "log_l3_start", "refuse_runtime_attach",
    "source_label",
]


def l3_binding(placement: CpPlacement, targets: Any, device_pool: Any, server_args: Any) -> L3Binding:
    """This release's L3 binding for one rank: SGLang's page hash, the host
    pools of ``targets`` (:class:`~.host_copies.CpCopyTargets`; a host slot
    is a host row), the Mooncake segment shared by the storage TP ranks."""
    return L3Binding(
        placement, get_hash_str, targets.kv_host_pool, targets.indexer_host_pool,
        store_opener("0.5.18", storage_segment_ranks(server_args, placement.cp_size, times_pp=False),
                     placement.cp_rank),
        layer_start=int(getattr(device_pool, "start_layer", 0) or 0),
    )


def install_metrics(cache: Any, placement: CpPlacement, l3: RankL3, server_args: Any) -> StorageCollectorSink:
    """Metrics for ``cache``'s L3 (``--enable-metrics``): SGLang's storage
    collector when the storage flag is set, the library's counters always.
    Sets ``cache.storage_metrics_collector`` as SGLang names it (its own
    feeds stay off: ``enable_storage_metrics`` gates SGLang's storage
    controller, which CP never builds)."""
    backend = getattr(server_args, "hicache_storage_backend", None)
    labels = rank_labels(cache, placement, backend or "none", getattr(server_args, "extra_metric_labels", None),
                         tp_and_dp_rank)
    collector = None
    if backend is not None:
        cls = resolve_collector_class(get_server_args(), STAT_LOGGER_ROLE_STORAGE, StorageMetricsCollector)
        collector = shared_collector(cls, labels)
    cache.storage_metrics_collector = collector
    return attach_storage_metrics(l3, labels, StorageMetrics, collector)


class L3Cache:
    """L3 write and prefetch of one CP cache (``rank_l3`` None: L3 is off).

    ``tree``: the SGLang cache (its tree, ``match_prefix`` and write-through
    records are read from it, nothing of this library)."""

    def __init__(self, tree: Any, placement: CpPlacement, rank_l3: Optional[RankL3]) -> None:
        self.tree = tree
        self.placement = placement
        self.rank_l3 = rank_l3

    def reset(self) -> None:
        """The lookups go with the tree and host pool (their I/O writes no more)."""
        if self.rank_l3 is not None:
            self.rank_l3.prefetcher.reset()

    # ---- host -> L3 ------------------------------------------------------------
    def store_acked(self, ack_id: int) -> None:
        """Store the nodes of write ``ack_id`` (its ack is being consumed:
        their host copy is final)."""
        ongoing = self.tree.ongoing_write_through
        if self.rank_l3 is not None and ack_id in ongoing:
            _, _, publish_nodes = ongoing[ack_id]
            for node in publish_nodes:
                self._store_node(node)

    def _store_node(self, node: TreeNode) -> None:
        """Store this rank's pages of ``node`` (its host copy is final)."""
        meta = node.cp_hicache
        if meta is None or not plain_key(node.key) or meta.token_owners is None:
            return
        P = self.placement.page_size
        self.rank_l3.store_chain(path_tokens(node), meta.logical_len, meta.token_owners[::P].tolist(),
                                 meta.host_indices[::P].tolist())

    # ---- L3 -> host ------------------------------------------------------------------
    def prefetch(self, key: RadixKey, rid: Optional[Hashable] = None) -> int:
        """Look the pages of ``key`` past its cached prefix up in L3 (call it
        alike on every rank). Returns the pages looked up (the same on every
        rank; 0: nothing to do). Two step all-reduces follow: the first
        agrees on the pages present on their owners (nothing allocated or
        evicted before), the second on the pages fetched and verified; then
        a host-only node of exactly those pages is in the tree. ``rid``: the
        scheduler's request waiting on it."""
        return self._start(self._lookup_target(key), rid)

    def _start(self, found: Optional[tuple[TreeNode, RadixKey]], rid: Optional[Hashable]) -> int:
        if found is None:
            return 0
        anchor, chain = found
        plan = self.rank_l3.port.plan(anchor, chain)  # a hashing failure is this rank's "miss from here"
        anchor.protect_host()  # the chain's parent stays until the lookup settles
        self.rank_l3.prefetcher.start(plan, rid)
        return plan.num_pages

    def _lookup_target(self, key: RadixKey):
        """(anchor, chain key) of a prefetch, or None: the whole pages of
        ``key`` past the cached prefix (:meth:`_target_past`)."""
        if self.rank_l3 is None or self.tree.is_eagle or not plain_key(key):
            return None
        match = self.tree.match_prefix(MatchPrefixParams(key=key))
        matched = len(match.device_indices) + match.host_hit_length
        return self._target_past(match.last_host_node, matched, key[matched:])

    def _target_past(self, anchor: TreeNode, matched: int, rest: RadixKey):
        """(anchor, chain key) of a prefetch, or None: the whole pages of
        ``rest`` (the key past its ``matched`` cached tokens), when that
        prefix ends at ``anchor``, a node whose host copy is final (or the
        root), and no lookup hangs there yet."""
        tree, P = self.tree, self.placement.page_size
        if path_length(anchor) != matched:
            return None  # the deepest matched node has no final host copy yet
        if anchor is not tree.root_node and (not anchor.backuped or anchor.write_through_pending_id is not None):
            return None
        whole = len(rest) // P * P
        if whole <= 0:
            return None
        chain = rest[:whole]
        if self.rank_l3.prefetcher.hangs_at(anchor, tuple(chain.token_ids[:P])):
            return None
        return anchor, chain

    def prefetch_past(self, anchor: TreeNode, matched: int, rest: RadixKey, rid: Hashable) -> int:
        """:meth:`prefetch` for a key the cache matched already: ``rest`` is
        its part past the ``matched`` tokens that end at ``anchor``."""
        if self.rank_l3 is None or self.tree.is_eagle:
            return 0
        return self._start(self._target_past(anchor, matched, rest), rid)

    # ---- the step's MIN (called by the step protocol) -----------------------------------
    def words(self) -> list[int]:
        return self.rank_l3.prefetcher.words() if self.rank_l3 is not None else []

    def commit(self, agreed: list[int]) -> None:
        if self.rank_l3 is not None:
            self.rank_l3.prefetcher.commit(agreed)

    def abandon(self, error: BaseException) -> Exception:
        return self.rank_l3.prefetcher.abandon(error)

    # ---- the scheduler's step and admin calls ------------------------------------------------
    def publish_metrics(self) -> None:
        """This step's L3 figures into the metrics (--enable-metrics)."""
        if self.rank_l3 is not None:
            self.rank_l3.publish_metrics()

    def clear(self) -> bool:
        """``clear_hicache_storage``: remove every object of this deployment's
        L3 namespaces (alike on every rank, see :meth:`RankL3.clear`); True
        when this rank's pass left none it could see behind."""
        if self.rank_l3 is None:
            logger.warning("Hierarchical cache storage backend is not enabled.")
            return False
        return self.rank_l3.clear().ok

    def wait_io(self, timeout: Optional[float] = None) -> bool:
        """Block until this rank's L3 I/O is done: its lookups' reads (so its
        next words are ready) and its writes; False if ``timeout`` ran out first."""
        return self.rank_l3 is None or self.rank_l3.wait_io(timeout)


_REFUSE_RUNTIME = (
    "CP shared KV (sglang-cp-hicache): attaching or detaching a HiCache storage backend at runtime is "
    "not supported; start the server with --hicache-storage-backend file (the library serves L3 itself)"
)


def source_label(location: L3Location) -> str:
    """What chose the L3 directory, as a user would look for it."""
    flag = f"--hicache-storage-backend {location.backend}"
    return {
        "hicache_storage_backend_extra_config": f"{flag}, --hicache-storage-backend-extra-config",
        "file_storage_path": f"{flag}, file_storage_path of --hicache-storage-backend-extra-config",
        "default": f"{flag}, SGLang's default directory",
        SGLANG_FILE_DIR.name: f"{flag}, {SGLANG_FILE_DIR.name}",
    }.get(location.source, location.source)


def log_l3_start(placement: CpPlacement, rank_l3: Optional[RankL3], location: L3Location) -> None:
    """One line per rank: where L3 lives, what chose it, its model and namespaces."""
    rank = placement.cp_rank
    if rank_l3 is None:
        return
    tier = rank_l3.tier
    where = f"directory {location.directory}" if location.backend == "file" else f"{location.backend} store"
    timeouts = location.timeouts
    logger.info(
        "sglang-cp-hicache L3 on cp_rank %d/%d: %s (from %s), model %s, %s, deadline %.1f s + %.2f s per 1024 "
        "tokens (at most %.0f s), scheduler prefetch %s",
        rank, placement.cp_size, where, source_label(location), tier.model_label, tier.describe(),
        timeouts.base_s, timeouts.per_ki_token_s, timeouts.max_s, "on" if location.scheduler_driven else "off",
    )
    if not location.scheduler_driven:
        logger.warning(
            "sglang-cp-hicache L3 on cp_rank %d: set by %s alone; a server's scheduler writes L3 but never "
            "prefetches from it without --hicache-storage-backend file", rank, location.source,
        )


def refuse_runtime_attach(storage_backend: str) -> tuple[bool, str]:
    """``attach_storage_backend``: refused (the library serves L3 itself)."""
    logger.warning("%s (asked: %r)", _REFUSE_RUNTIME, storage_backend)
    return False, _REFUSE_RUNTIME


@dataclass(frozen=True)
class _Match:
    """A ``match_prefix`` the cache ran: the key, its deepest node with a
    final host copy, and how many of its tokens are cached."""

    key: RadixKey
    anchor: TreeNode
    matched: int


class L3Requests:
    """The scheduler's prefetch calls on one CP cache, served by ``l3``.

    ``tree``: the SGLang cache (its root, page size and storage-hit record
    are read from it, nothing of this library)."""

    def __init__(self, tree: Any, l3: L3Cache) -> None:
        self.tree = tree
        self.l3 = l3
        self._last_match: Optional[_Match] = None

    # ---- arrival --------------------------------------------------------------------
    def remember_match(self, key: RadixKey, result: Any) -> None:
        """The key the cache matched last (a request's, extra key and salt
        included) and its ``MatchResult``."""
        self._last_match = _Match(key, result.last_host_node, len(result.device_indices) + result.host_hit_length)

    def _requests_match(self, anchor: TreeNode, tokens: Sequence[int]) -> Optional[_Match]:
        """The match the scheduler ran just before for the request whose
        ``tokens`` (whole pages past the match) it hands in, if it is that
        request's and its key is plain (no extra key or cache salt)."""
        last = self._last_match
        if last is None or last.anchor is not anchor or not plain_key(last.key):
            return None
        n, at = len(tokens), last.matched
        if len(last.key) < at + n or list(last.key.token_ids[at : at + n]) != list(tokens):
            return None
        return last

    def prefetch_from_storage(self, req_id: str, last_host_node: TreeNode, new_input_tokens: List[int]) -> None:
        """Start (or join) the L3 lookup of the whole pages of
        ``new_input_tokens`` below ``last_host_node`` for request ``req_id``
        (the scheduler calls it alike on every rank). Hashes come from the
        token ids, so SGLang's ``last_hash`` / ``prefix_keys`` are not needed."""
        rank_l3, tree = self.l3.rank_l3, self.tree
        if rank_l3 is None:
            return
        prefetcher = rank_l3.prefetcher
        if prefetcher.is_waiting(req_id):
            return  # a retracted request re-queued keeps its wait
        P = tree.page_size
        whole = len(new_input_tokens) // P * P
        match = self._requests_match(last_host_node, new_input_tokens[:whole]) if whole else None
        if match is None:
            return
        if prefetcher.join(last_host_node, tuple(new_input_tokens[:P]), req_id):
            return
        # the tokens as the scheduler holds them: a node restored from L3 must hold what the requests hold
        rest = RadixKey(new_input_tokens[:whole], is_bigram=tree.is_eagle)
        self.l3.prefetch_past(last_host_node, match.matched, rest, req_id)

    # ---- the waiting queue ----------------------------------------------------------
    def check_prefetch_progress(self, req_id: str) -> bool:
        """True once ``req_id``'s lookup settled (restored or missed) or it
        has none; False while it waits for the step's MIN."""
        rank_l3 = self.l3.rank_l3
        return rank_l3 is None or not rank_l3.prefetcher.is_waiting(req_id)

    # ---- aborts -----------------------------------------------------------------------
    def release_aborted_request(self, rid: str) -> None:
        """Forget an aborted request's storage hit and its wait; a lookup no
        request waits on any more answers 0 at the next MIN and is dropped
        there on every rank (nothing is taken out of the pending list here)."""
        self.tree.prefetch_loaded_tokens_by_reqid.pop(rid, None)
        if self.l3.rank_l3 is not None:
            self.l3.rank_l3.prefetcher.abort(rid)

    # ---- runtime detach: refused ----------------------------------------------------------
    def detach_storage_backend(self) -> tuple[bool, str]:
        if self.l3.rank_l3 is None:
            return True, "no HiCache storage backend is attached"
        logger.warning("%s", _REFUSE_RUNTIME)
        return False, _REFUSE_RUNTIME
