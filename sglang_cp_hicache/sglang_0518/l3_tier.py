"""The L3 (storage) tier of the CP cache on SGLang 0.5.18: one rank's pages
between its host pool and a :class:`~sglang_cp_hicache.l3.PageStore`.

A page is keyed by SGLang's page hash (the SHA-256 chain of the token ids,
``get_hash_str``) and the namespace digest of its pool -- never by CP rank
or size -- so deployments of any CP size share one directory. Each page is
two objects, its KV bytes and its DSA indexer bytes, each in the library's
checked envelope. Only a page's owner writes or reads it.

This module knows the host pools and the store; the cache decides when
(:mod:`.l3_cache`): pages are copied out of the host pools on the scheduler
thread; storing them, and a prefetch's query and fetch, run on the cache's
L3 worker thread (:mod:`.l3_io`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
from sglang.srt.mem_cache.utils import get_hash_str

from sglang_cp_hicache.l3 import L3Namespace, PageStore, fetch_owned, read_plan, store_owned
from sglang_cp_hicache.l3.consensus import local_usable_pages
from sglang_cp_hicache.l3.keys import page_keys
from sglang_cp_hicache.l3.plan import write_plan
from sglang_cp_hicache.l3_backends import open_page_store
from sglang_cp_hicache.placement import CpPlacement

logger = logging.getLogger(__name__)

__all__ = ["L3Counters", "L3Fetched", "L3Snapshot", "L3Tier", "balanced_owners"]

#: SGLang's host layouts -> the order of a flat KV page's bytes.
_KV_BYTE_ORDER = {"layer_first": "LPD", "page_first": "PLD", "page_first_direct": "LPD"}


@dataclass
class L3Counters:
    written_pages: int = 0  # pages (KV + indexer both stored) this rank wrote
    write_failures: int = 0  # pages whose KV or indexer put failed here
    fetched_pages: int = 0  # own pages fetched and verified, before the MIN
    rejected_pages: int = 0  # own objects refused (missing, short, corrupt, other namespace)
    restored_pages: int = 0  # own pages put into the host pool after the MIN
    prefetches: int = 0  # chains looked up (every rank alike)
    restored_nodes: int = 0  # host-only nodes inserted from L3 (every rank alike)


@dataclass(frozen=True)
class L3Snapshot:
    """This rank's own pages of a chain, copied out of its host pools (chain
    order): KV and indexer bytes per page, with the chain's hashes and owners."""

    hashes: list[str]
    owners: list[int]
    kv: list[torch.Tensor]
    indexer: list[torch.Tensor]


@dataclass(frozen=True)
class L3Fetched:
    """One rank's fetch of a chain: its local usable prefix (pages), and the
    verified bytes of its own pages below it (chain index -> KV, indexer)."""

    usable: int
    pages: dict[int, tuple[torch.Tensor, torch.Tensor]]


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


def _namespaces(model_id: str, kv_host: Any, indexer_host: Any, layer_start: int) -> tuple[L3Namespace, L3Namespace]:
    """The KV and indexer namespaces of this cache's host pools."""
    page_size = int(kv_host.page_size)
    layer_end = layer_start + int(kv_host.layer_num)
    kv_dtype = kv_host.kv_buffer.dtype
    kv = L3Namespace(
        model_id=model_id, kv_dtype=kv_dtype, row_bytes=int(kv_host.kv_cache_dim) * kv_dtype.itemsize,
        page_size=page_size, pool="kv", layer_start=layer_start, layer_end=layer_end,
        byte_order=_KV_BYTE_ORDER[kv_host.layout],
    )
    idx_dtype = indexer_host.index_k_with_scale_buffer.dtype
    page_bytes = int(indexer_host.indexer_page_stride_size) * idx_dtype.itemsize
    if page_bytes % page_size:
        raise ValueError(f"indexer page of {page_bytes} bytes is not a whole number of {page_size} token rows")
    indexer = L3Namespace(
        model_id=model_id, kv_dtype=idx_dtype, row_bytes=page_bytes // page_size, page_size=page_size,
        pool="indexer", layer_start=layer_start, layer_end=layer_start + int(indexer_host.layer_num),
        byte_order="LPD",  # (layers, page stride) in every host layout
    )
    return kv, indexer


def _as_bytes(page: torch.Tensor) -> torch.Tensor:
    return page.reshape(-1).contiguous().view(torch.uint8)


class L3Tier:
    """One rank's L3: keys, owned-page stores and fetches, host-pool bytes."""

    def __init__(
        self, store: PageStore, layout: CpPlacement, kv_host: Any, indexer_host: Any, *,
        model_id: str, layer_start: int = 0,
    ) -> None:
        self.store = store
        self.layout = layout
        self.kv_host = kv_host
        self.indexer_host = indexer_host
        self.kv_ns, self.indexer_ns = _namespaces(model_id, kv_host, indexer_host, layer_start)
        self.page_size = self.kv_ns.page_size
        self.counters = L3Counters()

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
        try:
            store = open_page_store(backend, directory, extra_config)
        except ValueError as exc:
            what = "L3 directory unusable" if backend == "file" else f"L3 {backend} store unusable"
            raise ValueError(f"{source}: {what}: {exc}") from exc
        return cls(store, layout, kv_host, indexer_host, **kwargs)

    def describe(self) -> str:
        """What every rank must agree on: both namespaces (the directory may
        be mounted at different paths on different hosts)."""
        return f"kv:{self.kv_ns.digest()}|indexer:{self.indexer_ns.digest()}"

    # ---- keys ----------------------------------------------------------------
    def page_hashes(self, token_ids: list[int]) -> list[str]:
        """SGLang's page hash of every whole page of ``token_ids`` (a chain
        from the root)."""
        num_pages = len(token_ids) // self.page_size
        if num_pages == 0:
            return []
        hashes = get_hash_str(list(token_ids[: num_pages * self.page_size]), None, page_size=self.page_size)
        if len(hashes) != num_pages:
            raise RuntimeError(f"get_hash_str gave {len(hashes)} hashes for {num_pages} pages")
        return hashes

    # ---- host -> L3 ------------------------------------------------------------
    def store_pages(self, hashes: list[str], owners: list[int], slots: list[int]) -> int:
        """Store this rank's pages of a chain. ``slots``: the host slot of the
        first token of each page this rank owns, in chain order. Returns the
        pages stored whole (KV and indexer). A failed put is logged and
        counted; the page is simply absent (or refused) when read."""
        return self.store_snapshot(self.snapshot_pages(hashes, owners, slots))

    def snapshot_pages(self, hashes: list[str], owners: list[int], slots: list[int]) -> "L3Snapshot":
        """Copies of this rank's pages of a chain out of its host pools: what
        a write stores later, when the host slots may hold other pages."""
        rank, N = self.layout.cp_rank, self.layout.cp_size
        mine = len(write_plan(page_keys(hashes, self.kv_ns), owners, N, rank).keys)
        if mine != len(slots):
            raise ValueError(f"slots must hold one host slot per owned page ({mine}), got {len(slots)}")
        kv = [_as_bytes(self.kv_host.get_data_page(s)).clone() for s in slots]
        idx = [_as_bytes(self.indexer_host.get_data_page(s)).clone() for s in slots]
        return L3Snapshot(list(hashes), list(owners), kv, idx)

    def store_snapshot(self, snap: "L3Snapshot") -> int:
        """Store a snapshot's pages (KV and indexer objects); returns the
        pages stored whole, counting the others as write failures."""
        if not snap.kv:
            return 0
        rank, N = self.layout.cp_rank, self.layout.cp_size
        kv_plan = write_plan(page_keys(snap.hashes, self.kv_ns), snap.owners, N, rank)
        idx_plan = write_plan(page_keys(snap.hashes, self.indexer_ns), snap.owners, N, rank)
        kv_ok = store_owned(self.store, self.kv_ns, kv_plan, snap.kv)
        idx_ok = store_owned(self.store, self.indexer_ns, idx_plan, snap.indexer)
        whole = sum(1 for a, b in zip(kv_ok, idx_ok) if a and b)
        self.counters.written_pages += whole
        self.counters.write_failures += len(snap.kv) - whole
        return whole

    # ---- L3 -> host ------------------------------------------------------------
    def query_pages(self, hashes: list[str], owners: list[int]) -> int:
        """This rank's local present prefix of a chain: the first own page
        whose KV or indexer object is absent (unverified: the fetch checks)."""
        rank, N = self.layout.cp_rank, self.layout.cp_size
        plans = [
            read_plan(page_keys(hashes, ns), owners, N, rank) for ns in (self.kv_ns, self.indexer_ns)
        ]
        indices = plans[0].page_indices
        if not indices:
            return len(hashes)
        present = [all(pair) for pair in zip(*(self.store.exists(list(p.keys)) for p in plans))]
        return local_usable_pages(indices, present, len(hashes))

    def fetch_pages(self, hashes: list[str], owners: list[int]) -> L3Fetched:
        """Fetch and verify this rank's pages of a chain (KV and indexer);
        its local usable prefix is the first own page missing or refused in
        either pool. Never raises on bad objects."""
        rank, N = self.layout.cp_rank, self.layout.cp_size
        kv = fetch_owned(self.store, self.kv_ns, read_plan(page_keys(hashes, self.kv_ns), owners, N, rank))
        idx = fetch_owned(
            self.store, self.indexer_ns, read_plan(page_keys(hashes, self.indexer_ns), owners, N, rank)
        )
        usable = min(kv.usable_pages, idx.usable_pages)
        idx_pages = dict(idx.restorable(usable))
        pages = {i: (page, idx_pages[i]) for i, page in kv.restorable(usable)}
        self.counters.fetched_pages += len(pages)
        self.counters.rejected_pages += sum(r is not None for r in kv.rejections + idx.rejections)
        return L3Fetched(usable, pages)

    def fill_host(self, slot: int, kv_bytes: torch.Tensor, idx_bytes: torch.Tensor) -> None:
        """Put one verified page into this rank's host pools at ``slot``."""
        self.kv_host.set_from_flat_data_page(slot, kv_bytes.view(self.kv_host.kv_buffer.dtype))
        self.indexer_host.set_from_flat_data_page(
            slot, idx_bytes.view(self.indexer_host.index_k_with_scale_buffer.dtype)
        )


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
