"""The L3 (storage) tier of the CP cache on SGLang 0.5.18: one rank's pages
between its host pool and a :class:`~sglang_cp_hicache.l3.PageStore`.

The tier itself is the core's :class:`~sglang_cp_hicache.l3.host_tier.HostL3Tier`
(keys, owned-page stores and fetches, host-pool bytes); this module binds it
to 0.5.18: SGLang's page hash (``get_hash_str``), host slots that are host
rows, and the store ``--hicache-storage-backend`` names (file or Mooncake).

This module knows the host pools and the store; the cache decides when
(:mod:`.l3_cache`): pages are copied out of the host pools on the scheduler
thread; storing them, and a prefetch's query and fetch, run on the cache's
L3 worker thread (:mod:`.l3_io`).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from sglang.srt.mem_cache.utils import get_hash_str

from sglang_cp_hicache.l3.host_tier import HostL3Tier, L3Counters, L3Fetched, L3Snapshot, open_tier_store
from sglang_cp_hicache.l3.host_tier import namespaces as _namespaces  # noqa: F401 (the 0.5.23 tests compare it)
from sglang_cp_hicache.l3.store import PageStore
from sglang_cp_hicache.l3_backends import open_page_store
from sglang_cp_hicache.placement import CpPlacement

__all__ = ["L3Counters", "L3Fetched", "L3Snapshot", "L3Tier", "balanced_owners", "tier_for"]

def balanced_owners(used: list[int], num_pages: int, page_size: int) -> list[int]:
    """Owners for ``num_pages`` restored pages: each page to the rank holding
    the fewest host slots so far (ties: the lowest rank). ``used`` is the
    host ledger, identical on every rank, so every rank picks the same."""
    load = list(used)
    owners = []
    for _ in range(num_pages):
        owner = min(range(len(load)), key=lambda r: (load[r], r))
        owners.append(owner)
        load[owner] += page_size
    return owners


class L3Tier(HostL3Tier):
    """One rank's L3 on 0.5.18's host pools (a host slot is a host row)."""

    def __init__(
        self, store: PageStore, layout: CpPlacement, kv_host: Any, indexer_host: Any, *,
        model_id: str, layer_start: int = 0,
    ) -> None:
        super().__init__(store, layout, kv_host, indexer_host, model_id=model_id, page_hasher=get_hash_str,
                         layer_start=layer_start)

    @classmethod
    def open(
        cls, directory: Optional[str], layout: CpPlacement, kv_host: Any, indexer_host: Any, *,
        source: str = "SGLANG_CP_HICACHE_L3_DIR", backend: str = "file",
        extra_config: Optional[Mapping[str, Any]] = None, **kwargs,
    ) -> "L3Tier":
        """An L3 on ``backend``'s page store: a :class:`FilePageStore` at
        ``directory`` (created and proven writable now), or a Mooncake store
        configured from ``extra_config``. A bad one stops start-up, naming
        ``source``, the setting or flag that chose it."""
        store = open_tier_store(open_page_store, backend, directory, extra_config, source)
        return cls(store, layout, kv_host, indexer_host, **kwargs)


def tier_for(
    cache: Any, directory: Optional[str], model_id: Optional[str] = None, *,
    source: str = "SGLANG_CP_HICACHE_L3_DIR", backend: str = "file", extra_config: Optional[Mapping[str, Any]] = None,
) -> Optional[L3Tier]:
    """The L3 tier of a CP cache on ``backend`` (None: a file store without
    a directory); ``source``: what chose it, named if it is unusable."""
    if backend == "file" and not directory:
        return None
    targets = cache.cp_copy_targets
    device_pool = cache.token_to_kv_pool_allocator.get_kvcache()
    model = model_id or getattr(cache, "cp_model_id", None)
    if not model:
        raise ValueError("L3 needs a model id (server_args.served_model_name or model_path)")
    return L3Tier.open(
        directory, cache.cp_layout, targets.kv_host_pool, targets.indexer_host_pool,
        model_id=model, layer_start=int(getattr(device_pool, "start_layer", 0) or 0), source=source,
        backend=backend, extra_config=extra_config,
    )
