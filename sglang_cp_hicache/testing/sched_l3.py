"""The library's L3 of one real-scheduler rank: its counters, and the page
keys it stored and restored (a fleet attributes restored pages by them)."""

from __future__ import annotations

from typing import Any

from sglang_cp_hicache.testing.l3_keys import L3KeyLog

__all__ = ["final_l3", "l3_counters", "rank_l3_of", "record_l3_keys"]

#: How long a rank waits at the end for its last L3 writes before it reports what landed.
_L3_DRAIN_S = 60.0


def rank_l3_of(cache: Any) -> Any:
    """The library's L3 of this rank's cache (None: L3 off or not the library's)."""
    rank_l3 = getattr(getattr(cache, "cp_l3_cache", None), "rank_l3", None)  # 0.5.18's CP cache
    if rank_l3 is not None:
        return rank_l3
    driver = getattr(getattr(getattr(cache, "cache_controller", None), "cp_stack", None), "l3", None)  # 0.5.23
    return None if driver is None else driver.l3


def l3_counters(cache: Any) -> Any:
    """The library's L3 counters of this rank's cache (None: L3 off or not the library's)."""
    rank_l3 = rank_l3_of(cache)
    return None if rank_l3 is None else rank_l3.tier.counters


def record_l3_keys(cache: Any) -> L3KeyLog:
    """A key log of this rank's L3, installed (empty and idle without the library's L3)."""
    keys = L3KeyLog()
    rank_l3 = rank_l3_of(cache)
    if rank_l3 is not None:
        keys.install(rank_l3)
    return keys


def final_l3(cache: Any, result: Any, keys: L3KeyLog) -> None:
    """Once the loop ended: the L3's last writes landed, then its keys and I/O totals into ``result``
    (a :class:`~.sched_rank.RankResult`)."""
    rank_l3 = rank_l3_of(cache)
    if rank_l3 is None:
        return
    rank_l3.wait_io(_L3_DRAIN_S)
    result.l3_stored_keys, result.l3_restored_keys = list(keys.stored_keys), list(keys.restored_keys)
    result.l3_read_failures = keys.read_failures
    result.l3_io = {k: v for k, v in rank_l3.io.totals().items() if k in ("written_bytes", "read_bytes")}
    result.l3_counters = {k: int(v) for k, v in vars(rank_l3.tier.counters).items() if isinstance(v, int)}
    result.l3_page_bytes = int(rank_l3.tier.kv_ns.page_bytes) + int(rank_l3.tier.indexer_ns.page_bytes)
