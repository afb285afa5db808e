"""CP copies for one CP cache's SGLang 0.5.18 host pools (MLA KV + DSA indexer).

Under CP shared KV a copy operation carries the node's LOGICAL device locs
(every page, whoever owns it) and this rank's host slots of the pages it
owns. SGLang's stock copies need equal-length, physical index lists; this
library's kernels take exactly the CP form: they skip other ranks' pages and
translate owned ones to physical slots on the device, so the write and load
paths never read device memory on the host (no sync).

:func:`install_cp_copies` binds the copies of each of the two host pools of
one CP cache to the device pool its host pool group entry names -- the pool
SGLang's L2 transfers hand to every copy -- so the buffers are checked once,
at cache construction (:mod:`sglang_cp_hicache.kernels.bound`). It then
replaces ``backup_from_device_all_layer`` and ``load_to_device_per_layer`` on
those host pool INSTANCES (never on the classes, so every other SGLang cache
in the process keeps its own copies); each call checks only that it got the
bound device pool, then copies. It also makes the controller hand the
kernels device-side indices whatever ``--hicache-io-backend`` says. SGLang's
L2 transfer engine keeps submitting the copies on its own streams: backups
after the compute stream, loads layer by layer with its ``layer_done_counter``.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any


from sglang_cp_hicache.kernels.bound import PoolCopies, as_locs, bind_indexer_copies, bind_kv_copies
from sglang_cp_hicache.placement import CpPlacement

__all__ = ["CP_COPY_MARK", "CpCopyTargets", "cp_copies_installed", "install_cp_copies"]

#: Set on every bound CP copy method (and checked at start-up).
CP_COPY_MARK = "__sglang_cp_hicache_cp_copy__"


@dataclass(frozen=True)
class CpCopyTargets:
    """The host pools of one CP cache whose copies this module replaced, and
    the copies bound to them."""

    kv_host_pool: Any
    indexer_host_pool: Any
    kv_copies: PoolCopies
    indexer_copies: PoolCopies


def _refuse_unsupported(host_pool: Any, device_pool: Any) -> None:
    if getattr(host_pool, "dcp_size", 1) != 1:
        raise NotImplementedError("CP shared KV HiCache does not support decode CP (dcp_size > 1)")
    if host_pool._is_device_layer_sharded(device_pool):
        raise NotImplementedError("CP shared KV HiCache does not support layer-sharded device pools")
    if getattr(host_pool, "mtp_draft_device_pools", None):
        raise NotImplementedError("CP shared KV HiCache does not support MTP draft layers")


def _bind_method(obj: Any, name: str, fn) -> None:
    setattr(fn, CP_COPY_MARK, True)
    setattr(obj, name, types.MethodType(fn, obj))


def _replace_pool_copies(host_pool: Any, bound_device_pool: Any, copies: PoolCopies) -> None:
    """SGLang's two copy methods of ``host_pool``, through ``copies``."""

    def check_device_pool(device_pool: Any) -> None:
        if device_pool is not bound_device_pool:
            raise ValueError(
                f"device_pool is not the device pool the CP copies of this {type(host_pool).__name__} "
                f"were bound to (got a {type(device_pool).__name__})"
            )

    def backup(self, device_pool, host_indices, device_indices, io_backend):
        check_device_pool(device_pool)
        copies.backup(as_locs(device_indices), as_locs(host_indices))

    def load(self, device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft=False):
        if is_draft:
            raise NotImplementedError("CP shared KV HiCache does not support MTP draft layers")
        check_device_pool(device_pool)
        copies.load(layer_id, as_locs(device_indices), as_locs(host_indices))

    _bind_method(host_pool, "backup_from_device_all_layer", backup)
    _bind_method(host_pool, "load_to_device_per_layer", load)


def install_cp_copies(controller: Any, placement: CpPlacement) -> CpCopyTargets:
    """Route one CP cache's KV and indexer copies through this library's kernels."""
    group = controller.mem_pool_host
    kv_entry = group.anchor_entry
    indexer_entries = [e for e in group.entries if e.host_pool is not kv_entry.host_pool]
    if len(indexer_entries) != 1:
        raise TypeError(
            "CP shared KV HiCache expects a DSA host pool group of [KV, indexer], got "
            f"{[type(e.host_pool).__name__ for e in group.entries]}"
        )
    indexer_entry = indexer_entries[0]
    for entry in (kv_entry, indexer_entry):
        _refuse_unsupported(entry.host_pool, entry.device_pool)
    kv_pool, indexer_pool = kv_entry.host_pool, indexer_entry.host_pool
    # A host pool's ``layout`` is SGLang's host memory layout string.
    kv_copies = bind_kv_copies(kv_entry.device_pool.kv_buffer, kv_pool.kv_buffer, kv_pool.layout, placement)
    indexer_copies = bind_indexer_copies(
        indexer_entry.device_pool.index_k_with_scale_buffer, indexer_pool.index_k_with_scale_buffer,
        indexer_pool.layout, placement,
    )
    _replace_pool_copies(kv_pool, kv_entry.device_pool, kv_copies)
    _replace_pool_copies(indexer_pool, indexer_entry.device_pool, indexer_copies)

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

    _bind_method(controller, "move_indices", move_indices)
    _bind_method(controller, "_move_write_operation", move_write_operation)
    return CpCopyTargets(kv_pool, indexer_pool, kv_copies, indexer_copies)


def cp_copies_installed(targets: CpCopyTargets) -> bool:
    """True when all four copy methods of both pools are this module's."""
    return all(
        getattr(getattr(pool, name), CP_COPY_MARK, False)
        for pool in (targets.kv_host_pool, targets.indexer_host_pool)
        for name in ("backup_from_device_all_layer", "load_to_device_per_layer")
    )
