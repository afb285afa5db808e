"""One rank's L3 tier on a pair of host pools (MLA KV and DSA indexer), the
part every SGLang release shares.

A page is keyed by its page hash and the namespace digest of its pool --
never by CP rank or size -- so deployments of any CP size (and either
release, for an identical configuration) share one store. Each page is two
objects, its KV bytes and its DSA indexer bytes, each in the library's
checked envelope. Only a page's owner writes or reads it.

What is a release's own is injected: the page hasher (SGLang's
``get_hash_str``), the host row of a host slot (``host_row``: a host slot is
the row itself on 0.5.18, a logical slot translated to its owner's local row
on 0.5.23), and how the store is opened (the adapter passes an opened :class:`PageStore`,
or opens one through :func:`open_tier_store`). The host pools are read by
attribute only (``kv_buffer``, ``kv_cache_dim``, ``layer_num``, ``layout``,
``page_size``, ``index_k_with_scale_buffer``, ``indexer_page_stride_size``,
``get_data_page`` (``flat=False``: a view of the page), ``set_from_flat_data_page``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Optional

import torch

from sglang_cp_hicache.l3.auth import UNKEYED, ObjectSeal
from sglang_cp_hicache.l3.capabilities import StoreCapabilities
from sglang_cp_hicache.l3.consensus import local_usable_pages
from sglang_cp_hicache.l3.keys import L3Namespace, page_keys
from sglang_cp_hicache.l3.host_copy import HostPageRuns
from sglang_cp_hicache.l3.host_read import read_into_host
from sglang_cp_hicache.l3.pages import PutOutcome, store_verified
from sglang_cp_hicache.l3.plan import read_plan, write_plan
from sglang_cp_hicache.l3.staging import StagingPool
from sglang_cp_hicache.l3.store import PageStore
from sglang_cp_hicache.placement import CpPlacement

logger = logging.getLogger(__name__)

__all__ = [
    "HostL3Tier", "HostRow", "L3Counters", "L3Snapshot", "PageHasher", "namespaces", "open_tier_store",
]

#: SGLang's page hasher: (token ids, prior hash, page_size=...) -> one hash per page.
PageHasher = Callable[..., list[str]]
#: A release's host row of a host slot its tree holds.
HostRow = Callable[[int], int]
#: A store opener: (backend, directory, extra_config) -> a store.
StoreOpener = Callable[[str, Optional[str], Optional[Mapping[str, Any]]], PageStore]

#: SGLang's host layouts -> the order of a flat KV page's bytes.
_KV_BYTE_ORDER = {"layer_first": "LPD", "page_first": "PLD", "page_first_direct": "LPD"}


@dataclass
class L3Counters:
    """One rank's L3 counters. Written from the scheduler thread and the L3
    I/O threads alike: change them with :meth:`add` only."""

    written_pages: int = 0  # own pages whose KV and indexer objects this rank stored (new or repaired)
    kept_pages: int = 0  # own pages already in L3 and sound when written again (left alone)
    repaired_pages: int = 0  # own pages whose damaged object(s) a write replaced
    write_failures: int = 0  # own pages whose KV or indexer put failed or raised
    dropped_writes: int = 0  # own pages not written: too many writes queued
    fetched_pages: int = 0  # own pages fetched and verified, before the MIN
    rejected_pages: int = 0  # own objects found but refused (short, long, corrupt, other namespace or key)
    restored_pages: int = 0  # own pages put into the host pool and kept after the MIN
    timeouts: int = 0  # lookups this rank gave up on at their deadline (answered "miss from here")
    prefetches: int = 0  # chains looked up (every rank alike)
    joined_requests: int = 0  # requests that waited on another request's lookup (every rank alike)
    restored_nodes: int = 0  # host-only nodes inserted from L3 (every rank alike)
    restored_tokens: int = 0  # logical tokens of those nodes (every rank alike)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


@dataclass(frozen=True)
class L3Snapshot:
    """This rank's own pages of a chain, copied out of its host pools (chain
    order): KV and indexer bytes per page, with the chain's hashes, owners
    and the hash before its first page (None: it starts at the root)."""

    hashes: list[str]
    owners: list[int]
    kv: list[torch.Tensor]
    indexer: list[torch.Tensor]
    parent: Optional[str] = None


def namespaces(
    model_id: str, kv_host: Any, indexer_host: Any, layer_start: int, seal: ObjectSeal = UNKEYED,
) -> tuple[L3Namespace, L3Namespace]:
    """The KV and indexer namespaces of a rank's host pools, their objects
    sealed with ``seal``."""
    page_size = int(kv_host.page_size)
    kv_dtype = kv_host.kv_buffer.dtype
    kv = L3Namespace(
        model_id=model_id, kv_dtype=kv_dtype, row_bytes=int(kv_host.kv_cache_dim) * kv_dtype.itemsize,
        page_size=page_size, pool="kv", layer_start=layer_start, layer_end=layer_start + int(kv_host.layer_num),
        byte_order=_KV_BYTE_ORDER[kv_host.layout], seal=seal,
    )
    idx_dtype = indexer_host.index_k_with_scale_buffer.dtype
    page_bytes = int(indexer_host.indexer_page_stride_size) * idx_dtype.itemsize
    if page_bytes % page_size:
        raise ValueError(f"indexer page of {page_bytes} bytes is not a whole number of {page_size} token rows")
    indexer = L3Namespace(
        model_id=model_id, kv_dtype=idx_dtype, row_bytes=page_bytes // page_size, page_size=page_size,
        pool="indexer", layer_start=layer_start, layer_end=layer_start + int(indexer_host.layer_num),
        byte_order="LPD", seal=seal,  # (layers, page stride) in every host layout
    )
    return kv, indexer


def open_tier_store(
    opener: StoreOpener, backend: str, directory: Optional[str], extra_config: Optional[Mapping[str, Any]],
    source: str,
) -> PageStore:
    """``opener(backend, directory, extra_config)``, with a bad store's
    ValueError naming ``source`` (the setting or flag that chose it)."""
    try:
        return opener(backend, directory, extra_config)
    except ValueError as exc:
        what = "L3 directory unusable" if backend == "file" else f"L3 {backend} store unusable"
        raise ValueError(f"{source}: {what}: {exc}") from exc


def _same_row(slot: int) -> int:
    return slot


def _as_bytes(page: torch.Tensor) -> torch.Tensor:
    return page.reshape(-1).contiguous().view(torch.uint8)


class HostL3Tier:
    """One rank's L3: keys, owned-page stores and fetches, host-pool bytes.

    ``page_hasher``: the release's page hash of a chain (SGLang's
    ``get_hash_str``). A host slot given to any method is the one the
    adapter's tree holds; ``host_row`` turns it into the host pools' row
    (None: the slot is the row).
    """

    def __init__(
        self, store: PageStore, placement: CpPlacement, kv_host: Any, indexer_host: Any, *,
        model_id: str, page_hasher: PageHasher, layer_start: int = 0, host_row: Optional[HostRow] = None,
        model_label: str = "", seal: ObjectSeal = UNKEYED,
    ) -> None:
        self.store = store
        self.caps = StoreCapabilities.of(store)  # found once: the store's shape is fixed from here on
        self.placement = placement
        self.kv_host = kv_host
        self.indexer_host = indexer_host
        self.page_hasher = page_hasher
        self.host_row: HostRow = host_row if host_row is not None else _same_row
        self.kv_ns, self.indexer_ns = namespaces(model_id, kv_host, indexer_host, layer_start, seal)
        self.model_label = model_label or model_id  # what the start-up log names
        self.page_size = self.kv_ns.page_size
        self.counters = L3Counters()
        self._kv_rows = HostPageRuns(kv_host, kv_host.kv_buffer)
        self._idx_rows = HostPageRuns(indexer_host, indexer_host.index_k_with_scale_buffer)
        self.staging = StagingPool(self.kv_ns, self.indexer_ns, self.caps)

    def describe(self) -> str:
        """What every rank must agree on: both namespaces (a file store's
        directory may be mounted at different paths on different hosts) and
        the objects' seal (with a secret, its key check value: a rank given
        another secret refuses to start rather than refuse every page)."""
        return f"kv:{self.kv_ns.digest()}|indexer:{self.indexer_ns.digest()}|objects:{self.kv_ns.seal.describe()}"

    # ---- keys ----------------------------------------------------------------
    def page_hashes(self, token_ids: list[int]) -> list[str]:
        """The page hash of every whole page of ``token_ids`` (a chain from
        the root, no extra key or cache salt: the same chain on every release)."""
        num_pages = len(token_ids) // self.page_size
        if num_pages == 0:
            return []
        hashes = self.page_hasher(list(token_ids[: num_pages * self.page_size]), None, page_size=self.page_size)
        if len(hashes) != num_pages:
            raise RuntimeError(f"get_hash_str gave {len(hashes)} hashes for {num_pages} pages")
        return hashes

    def chain_keys(self, hashes: list[str], parent: Optional[str] = None) -> tuple[list[str], list[str]]:
        """The KV and indexer keys of a chain's pages (``parent``: the page
        hash before the first one; None: the chain starts at the root)."""
        return page_keys(hashes, self.kv_ns, parent), page_keys(hashes, self.indexer_ns, parent)

    # ---- host -> L3 ------------------------------------------------------------
    def snapshot_pages(
        self, hashes: list[str], owners: list[int], slots: list[int], parent: Optional[str] = None
    ) -> L3Snapshot:
        """Copies of this rank's pages of a chain out of its host pools: what
        a write stores later, when the host slots may hold other pages.
        ``slots``: the host slot of the first token of each page this rank
        owns, in chain order."""
        rank, N = self.placement.cp_rank, self.placement.cp_size
        mine = len(write_plan(page_keys(hashes, self.kv_ns, parent), owners, N, rank).keys)
        if mine != len(slots):
            raise ValueError(f"slots must hold one host slot per owned page ({mine}), got {len(slots)}")
        rows = [self.host_row(s) for s in slots]
        # cloned: the host rows may be reused before the snapshot is stored
        kv = [_as_bytes(self.kv_host.get_data_page(r)).clone() for r in rows]
        idx = [_as_bytes(self.indexer_host.get_data_page(r)).clone() for r in rows]
        return L3Snapshot(list(hashes), list(owners), kv, idx, parent)

    def snapshot_keys(self, snap: L3Snapshot) -> list[tuple[str, str]]:
        """(KV key, indexer key) of each page of ``snap`` (chain order of this
        rank's pages)."""
        kv, idx = self.chain_keys(snap.hashes, snap.parent)
        rank = self.placement.cp_rank
        return [(k, i) for k, i, o in zip(kv, idx, snap.owners) if o == rank]

    def store_page(self, kv_key: str, idx_key: str, kv: torch.Tensor, idx: torch.Tensor) -> bool:
        """Store one own page (both objects; a sound object already there is
        kept, a damaged one replaced); counts it; True if both are in L3."""
        with self.staging.borrow() as staging:
            a = store_verified(self.caps, self.kv_ns, kv_key, kv, staging.kv())
            b = store_verified(self.caps, self.indexer_ns, idx_key, idx, staging.indexer())
        kept = a is PutOutcome.KEPT and b is PutOutcome.KEPT
        whole = a.in_l3 and b.in_l3
        self.counters.add(
            written_pages=int(whole and not kept), kept_pages=int(kept),
            repaired_pages=int(whole and PutOutcome.REPAIRED in (a, b)), write_failures=int(not whole),
        )
        return whole

    # ---- L3 -> host ------------------------------------------------------------
    def query_pages(self, hashes: list[str], owners: list[int], parent: Optional[str] = None) -> int:
        """This rank's local present prefix of a chain: the first own page
        whose KV or indexer object is absent (unverified: the fetch checks)."""
        rank, N = self.placement.cp_rank, self.placement.cp_size
        kv_keys, idx_keys = self.chain_keys(hashes, parent)
        plans = [read_plan(keys, owners, N, rank) for keys in (kv_keys, idx_keys)]
        indices = plans[0].page_indices
        if not indices:
            return len(hashes)
        present = [all(pair) for pair in zip(*(self.store.exists(list(p.keys)) for p in plans))]
        return local_usable_pages(indices, present, len(hashes))

    def read_page(self, kv_key: str, idx_key: str, slot: int, publish: Callable[[Callable[[], None]], None]) -> bool:
        """Read and verify one own page's two objects into the host pools
        at host slot ``slot``, every write into them through ``publish`` (an
        L3 job's: a cancelled job writes nothing): straight into the host
        rows where the page cache holds the objects, else through a
        staging buffer (:mod:`.host_read`). False if either object
        is missing or refused: the page is not this rank's to use, and what
        its rows hold is no page."""
        row = self.host_row(slot)
        with self.staging.borrow() as staging:
            bad = read_into_host(self.caps, self.kv_ns, kv_key, self._kv_rows, row, staging.kv_head,
                                 staging.kv_page, publish)
            if bad is None:
                bad = read_into_host(self.caps, self.indexer_ns, idx_key, self._idx_rows, row, staging.idx_head,
                                     staging.idx_page, publish)
        if bad is not None:
            if bad.reason != "missing":
                self.counters.add(rejected_pages=1)
                logger.warning("L3 object of %s rejected (%s): %s", kv_key, bad.reason, bad.detail)
            return False
        self.counters.add(fetched_pages=1)
        return True
