"""Launchers of the CP page-copy kernel (see :mod:`._kernel` for how it works).

Private: callers go through :mod:`.transfer` (one call) or :mod:`.bound`
(bound copies), which pick the backend and count the copies; the kernel's
own tests and benchmarks call these directly for the tuning arguments.

Four launchers, one per operation, each with the signature of its
:mod:`.reference` twin plus two keyword-only tuning arguments:

* ``backup_kv_all_layers`` / ``backup_indexer_all_layers`` -- D2H, every layer,
  one launch;
* ``load_kv_one_layer`` / ``load_indexer_one_layer`` -- H2D, one layer, one
  launch (layer-wise overlap with the forward pass).

They validate every argument, check the index values whenever that is free
(indices on the CPU, or debug mode), return before launching on empty
batches, and launch on the device buffers' current CUDA stream without a
device-to-host sync. CPU tensors run under Triton's interpreter; those
launches are serialised process-wide (:data:`INTERPRETER_LOCK`), because the
interpreter patches ``triton.language`` globally while a kernel runs.

:func:`bind_launches` resolves the buffer-fixed part of every launch of one
checked pool once; :func:`backup_bound` / :func:`load_bound` then check only
the index tensors (what :class:`~.bound.PoolCopies` calls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from . import _checks
from . import _launch_spec as _spec
from ._checks import PoolGeometry, check_launchable
from ._kernel import (
    COUNT_PAGES,
    DEFAULT_BLOCK_BYTES,
    DEFAULT_NUM_CTAS,
    MAX_TILE_PAGES,
    VECTOR_BYTES,
    WALK_PAGES,
)
from ._launch_spec import INTERPRETER_LOCK, LaunchPlan, PoolPart
from sglang_cp_hicache.placement import CpPlacement

__all__ = [
    "COUNT_PAGES",
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_NUM_CTAS",
    "INTERPRETER_LOCK",
    "MAX_TILE_PAGES",
    "WALK_PAGES",
    "PoolLaunches",
    "backup_bound",
    "backup_indexer_all_layers",
    "backup_kv_all_layers",
    "bind_launches",
    "check_launchable",
    "load_bound",
    "load_indexer_one_layer",
    "load_kv_one_layer",
]


# ----------------------------------------------------------------------------- argument checks
def _check_num_ctas(num_ctas: int | None, block_bytes: int | None) -> tuple[int, int]:
    num_ctas = DEFAULT_NUM_CTAS if num_ctas is None else num_ctas
    block_bytes = DEFAULT_BLOCK_BYTES if block_bytes is None else block_bytes
    if isinstance(num_ctas, bool) or not isinstance(num_ctas, int) or num_ctas < 1:
        raise ValueError(f"num_ctas must be a positive int, got {num_ctas!r}")
    if (
        isinstance(block_bytes, bool) or not isinstance(block_bytes, int)
        or block_bytes < VECTOR_BYTES or block_bytes & (block_bytes - 1)
    ):
        raise ValueError(f"block_bytes must be a power of two >= {VECTOR_BYTES}, got {block_bytes!r}")
    return num_ctas, block_bytes


def _check_indices(
    device_locs, host_locs, placement, dev_num_pages, host_num_pages, *, to_host: bool
) -> None:
    """Check the index values whenever that is free: indices on the CPU
    (both backends do) or debug mode. CUDA indices are not read without debug
    mode (that would be a sync); the kernel then skips any page outside the
    buffers (negative locations included) instead of writing it."""
    if device_locs.device.type == "cpu" or _checks.debug_enabled():
        _checks.check_indices(device_locs, host_locs, placement, dev_num_pages, host_num_pages, to_host=to_host)


def _check_call(
    device_locs: object, host_locs: object, placement: CpPlacement, device: torch.device,
    dev_num_pages: int, host_num_pages: int, *, to_host: bool,
) -> bool:
    """Per-call checks of the index tensors; True when there is a page to copy."""
    _checks.check_call_indices(device_locs, host_locs, placement, device)
    _check_indices(device_locs, host_locs, placement, dev_num_pages, host_num_pages, to_host=to_host)
    return host_locs.numel() > 0


# ----------------------------------------------------------------------------- plans
def _backup_plan(pool: PoolGeometry) -> LaunchPlan:
    return LaunchPlan(pool.device_layers, True, pool.host_buffer, pool.host, 0, pool.dev_num_pages, to_host=True)


def _load_plan(pool: PoolGeometry, device_layer: torch.Tensor, layer_id: int) -> LaunchPlan:
    return LaunchPlan(
        (device_layer,), False, pool.host_buffer, pool.host, layer_id, pool.dev_num_pages, to_host=False
    )


def _launch(
    plan: LaunchPlan,
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    placement: CpPlacement,
    num_ctas: int,
    block_bytes: int,
) -> None:
    part = _spec.pool_part(plan, placement.page_size, block_bytes)
    _spec.run(part, device_locs, host_locs, placement, num_ctas)


# ----------------------------------------------------------------------------- bound pools
@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class PoolLaunches:
    """The buffer-fixed part of every launch of one checked pool: the backup
    and one load per device layer (default tuning)."""

    backup: PoolPart
    loads: tuple[PoolPart, ...]


def bind_launches(
    pool: PoolGeometry, dev_name: str, host_name: str, placement: CpPlacement
) -> PoolLaunches:
    """Check what the kernel needs of ``pool`` and resolve its launches."""
    check_launchable(pool, [f"{dev_name}[{i}]" for i in range(len(pool.device_layers))], host_name)
    p, bb = placement.page_size, DEFAULT_BLOCK_BYTES
    return PoolLaunches(
        backup=_spec.pool_part(_backup_plan(pool), p, bb),
        loads=tuple(_spec.pool_part(_load_plan(pool, t, i), p, bb) for i, t in enumerate(pool.device_layers)),
    )


def _run_bound(part: PoolPart, device_locs, host_locs, placement: CpPlacement) -> None:
    to_host = part.meta["TO_HOST"]
    if _check_call(device_locs, host_locs, placement, part.device, part.dev_num_pages, part.host_num_pages,
                   to_host=to_host):
        _spec.run(part, device_locs, host_locs, placement, DEFAULT_NUM_CTAS)


def backup_bound(
    launches: PoolLaunches, device_locs: torch.Tensor, host_locs: torch.Tensor, placement: CpPlacement
) -> None:
    """D2H of every layer of a bound pool; checks only the index tensors."""
    _run_bound(launches.backup, device_locs, host_locs, placement)


def load_bound(
    launches: PoolLaunches, layer_id: int, device_locs: torch.Tensor, host_locs: torch.Tensor,
    placement: CpPlacement,
) -> None:
    """H2D of layer ``layer_id`` (checked by the caller) of a bound pool."""
    _run_bound(launches.loads[layer_id], device_locs, host_locs, placement)


# ----------------------------------------------------------------------------- public launchers
def _backup_all_layers(
    dev_name: str, device_layers, host_name: str, host: torch.Tensor, host_layout: str,
    device_locs: torch.Tensor, host_locs: torch.Tensor, placement: CpPlacement,
    *, kv: bool, num_ctas: int | None, block_bytes: int | None,
) -> None:
    """Shared body of the two backups (KV rows or indexer pages)."""
    placement, pool = _checks.checked_copy_pool(kv, dev_name, device_layers, host_name, host, host_layout,
                                                placement)
    num_ctas, block_bytes = _check_num_ctas(num_ctas, block_bytes)
    if _check_call(device_locs, host_locs, placement, pool.device, pool.dev_num_pages, pool.host.num_pages,
                   to_host=True):
        _launch(_backup_plan(pool), device_locs, host_locs, placement, num_ctas, block_bytes)


def _load_one_layer(
    dev_name: str, device_layer, host_name: str, host: torch.Tensor, host_layout: str,
    layer_id: int, device_locs: torch.Tensor, host_locs: torch.Tensor, placement: CpPlacement,
    *, kv: bool, num_ctas: int | None, block_bytes: int | None,
) -> None:
    """Shared body of the two loads (KV rows or indexer pages)."""
    placement, pool = _checks.checked_copy_pool(kv, dev_name, device_layer, host_name, host, host_layout,
                                                placement, layer_id)
    num_ctas, block_bytes = _check_num_ctas(num_ctas, block_bytes)
    if _check_call(device_locs, host_locs, placement, pool.device, pool.dev_num_pages, pool.host.num_pages,
                   to_host=False):
        _launch(_load_plan(pool, pool.device_layers[0], layer_id), device_locs, host_locs, placement,
                num_ctas, block_bytes)


def backup_kv_all_layers(
    device_kv: Sequence[torch.Tensor],
    host_kv: torch.Tensor,
    host_layout: str,
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    placement: CpPlacement,
    *,
    num_ctas: int | None = None,
    block_bytes: int | None = None,
) -> None:
    """D2H: every layer's owned KV pages -> host slots. One launch, no sync."""
    _backup_all_layers("device_kv", device_kv, "host_kv", host_kv, host_layout, device_locs,
                       host_locs, placement, kv=True, num_ctas=num_ctas, block_bytes=block_bytes)


def load_kv_one_layer(
    device_kv_layer: torch.Tensor,
    host_kv: torch.Tensor,
    host_layout: str,
    layer_id: int,
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    placement: CpPlacement,
    *,
    num_ctas: int | None = None,
    block_bytes: int | None = None,
) -> None:
    """H2D: one layer's host slots -> owned physical KV pages. One launch, no sync."""
    _load_one_layer("device_kv_layer", device_kv_layer, "host_kv", host_kv, host_layout, layer_id,
                    device_locs, host_locs, placement, kv=True, num_ctas=num_ctas, block_bytes=block_bytes)


def backup_indexer_all_layers(
    device_index: Sequence[torch.Tensor],
    host_index: torch.Tensor,
    host_layout: str,
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    placement: CpPlacement,
    *,
    num_ctas: int | None = None,
    block_bytes: int | None = None,
) -> None:
    """D2H: every layer's owned indexer pages -> host pages. One launch, no sync."""
    _backup_all_layers("device_index", device_index, "host_index", host_index, host_layout,
                       device_locs, host_locs, placement, kv=False, num_ctas=num_ctas,
                       block_bytes=block_bytes)


def load_indexer_one_layer(
    device_index_layer: torch.Tensor,
    host_index: torch.Tensor,
    host_layout: str,
    layer_id: int,
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    placement: CpPlacement,
    *,
    num_ctas: int | None = None,
    block_bytes: int | None = None,
) -> None:
    """H2D: one layer's host indexer pages -> owned physical device pages. No sync."""
    _load_one_layer("device_index_layer", device_index_layer, "host_index", host_index, host_layout,
                    layer_id, device_locs, host_locs, placement, kv=False, num_ctas=num_ctas,
                    block_bytes=block_bytes)
