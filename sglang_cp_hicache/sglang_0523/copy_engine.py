"""Upstream's L2 transfer engine with this library's copy kernels.

SGLang 0.5.23's ``L2TransferEngine`` runs resolved device<->host transfers
on its two streams: ``submit_device_to_host`` calls each host pool's
``backup_from_device_all_layer_physical``, ``submit_host_to_device`` its
``load_to_device_per_layer_physical`` layer by layer. In a KV-sharded stack
those receive rows the controller narrowed with ``owned_rows`` (a host
``nonzero`` plus a device gather) and run the stock MLA kernels.

:class:`LibraryL2TransferEngine` keeps upstream's submission (streams, start
and finish events, layout leases, index preparation) and replaces only the
per-transfer copy: this library's kernels (:mod:`sglang_cp_hicache.kernels`)
take the LOGICAL device locs of whole pages, skip the pages other ranks own
and translate the owned ones to physical rows inside the kernel, so nothing
reads device memory on the host. The host side is the rank-local rows of the
owned tokens, in order (what :class:`~.controller.LibraryCopyController`
hands over).

Two pools take part, the anchor (``PageInterleaveHostPool`` around an
``MLATokenToKVPoolHost``: latent KV rows) and the ``DSAIndexerPoolHost``
(page-major indexer rows); any other host pool is refused. Each is bound
once, on its first transfer, to the device buffers it holds
(``device_kv_buffers`` / ``packed_device_index_buffers``): the buffers are
checked then (:mod:`sglang_cp_hicache.kernels.bound`), and every later
transfer checks only its index tensors.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

from sglang.srt.mem_cache.l2_transfer import L2Transfer, L2TransferEngine, TransferCompletion
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.page_interleave import PageInterleaveHostPool

from sglang_cp_hicache.kernels.bound import PoolCopies, as_locs, bind_indexer_copies, bind_kv_copies
from sglang_cp_hicache.placement import CpPlacement

__all__ = ["CopyCounters", "LibraryL2TransferEngine", "kv_host_pool_of"]


@dataclass
class CopyCounters:
    """What went through the library's kernels on this rank."""

    d2h_submissions: int = 0
    h2d_submissions: int = 0
    kv_backups: int = 0  # all-layer KV backup calls
    indexer_backups: int = 0
    kv_layer_loads: int = 0  # one-layer KV load calls
    indexer_layer_loads: int = 0
    backup_owned_tokens: int = 0  # rows written to host (KV anchor)
    load_owned_tokens: int = 0  # rows restored to device (KV anchor, once per load)


def kv_host_pool_of(host_pool: Any) -> Optional[MLATokenToKVPoolHost]:
    """The native MLA pool behind the sharded anchor facade, else None."""
    if isinstance(host_pool, PageInterleaveHostPool) and isinstance(
        host_pool.host_pool, MLATokenToKVPoolHost
    ):
        return host_pool.host_pool
    return None


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class _BoundPool:
    """One transfer host pool's copies, and which counters they feed."""

    host_pool: Any  # held so the id() key below is never reused
    copies: PoolCopies
    kv: bool
    # Loads must come for the device pool the bound layers belong to (the
    # indexer's; the KV anchor's layers are the host pool's own).
    device_pool: Any = None


class LibraryL2TransferEngine(L2TransferEngine):
    """``L2TransferEngine`` whose copies are this library's CP kernels."""

    def __init__(self, io_backend: str, placement: CpPlacement) -> None:
        if not isinstance(placement, CpPlacement):
            raise TypeError(f"placement must be a CpPlacement, got {type(placement).__name__}")
        if io_backend != "kernel":
            raise ValueError(
                f"io_backend must be 'kernel' for the library's copy kernels, got {io_backend!r}"
            )
        super().__init__(io_backend)
        self.placement = placement
        self.counters = CopyCounters()
        self._bound: dict[int, _BoundPool] = {}
        self._bind_lock = threading.Lock()  # D2H and H2D may bind from two threads

    def _copies_for(self, host_pool: Any) -> _BoundPool:
        """The copies bound to ``host_pool``'s buffers, bound on first use."""
        bound = self._bound.get(id(host_pool))
        if bound is not None:
            return bound
        with self._bind_lock:
            bound = self._bound.get(id(host_pool))
            if bound is None:
                bound = self._bind(host_pool)
                self._bound[id(host_pool)] = bound
        return bound

    def _bind(self, host_pool: Any) -> _BoundPool:
        # A host pool's ``layout`` is SGLang's host memory layout string.
        kv_pool = kv_host_pool_of(host_pool)
        if kv_pool is not None:
            copies = bind_kv_copies(kv_pool.device_kv_buffers, kv_pool.kv_buffer, kv_pool.layout, self.placement)
            return _BoundPool(host_pool, copies, kv=True)
        if isinstance(host_pool, DSAIndexerPoolHost):
            copies = bind_indexer_copies(
                host_pool.packed_device_index_buffers, host_pool.index_k_with_scale_buffer,
                host_pool.layout, self.placement,
            )
            return _BoundPool(host_pool, copies, kv=False, device_pool=host_pool.device_pool)
        raise TypeError(f"no library copy for host pool {type(host_pool).__name__}")

    # ---- D2H ----------------------------------------------------------------
    def submit_device_to_host(self, transfers: list[L2Transfer]) -> TransferCompletion:
        self.counters.d2h_submissions += 1
        with self._submission(transfers, self.device_to_host_stream, "device_to_host") as (
            prepared,
            completion,
        ):
            for item in prepared:
                self._backup(item)
        return completion

    def _backup(self, item: L2Transfer) -> None:
        bound = self._copies_for(item.host_pool)
        host_locs = as_locs(item.host_indices)
        bound.copies.backup(as_locs(item.device_indices), host_locs)
        if bound.kv:
            self.counters.kv_backups += 1
            self.counters.backup_owned_tokens += host_locs.numel()
        else:
            self.counters.indexer_backups += 1

    # ---- H2D ----------------------------------------------------------------
    def submit_host_to_device(
        self,
        transfers: list[L2Transfer],
        *,
        transfer_layer_id_max: int,
        start_event: Any = None,
        on_layer_done: Optional[Callable[[int], None]] = None,
    ) -> TransferCompletion:
        self.counters.h2d_submissions += 1
        with self._submission(
            transfers, self.host_to_device_stream, "host_to_device", start_event
        ) as (prepared, completion):
            primary = prepared[0] if prepared else None
            if primary is not None and kv_host_pool_of(primary.host_pool) is not None:
                self.counters.load_owned_tokens += primary.host_indices.numel()
            # Layer by layer, every pool per layer, then the layer's event:
            # the forward pass may start on layer l once it is signalled.
            for layer_id in range(transfer_layer_id_max):
                for item in prepared:
                    local_layer = item.layer_mapper(layer_id) if item.layer_mapper is not None else layer_id
                    if local_layer is None or (
                        item is not primary
                        and item.layer_mapper is None
                        and layer_id >= item.host_pool.layer_num
                    ):
                        continue
                    self._load_layer(item, local_layer)
                if on_layer_done is not None:
                    on_layer_done(layer_id)
        return completion

    def _load_layer(self, item: L2Transfer, layer_id: int) -> None:
        if item.is_draft:
            raise NotImplementedError("packed MTP draft layers are not copied by the library kernels")
        bound = self._copies_for(item.host_pool)
        if bound.device_pool is not None and item.device_pool is not bound.device_pool:
            raise ValueError(
                f"the transfer's device_pool is not the one whose layers the {type(item.host_pool).__name__} "
                f"copies were bound to"
            )
        bound.copies.load(layer_id, as_locs(item.device_indices), as_locs(item.host_indices))
        if bound.kv:
            self.counters.kv_layer_loads += 1
        else:
            self.counters.indexer_layer_loads += 1
