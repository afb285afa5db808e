"""Upstream's L2 transfer engine with this library's copy kernels.

SGLang 0.5.23's ``L2TransferEngine`` runs resolved device<->host transfers
on its two streams: ``submit_device_to_host`` calls each host pool's
``backup_from_device_all_layer_physical``, ``submit_host_to_device`` its
``load_to_device_per_layer_physical`` layer by layer. In a KV-sharded stack
those receive rows the controller narrowed with ``owned_rows`` (a host
``nonzero`` plus a device gather) and run the stock MLA kernels.

:class:`LibraryL2TransferEngine` keeps upstream's submission (streams, start
and finish events, layout leases, index preparation) and replaces only the
per-transfer copy: the kernels of :mod:`sglang_cp_hicache.kernels.transfer`
take the LOGICAL device locs of whole pages, skip the pages other ranks own
and translate the owned ones to physical rows inside the kernel, so nothing
reads device memory on the host. The host side is the rank-local rows of the
owned tokens, in order (what :class:`~.controller.LibraryCopyController`
hands over).

Two pools take part, the anchor (``PageInterleaveHostPool`` around an
``MLATokenToKVPoolHost``: latent KV rows) and the ``DSAIndexerPoolHost``
(page-major indexer rows); any other host pool is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from sglang.srt.mem_cache.l2_transfer import L2Transfer, L2TransferEngine, TransferCompletion
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.page_interleave import PageInterleaveHostPool

from sglang_cp_hicache.kernels import transfer
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


def _locs(indices: torch.Tensor) -> torch.Tensor:
    if indices.dtype != torch.int64:
        return indices.to(torch.int64)  # the kernels index with int64 only
    return indices


class LibraryL2TransferEngine(L2TransferEngine):
    """``L2TransferEngine`` whose copies are this library's CP kernels."""

    def __init__(self, io_backend: str, layout: CpPlacement) -> None:
        if not isinstance(layout, CpPlacement):
            raise TypeError(f"layout must be a CpPlacement, got {type(layout).__name__}")
        if io_backend != "kernel":
            raise ValueError(
                f"io_backend must be 'kernel' for the library's copy kernels, got {io_backend!r}"
            )
        super().__init__(io_backend)
        self.layout = layout
        self.counters = CopyCounters()

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
        device_locs = _locs(item.device_indices)
        host_locs = _locs(item.host_indices)
        kv_pool = kv_host_pool_of(item.host_pool)
        if kv_pool is not None:
            transfer.backup_kv_all_layers(
                kv_pool.device_kv_buffers, kv_pool.kv_buffer, kv_pool.layout,
                device_locs, host_locs, self.layout,
            )
            self.counters.kv_backups += 1
            self.counters.backup_owned_tokens += host_locs.numel()
        elif isinstance(item.host_pool, DSAIndexerPoolHost):
            index_pool = item.host_pool
            transfer.backup_indexer_all_layers(
                index_pool.packed_device_index_buffers, index_pool.index_k_with_scale_buffer,
                index_pool.layout, device_locs, host_locs, self.layout,
            )
            self.counters.indexer_backups += 1
        else:
            raise TypeError(f"no library copy for host pool {type(item.host_pool).__name__}")

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
        device_locs = _locs(item.device_indices)
        host_locs = _locs(item.host_indices)
        kv_pool = kv_host_pool_of(item.host_pool)
        if kv_pool is not None:
            transfer.load_kv_one_layer(
                kv_pool.device_kv_buffers[layer_id], kv_pool.kv_buffer, kv_pool.layout, layer_id,
                device_locs, host_locs, self.layout,
            )
            self.counters.kv_layer_loads += 1
        elif isinstance(item.host_pool, DSAIndexerPoolHost):
            index_pool = item.host_pool
            transfer.load_indexer_one_layer(
                item.device_pool.index_k_with_scale_buffer[layer_id],
                index_pool.index_k_with_scale_buffer, index_pool.layout, layer_id,
                device_locs, host_locs, self.layout,
            )
            self.counters.indexer_layer_loads += 1
        else:
            raise TypeError(f"no library copy for host pool {type(item.host_pool).__name__}")
