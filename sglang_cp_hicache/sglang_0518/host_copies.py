"""CP copies for one CP cache's SGLang 0.5.18 host pools (MLA KV + DSA indexer).

Under CP shared KV a copy operation carries the node's LOGICAL device locs
(every page, whoever owns it) and this rank's host slots of the pages it
owns. SGLang's stock copies need equal-length, physical index lists; this
library's kernels take exactly the CP form: they skip other ranks' pages and
translate owned ones to physical slots on the device, so the write and load
paths never read device memory on the host (no sync).

:func:`install_cp_copies` binds CP versions of ``backup_from_device_all_layer``
and ``load_to_device_per_layer`` to the two host pool INSTANCES of one CP
cache (never to the classes, so every other SGLang cache in the process
keeps its own copies), and makes the controller hand the kernels
device-side indices whatever ``--hicache-io-backend`` says. SGLang's L2
transfer engine keeps submitting them on its own streams: backups after the
compute stream, loads layer by layer with its ``layer_done_counter``.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch

from sglang_cp_hicache.kernels import transfer
from sglang_cp_hicache.placement import CpPlacement

__all__ = ["CP_COPY_MARK", "CpCopyTargets", "install_cp_copies"]

#: Set on every bound CP copy method (and checked at start-up).
CP_COPY_MARK = "__sglang_cp_hicache_cp_copy__"


@dataclass(frozen=True)
class CpCopyTargets:
    """The host pools of one CP cache whose copies this module replaced."""

    kv_host_pool: Any
    indexer_host_pool: Any


def _locs(indices: torch.Tensor) -> torch.Tensor:
    # A dtype change runs on the tensor's own device: no host read.
    return indices.to(torch.int64).contiguous()


def _refuse_unsupported(pool: Any, device_pool: Any) -> None:
    if getattr(pool, "dcp_size", 1) != 1:
        raise NotImplementedError("CP shared KV HiCache does not support decode CP (dcp_size > 1)")
    if pool._is_device_layer_sharded(device_pool):
        raise NotImplementedError("CP shared KV HiCache does not support layer-sharded device pools")
    if getattr(pool, "mtp_draft_device_pools", None):
        raise NotImplementedError("CP shared KV HiCache does not support MTP draft layers")


def _bind(pool: Any, name: str, fn) -> None:
    setattr(fn, CP_COPY_MARK, True)
    setattr(pool, name, types.MethodType(fn, pool))


def install_cp_copies(controller: Any, layout: CpPlacement) -> CpCopyTargets:
    """Route one CP cache's KV and indexer copies through this library's kernels."""
    group = controller.mem_pool_host
    kv_pool = group.anchor_entry.host_pool
    indexer_pools = [e.host_pool for e in group.entries if e.host_pool is not kv_pool]
    if len(indexer_pools) != 1:
        raise TypeError(
            "CP shared KV HiCache expects a DSA host pool group of [KV, indexer], got "
            f"{[type(e.host_pool).__name__ for e in group.entries]}"
        )
    indexer_pool = indexer_pools[0]

    def kv_backup(self, device_pool, host_indices, device_indices, io_backend):
        _refuse_unsupported(self, device_pool)
        transfer.backup_kv_all_layers(
            device_pool.kv_buffer, self.kv_buffer, self.layout,
            _locs(device_indices), _locs(host_indices), layout,
        )

    def kv_load(self, device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft=False):
        if is_draft:
            raise NotImplementedError("CP shared KV HiCache does not support MTP draft layers")
        _refuse_unsupported(self, device_pool)
        transfer.load_kv_one_layer(
            device_pool.kv_buffer[layer_id], self.kv_buffer, self.layout, layer_id,
            _locs(device_indices), _locs(host_indices), layout,
        )

    def indexer_backup(self, device_pool, host_indices, device_indices, io_backend):
        _refuse_unsupported(self, device_pool)
        transfer.backup_indexer_all_layers(
            device_pool.index_k_with_scale_buffer, self.index_k_with_scale_buffer, self.layout,
            _locs(device_indices), _locs(host_indices), layout,
        )

    def indexer_load(self, device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft=False):
        if is_draft:
            raise NotImplementedError("CP shared KV HiCache does not support MTP draft layers")
        _refuse_unsupported(self, device_pool)
        transfer.load_indexer_one_layer(
            device_pool.index_k_with_scale_buffer[layer_id], self.index_k_with_scale_buffer,
            self.layout, layer_id, _locs(device_indices), _locs(host_indices), layout,
        )

    _bind(kv_pool, "backup_from_device_all_layer", kv_backup)
    _bind(kv_pool, "load_to_device_per_layer", kv_load)
    _bind(indexer_pool, "backup_from_device_all_layer", indexer_backup)
    _bind(indexer_pool, "load_to_device_per_layer", indexer_load)

    def move_indices(self, host_indices, device_indices):
        # The kernels take device-side indices on every io backend; "direct"
        # would read the device locs back and pair them 1:1 with host slots.
        if host_indices.device != self.device:
            host_indices = host_indices.to(self.device, non_blocking=True)
        return host_indices, device_indices

    def move_write_operation(self, op):
        # Never the page_first write-back JIT path: it keeps host indices on
        # the CPU for SGLang's own kernel.
        return self._move_op_indices(op)

    _bind(controller, "move_indices", move_indices)
    _bind(controller, "_move_write_operation", move_write_operation)
    return CpCopyTargets(kv_pool, indexer_pool)


def cp_copies_installed(targets: CpCopyTargets) -> bool:
    """True when all four copy methods of both pools are this module's."""
    return all(
        getattr(getattr(pool, name), CP_COPY_MARK, False)
        for pool in (targets.kv_host_pool, targets.indexer_host_pool)
        for name in ("backup_from_device_all_layer", "load_to_device_per_layer")
    )
