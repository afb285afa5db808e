"""Copies bound to one pool: buffers checked once, index tensors per call.

A server copies between the same device layers and SGLang host buffer for
its whole life. :func:`bind_kv_copies` / :func:`bind_indexer_copies` check
those buffers once -- placement, host layout, dtypes, shapes, row or page
bytes, layer counts, contiguity, dense host rows, pinned host memory for CUDA
layers -- and resolve the buffer-fixed part of every kernel launch. The
returned :class:`PoolCopies` then checks per call only what the call brings:
``layer_id`` and the index tensors (dtype, shape, device, contiguity, and
their values whenever that is free, exactly as the unbound copies do).

Per call it picks the backend with the same rule as :mod:`.transfer`
(:func:`~._backend.select_backend` on the pool's device, read at call time)
and counts into the same :func:`~._stats.copy_stats`. The bytes copied are
those of the unbound functions with the same arguments.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from . import _checks
from . import _triton_launch as _triton
from ._backend import run_counted
from ._checks import PoolGeometry
from ._copies import CheckedCopy
from sglang_cp_hicache.placement import CpPlacement

__all__ = ["PoolCopies", "as_locs", "bind_indexer_copies", "bind_kv_copies"]


def as_locs(indices: torch.Tensor) -> torch.Tensor:
    """SGLang's indices as the copies take them: int64 and contiguous (a
    dtype change runs on the tensor's own device: no host read; indices
    already so are returned as they are)."""
    return indices.to(torch.int64).contiguous()


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class PoolCopies:
    """Backup (every layer) and load (one layer) between one device pool's
    layers and the SGLang host buffer that mirrors them."""

    placement: CpPlacement
    pool: PoolGeometry
    layer_pools: tuple[PoolGeometry, ...]  # one per device layer: what a load of that layer copies to
    launches: _triton.PoolLaunches

    @property
    def device(self) -> torch.device:
        return self.pool.device

    @property
    def num_layers(self) -> int:
        """Device layers bound (loads take ``layer_id`` in ``[0, num_layers)``)."""
        return len(self.pool.device_layers)

    def backup(self, device_locs: torch.Tensor, host_locs: torch.Tensor) -> None:
        """D2H: every layer's owned pages of LOGICAL ``device_locs`` -> this
        rank's host slots ``host_locs`` (in owned order)."""
        run_counted(CheckedCopy(self.placement, self.pool, None, device_locs, host_locs), self.launches.backup)

    def load(self, layer_id: int, device_locs: torch.Tensor, host_locs: torch.Tensor) -> None:
        """H2D: host layer ``layer_id``'s slots ``host_locs`` -> the owned
        physical pages of LOGICAL ``device_locs`` on device layer ``layer_id``."""
        _checks.check_layer_id("layer_id", layer_id, self.num_layers)
        copy = CheckedCopy(self.placement, self.layer_pools[layer_id], layer_id, device_locs, host_locs)
        run_counted(copy, self.launches.loads[layer_id])


def _bind(
    kv: bool, dev_name: str, device_layers: object, host_name: str, host_buffer: object,
    host_layout: object, placement: object,
) -> PoolCopies:
    placement = _checks.check_placement(placement)
    pool = _checks.check_backup_pool(kv, dev_name, device_layers, host_name, host_buffer, host_layout, placement)
    # The kernel's needs are checked whatever the backend now: on the CPU it
    # follows TRITON_INTERPRET at call time, so either may run these buffers.
    launches = _triton.bind_launches(pool, dev_name, host_name, placement)
    layer_pools = tuple(dataclasses.replace(pool, device_layers=(t,)) for t in pool.device_layers)
    return PoolCopies(placement, pool, layer_pools, launches)


def bind_kv_copies(
    device_kv: Sequence[torch.Tensor], host_kv: torch.Tensor, host_layout: str, placement: CpPlacement
) -> PoolCopies:
    """Bind the KV copies: ``device_kv`` the per-layer ``(slots, 1, dim)``
    device buffers, ``host_kv`` SGLang's host KV buffer in ``host_layout``."""
    return _bind(True, "device_kv", device_kv, "host_kv", host_kv, host_layout, placement)


def bind_indexer_copies(
    device_index: Sequence[torch.Tensor], host_index: torch.Tensor, host_layout: str, placement: CpPlacement
) -> PoolCopies:
    """Bind the indexer copies: ``device_index`` the per-layer ``(pages,
    page_bytes)`` uint8 device buffers, ``host_index`` SGLang's host indexer
    buffer in ``host_layout``."""
    return _bind(False, "device_index", device_index, "host_index", host_index, host_layout, placement)
