"""The L3 (storage) tier of the KV-sharded DSA stack on SGLang 0.5.23: one
rank's pages between its host pools and a :class:`~sglang_cp_hicache.l3.PageStore`.

Host slots in the sharded tree are LOGICAL (identical on every rank): logical
slot ``h`` belongs to rank ``(h // P) % N`` at local row
``(h // (N * P)) * P + h % P``. The native host pools (MLA KV and DSA
indexer) hold local rows only, so every page is read and written at its
translated local row, and only on its owner.

A page is keyed by SGLang's page hash and the namespace digest of its pool
(:mod:`sglang_cp_hicache.l3.keys`), never by CP rank or size, so deployments
of any CP size -- and the 0.5.18 adapter, for an identical configuration --
share one directory. Each page is two objects, KV and indexer, each in the
library's checked envelope. Everything here runs on the scheduler thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.utils import get_hash_str

from sglang_cp_hicache.l3 import FilePageStore, L3Namespace, PageStore, fetch_owned, read_plan, store_owned
from sglang_cp_hicache.l3.consensus import local_usable_pages
from sglang_cp_hicache.l3.keys import page_keys
from sglang_cp_hicache.l3.plan import write_plan
from sglang_cp_hicache.placement import CpPlacement

logger = logging.getLogger(__name__)

__all__ = ["L3Counters", "L3Fetched", "L3Tier", "namespaces"]

#: SGLang's host layouts -> the order of a flat KV page's bytes.
_KV_BYTE_ORDER = {"layer_first": "LPD", "page_first": "PLD", "page_first_direct": "LPD"}


@dataclass
class L3Counters:
    written_pages: int = 0  # pages (KV + indexer both stored) this rank wrote
    write_failures: int = 0  # own pages whose KV or indexer put failed or raised
    fetched_pages: int = 0  # own pages fetched and verified, before the MIN
    rejected_pages: int = 0  # own objects refused (short, corrupt, other namespace; not missing)
    restored_pages: int = 0  # own pages put into the host pool and kept after the MIN
    prefetches: int = 0  # chains looked up (every rank alike)
    restored_nodes: int = 0  # host-only nodes inserted from L3 (every rank alike)
    restored_tokens: int = 0  # logical tokens of those nodes (every rank alike)


@dataclass(frozen=True)
class L3Fetched:
    """One rank's fetch of a chain: its local usable prefix (pages), and the
    verified bytes of its own pages below it (chain index -> KV, indexer)."""

    usable: int
    pages: dict[int, tuple[torch.Tensor, torch.Tensor]]


def namespaces(model_id: str, kv_host: Any, indexer_host: Any, layer_start: int) -> tuple[L3Namespace, L3Namespace]:
    """The KV and indexer namespaces of a rank's native host pools (the same
    fields, computed the same way, as the 0.5.18 adapter's)."""
    page_size = int(kv_host.page_size)
    kv_dtype = kv_host.kv_buffer.dtype
    kv = L3Namespace(
        model_id=model_id, kv_dtype=kv_dtype, row_bytes=int(kv_host.kv_cache_dim) * kv_dtype.itemsize,
        page_size=page_size, pool="kv", layer_start=layer_start, layer_end=layer_start + int(kv_host.layer_num),
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
    """One rank's L3: keys, owned-page stores and fetches at local rows."""

    def __init__(
        self, store: PageStore, layout: CpPlacement, kv_host: Any, indexer_host: Any, *,
        model_id: str, layer_start: int = 0,
    ) -> None:
        self.store = store
        self.layout = layout
        self.kv_host = kv_host
        self.indexer_host = indexer_host
        self.kv_ns, self.indexer_ns = namespaces(model_id, kv_host, indexer_host, layer_start)
        self.page_size = self.kv_ns.page_size
        if self.page_size != layout.page_size:
            raise ValueError(f"host page size {self.page_size} != the placement's {layout.page_size}")
        self.counters = L3Counters()

    @classmethod
    def open(cls, directory: str, source: str, layout: CpPlacement, kv_host: Any, indexer_host: Any,
             **kwargs: Any) -> "L3Tier":
        """An L3 on a :class:`FilePageStore` at ``directory`` (created and
        proven writable now: a bad directory stops start-up, naming the
        setting that chose it)."""
        try:
            store = FilePageStore(directory)
        except ValueError as exc:
            raise ValueError(f"{source}: L3 directory unusable: {exc}") from exc
        return cls(store, layout, kv_host, indexer_host, **kwargs)

    def describe(self) -> str:
        """What every rank must agree on: both namespaces."""
        return f"kv:{self.kv_ns.digest()}|indexer:{self.indexer_ns.digest()}"

    # ---- keys ----------------------------------------------------------------
    def page_hashes(self, token_ids: list[int]) -> list[str]:
        """SGLang's page hash of every whole page of ``token_ids`` (a chain
        from the root, no extra key or cache salt: the same chain as 0.5.18)."""
        num_pages = len(token_ids) // self.page_size
        if num_pages == 0:
            return []
        hashes = get_hash_str(list(token_ids[: num_pages * self.page_size]), None, page_size=self.page_size)
        if len(hashes) != num_pages:
            raise RuntimeError(f"get_hash_str gave {len(hashes)} hashes for {num_pages} pages")
        return hashes

    def _row(self, logical_slot: int) -> int:
        """This rank's local host row of an owned logical host slot."""
        return int(self.layout.logical_locs_to_physical(torch.tensor([logical_slot], dtype=torch.int64))[0])

    # ---- host -> L3 ------------------------------------------------------------
    def store_pages(self, hashes: list[str], owners: list[int], slots: list[int]) -> int:
        """Store this rank's pages of a chain. ``slots``: the logical host
        slot of the first token of each page this rank owns, in chain order.
        Returns the pages stored whole (KV and indexer)."""
        rank, N = self.layout.cp_rank, self.layout.cp_size
        kv_plan = write_plan(page_keys(hashes, self.kv_ns), owners, N, rank)
        idx_plan = write_plan(page_keys(hashes, self.indexer_ns), owners, N, rank)
        if len(kv_plan.keys) != len(slots):
            raise ValueError(f"slots must hold one host slot per owned page ({len(kv_plan.keys)}), got {len(slots)}")
        if not slots:
            return 0
        rows = [self._row(s) for s in slots]
        kv_ok = store_owned(self.store, self.kv_ns, kv_plan, [_as_bytes(self.kv_host.get_data_page(r)) for r in rows])
        idx_ok = store_owned(
            self.store, self.indexer_ns, idx_plan, [_as_bytes(self.indexer_host.get_data_page(r)) for r in rows]
        )
        whole = sum(1 for a, b in zip(kv_ok, idx_ok) if a and b)
        self.counters.written_pages += whole
        self.counters.write_failures += len(slots) - whole
        return whole

    # ---- L3 -> host ------------------------------------------------------------
    def query_pages(self, hashes: list[str], owners: list[int]) -> int:
        """This rank's local present prefix: the first own page whose KV or
        indexer object is absent (unverified: the fetch checks)."""
        rank, N = self.layout.cp_rank, self.layout.cp_size
        plans = [read_plan(page_keys(hashes, ns), owners, N, rank) for ns in (self.kv_ns, self.indexer_ns)]
        indices = plans[0].page_indices
        if not indices:
            return len(hashes)
        present = [all(pair) for pair in zip(*(self.store.exists(list(p.keys)) for p in plans))]
        return local_usable_pages(indices, present, len(hashes))

    def fetch_pages(self, hashes: list[str], owners: list[int]) -> L3Fetched:
        """Fetch and verify this rank's pages (KV and indexer); the local
        usable prefix is the first own page missing or refused in either."""
        rank, N = self.layout.cp_rank, self.layout.cp_size
        kv = fetch_owned(self.store, self.kv_ns, read_plan(page_keys(hashes, self.kv_ns), owners, N, rank))
        idx = fetch_owned(
            self.store, self.indexer_ns, read_plan(page_keys(hashes, self.indexer_ns), owners, N, rank)
        )
        usable = min(kv.usable_pages, idx.usable_pages)
        idx_pages = dict(idx.restorable(usable))
        pages = {i: (page, idx_pages[i]) for i, page in kv.restorable(usable)}
        self.counters.fetched_pages += len(pages)
        self.counters.rejected_pages += sum(
            r is not None and r.reason != "missing" for r in kv.rejections + idx.rejections
        )
        return L3Fetched(usable, pages)

    def fill_host(self, logical_slot: int, kv_bytes: torch.Tensor, idx_bytes: torch.Tensor) -> None:
        """Put one verified own page into this rank's host pools."""
        row = self._row(logical_slot)
        self.kv_host.set_from_flat_data_page(row, kv_bytes.view(self.kv_host.kv_buffer.dtype))
        self.indexer_host.set_from_flat_data_page(
            row, idx_bytes.view(self.indexer_host.index_k_with_scale_buffer.dtype)
        )
