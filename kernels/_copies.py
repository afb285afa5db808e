"""The four page copies' signatures and buffer checks, written once for every
backend (:mod:`.reference`, :mod:`._triton_launch`, :mod:`.transfer`).

Each copy checks the placement and its buffers (:meth:`CheckedCopy.checked`)
and hands the :class:`CheckedCopy` to its backend's run function, which
checks the index tensors and copies. So a bad buffer fails every backend the
same way, in the same order, before any backend-specific work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from . import _checks
from ._checks import PoolGeometry
from sglang_cp_hicache.placement import CpPlacement

__all__ = ["CheckedCopy", "CopyFunctions"]


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class CheckedCopy:
    """One copy whose placement and buffers passed every check; the index
    tensors are the backend's to check (values only where reading is free)."""

    placement: CpPlacement
    pool: PoolGeometry  # a backup's every layer, or the one device layer a load writes
    layer_id: int | None  # the host layer a load reads; None for a backup
    device_locs: torch.Tensor
    host_locs: torch.Tensor

    @classmethod
    def checked(
        cls, kv: bool, dev_name: str, device: object, host_name: str, host: object, host_layout: object,
        layer_id: object, device_locs: torch.Tensor, host_locs: torch.Tensor, placement: object,
    ) -> CheckedCopy:
        """The checks every copy makes before it reads an index, on any
        backend: the placement, the pool's geometry and what the kernel needs
        of it; a backup (``layer_id`` None) takes every layer of ``device``, a
        load one layer ``device`` and a host ``layer_id`` in range."""
        placement = _checks.check_placement(placement)
        if layer_id is None:
            pool = _checks.check_backup_pool(kv, dev_name, device, host_name, host, host_layout, placement)
            _checks.check_launchable(pool, [f"{dev_name}[{i}]" for i in range(len(pool.device_layers))], host_name)
        else:
            pool = _checks.check_load_pool(kv, dev_name, device, host, host_layout, placement)
            _checks.check_launchable(pool, [dev_name], host_name)
            _checks.check_layer_id("layer_id", layer_id, pool.host.num_layers)
        return cls(placement, pool, layer_id, device_locs, host_locs)

    @property
    def to_host(self) -> bool:
        return self.layer_id is None

    @property
    def counter(self) -> str:
        """The :class:`~._stats.CopyStats` field this copy adds to."""
        return f"{'kv' if self.pool.kv else 'indexer'}_{'backup' if self.to_host else 'load'}_calls"


class CopyFunctions:
    """The four copies of one backend. ``**tuning`` is handed to the backend's
    run function untouched: the Triton launchers take ``num_ctas`` and
    ``block_bytes`` there; the other backends take none (``TypeError``).

    ``device_locs``: LOGICAL token locations of whole pages; ``host_locs``:
    host slots of the tokens of ``device_locs`` this rank owns, in order.
    Pages other ranks own are skipped."""

    def __init__(self, run: Callable[..., None]) -> None:
        self._run = run

    def backup_kv_all_layers(
        self, device_kv: Sequence[torch.Tensor], host_kv: torch.Tensor, host_layout: str,
        device_locs: torch.Tensor, host_locs: torch.Tensor, placement: CpPlacement, **tuning: int | None,
    ) -> None:
        """D2H: every layer's owned KV rows -> host slots. ``device_kv``: the
        per-layer ``(slots, 1, dim)`` device buffers; ``host_kv``: SGLang's host
        KV buffer in ``host_layout``."""
        self._run(CheckedCopy.checked(True, "device_kv", device_kv, "host_kv", host_kv, host_layout, None,
                                      device_locs, host_locs, placement), **tuning)

    def load_kv_one_layer(
        self, device_kv_layer: torch.Tensor, host_kv: torch.Tensor, host_layout: str, layer_id: int,
        device_locs: torch.Tensor, host_locs: torch.Tensor, placement: CpPlacement, **tuning: int | None,
    ) -> None:
        """H2D: host layer ``layer_id``'s slots -> the owned physical KV rows
        of ``device_kv_layer``."""
        self._run(CheckedCopy.checked(True, "device_kv_layer", device_kv_layer, "host_kv", host_kv, host_layout,
                                      layer_id, device_locs, host_locs, placement), **tuning)

    def backup_indexer_all_layers(
        self, device_index: Sequence[torch.Tensor], host_index: torch.Tensor, host_layout: str,
        device_locs: torch.Tensor, host_locs: torch.Tensor, placement: CpPlacement, **tuning: int | None,
    ) -> None:
        """D2H: every layer's owned indexer pages -> host pages (page granular).
        ``device_index``: the per-layer ``(pages, page_bytes)`` uint8 device
        buffers; ``host_index``: SGLang's host indexer buffer in ``host_layout``."""
        self._run(CheckedCopy.checked(False, "device_index", device_index, "host_index", host_index, host_layout,
                                      None, device_locs, host_locs, placement), **tuning)

    def load_indexer_one_layer(
        self, device_index_layer: torch.Tensor, host_index: torch.Tensor, host_layout: str, layer_id: int,
        device_locs: torch.Tensor, host_locs: torch.Tensor, placement: CpPlacement, **tuning: int | None,
    ) -> None:
        """H2D: host layer ``layer_id``'s indexer pages -> the owned physical
        pages of ``device_index_layer``."""
        self._run(CheckedCopy.checked(False, "device_index_layer", device_index_layer, "host_index", host_index,
                                      host_layout, layer_id, device_locs, host_locs, placement), **tuning)
