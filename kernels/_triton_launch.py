"""Launchers of the CP page-copy kernel (see :mod:`._kernel` for how it works).

Private: callers go through :mod:`.transfer` (one call) or :mod:`.bound`
(bound copies), which pick the backend and count the copies; the kernel's
own tests and benchmarks call these directly for the tuning arguments.

Four launchers, one per operation, each with the signature of its
:mod:`.reference` twin (one :class:`~._copies.CopyFunctions`) plus two
keyword-only tuning arguments, ``num_ctas`` and ``block_bytes``:

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
checked pool once; :func:`run_bound` then checks only the index tensors
(what :class:`~.bound.PoolCopies` calls).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _checks
from . import _launch_spec as _spec
from ._checks import PoolGeometry, check_launchable
from ._copies import CheckedCopy, CopyFunctions
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
    "backup_indexer_all_layers",
    "backup_kv_all_layers",
    "backup_plan",
    "bind_launches",
    "check_launchable",
    "load_indexer_one_layer",
    "load_kv_one_layer",
    "load_plan",
    "run",
    "run_bound",
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
def backup_plan(pool: PoolGeometry) -> LaunchPlan:
    """Every layer of ``pool`` to the host (also warm-up's stand-ins)."""
    return LaunchPlan(pool.device_layers, True, pool.host_buffer, pool.host, 0, pool.dev_num_pages, to_host=True)


def load_plan(pool: PoolGeometry, device_layer: torch.Tensor, layer_id: int) -> LaunchPlan:
    return LaunchPlan(
        (device_layer,), False, pool.host_buffer, pool.host, layer_id, pool.dev_num_pages, to_host=False
    )


def _launch(
    plan: LaunchPlan, device_locs: torch.Tensor, host_locs: torch.Tensor, placement: CpPlacement, num_ctas: int,
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
        backup=_spec.pool_part(backup_plan(pool), p, bb),
        loads=tuple(_spec.pool_part(load_plan(pool, t, i), p, bb) for i, t in enumerate(pool.device_layers)),
    )


def run_bound(part: PoolPart, device_locs: torch.Tensor, host_locs: torch.Tensor, placement: CpPlacement) -> None:
    """One launch of a bound pool (its backup, or one layer's load, resolved
    by :func:`bind_launches`); checks only the index tensors."""
    if _check_call(device_locs, host_locs, placement, part.device, part.dev_num_pages, part.host_num_pages,
                   to_host=part.meta["TO_HOST"]):
        _spec.run(part, device_locs, host_locs, placement, DEFAULT_NUM_CTAS)


# ----------------------------------------------------------------------------- public launchers
def run(copy: CheckedCopy, *, num_ctas: int | None = None, block_bytes: int | None = None) -> None:
    """One copy whose buffers :class:`~._copies.CopyFunctions` checked, with
    the launch's tuning (None: the defaults)."""
    num_ctas, block_bytes = _check_num_ctas(num_ctas, block_bytes)
    pool, dl, hl, placement = copy.pool, copy.device_locs, copy.host_locs, copy.placement
    if _check_call(dl, hl, placement, pool.device, pool.dev_num_pages, pool.host.num_pages, to_host=copy.to_host):
        plan = backup_plan(pool) if copy.to_host else load_plan(pool, pool.device_layers[0], copy.layer_id)
        _launch(plan, dl, hl, placement, num_ctas, block_bytes)


# The four launchers: the signatures and buffer checks of
# :class:`~._copies.CopyFunctions`, plus ``num_ctas`` / ``block_bytes``.
_COPIES = CopyFunctions(run)
backup_kv_all_layers = _COPIES.backup_kv_all_layers
load_kv_one_layer = _COPIES.load_kv_one_layer
backup_indexer_all_layers = _COPIES.backup_indexer_all_layers
load_indexer_one_layer = _COPIES.load_indexer_one_layer
