"""Which pages one rank's L3 stored and restored, by page key.

A fleet says how many pages a deployment restored that another one stored
by comparing these keys across deployments (a page's key names its whole
prefix, whatever CP size or release wrote it). Both engines install the
same log on each rank's library L3.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

__all__ = ["L3KeyLog"]


@dataclass
class L3KeyLog:
    """One rank's record; :meth:`install` wraps its L3 without changing what it does."""

    restored_keys: list[str] = field(default_factory=list)  # own pages L3 lookups restored
    stored_keys: list[str] = field(default_factory=list)  # own pages whose objects a write left whole in L3
    read_failures: int = 0  # own pages a lookup found present whose read did not bring them whole
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def install(self, l3: Any) -> None:
        """``l3``: the rank's L3, with its prefetch protocol (``prefetcher``) and ``tier``."""
        prefetcher, tier = l3.prefetcher, l3.tier
        settle = prefetcher._settle
        store_page = tier.store_page
        read_page = tier.read_page

        def read(kv_key: str, idx_key: str, slot: int, publish: Any) -> bool:
            whole = read_page(kv_key, idx_key, slot, publish)
            if not whole:  # runs on the L3 I/O threads
                with self._lock:
                    self.read_failures += 1
            return whole

        def stored(kv_key: str, idx_key: str, kv: Any, idx: Any) -> bool:
            whole = store_page(kv_key, idx_key, kv, idx)
            if whole:  # runs on the L3 I/O threads: list.append is atomic
                self.stored_keys.append(kv_key)
            return whole

        def recorded(lookup: Any, pages: int) -> int:
            tokens = settle(lookup, pages)
            kept = tokens // tier.page_size
            plan, rank = lookup.plan, tier.placement.cp_rank
            if kept:
                keys = tier.chain_keys(plan.hashes[:kept], plan.parent)[0]
                self.restored_keys.extend(k for k, o in zip(keys, plan.owners[:kept]) if o == rank)
            return tokens

        prefetcher._settle = recorded
        tier.store_page = stored
        tier.read_page = read
