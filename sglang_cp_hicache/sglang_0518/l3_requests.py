"""SGLang 0.5.18's scheduler-side storage calls, served by the CP cache's L3.

With ``--hicache-storage-backend file`` SGLang's scheduler prefetches for
every arriving request and holds it while the prefetch runs:

* ``_prefetch_kvcache`` (on arrival, after matching) calls
  :meth:`prefetch_from_storage` with the deepest node whose host copy is
  final and the whole-page tokens past the match;
* ``get_new_batch_prefill`` skips a waiting request until
  :meth:`check_prefetch_progress` says True, then takes
  ``pop_prefetch_loaded_tokens`` (upstream's, unchanged) as its storage hit;
* aborts call :meth:`release_aborted_request`.

Here a prefetch is the library's L3 protocol (:mod:`sglang_cp_hicache.l3.prefetch`:
the query MIN, then the fetch MIN, then a host-only node), so a request
waits two steps for a hit while every rank's I/O is done in time, and never
longer than the operation's deadline (SGLang's ``prefetch_timeout_*``
settings) plus one step; the state after each MIN is identical on every
rank: every rank releases the same requests in the same step. An aborted
request's lookup is not taken out of the pending list (its word rides the
step's MIN, the same count on every rank): it answers 0 whatever its I/O is
doing, so the MIN drops it on every rank alike -- slots, ledger charge and
the anchor's protection given back -- even on a rank that has not seen the
abort.

Requests with an ``extra_key`` (a LoRA adapter) or a ``cache_salt`` never
look up L3: their pages are another namespace's. The scheduler does not pass
them to ``prefetch_from_storage``, but it matches the request's key (which
carries both) just before: the cache's ``match_prefix`` hands every key to
:meth:`L3Requests.remember_match`, which keeps the last one, and a lookup whose tokens are not that plain key's is
skipped.

SGLang's own storage controller, threads and backends are never built (the
base cache is built without the flag): attaching or detaching a storage
backend at runtime is refused.
"""

from __future__ import annotations

import logging
from array import array
from typing import Any, List, Optional, Sequence

from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sglang_cp_hicache.l3.location import L3Location
from sglang_cp_hicache.l3.rank import RankL3
from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.settings import SGLANG_FILE_DIR
from sglang_cp_hicache.sglang_0518.l3_cache import L3Cache
from sglang_cp_hicache.sglang_0518.l3_port import path_tokens, plain_key

logger = logging.getLogger(__name__)

__all__ = ["L3Requests", "log_l3_start", "refuse_runtime_attach", "source_label"]

_REFUSE_RUNTIME = (
    "CP shared KV (sglang-cp-hicache): attaching or detaching a HiCache storage backend at runtime is "
    "not supported; start the server with --hicache-storage-backend file (the library serves L3 itself)"
)


def _same_kind(prefix: list[int], tokens: Sequence[int]) -> Sequence[int]:
    """``prefix + tokens`` as the container ``tokens`` is: the scheduler's
    keys hold ``array('q')`` and RadixKey refuses to match a list against an
    array, so a node restored from L3 must hold what the requests hold."""
    if isinstance(tokens, array):
        return array(tokens.typecode, prefix) + tokens
    return prefix + list(tokens)


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


class L3Requests:
    """The scheduler's prefetch calls on one CP cache, served by ``l3``.

    ``tree``: the SGLang cache (its root, page size and storage-hit record
    are read from it, nothing of this library)."""

    def __init__(self, tree: Any, l3: L3Cache) -> None:
        self.tree = tree
        self.l3 = l3
        self._last_match: Optional[RadixKey] = None

    # ---- arrival --------------------------------------------------------------------
    def remember_match(self, key: RadixKey) -> None:
        """The key the cache matched last (a request's, extra key and salt included)."""
        self._last_match = key

    def _request_is_plain(self, anchor: TreeNode, new_input_tokens: Sequence[int]) -> bool:
        """The request's key has no extra key or cache salt: below a node,
        the node's key says (a request only matches its own namespace); at
        the root, the key the scheduler matched just before (its tokens must
        be these)."""
        if anchor is not self.tree.root_node:
            return plain_key(anchor.key)
        last = self._last_match
        if last is None or not plain_key(last):
            return False
        n = len(new_input_tokens)
        return len(last) >= n and list(last.token_ids[:n]) == list(new_input_tokens)

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
        if whole == 0 or not self._request_is_plain(last_host_node, new_input_tokens[:whole]):
            return
        if prefetcher.join(last_host_node, tuple(new_input_tokens[:P]), req_id):
            return
        key = RadixKey(_same_kind(path_tokens(last_host_node), new_input_tokens[:whole]), is_bigram=tree.is_eagle)
        self.l3.prefetch(key, req_id)

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
