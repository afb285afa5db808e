"""``HybridCacheController`` that hands the library's kernels logical locs.

Upstream (0.5.23) prepares every sharded transfer in
``HybridCacheController._move_kv_shard_indices``: ``PageInterleaveHostPool.
owned_rows`` builds the host owner mask, ``nonzero``s it on the host and
gathers the matching device locs on the device, then translates both sides to
rank-local rows for the stock kernels. :class:`LibraryCopyController` keeps
the host half (host slots are CPU tensors, owner-matched with their device
pages by construction) and drops the device half: the device locs stay
logical and whole, and the kernel masks and translates them itself.

Everything else -- queues, acks, consensus, the tree-facing API -- is
upstream's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional

import torch
from sglang.srt.managers.cache_controller import CacheOperation
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.sglang_0523.copy_engine import LibraryL2TransferEngine

if TYPE_CHECKING:  # stack.py imports this module's class at call time
    from sglang_cp_hicache.sglang_0523.stack import CpStack0523

__all__ = ["LibraryCopyController", "library_stack"]


class LibraryCopyController(HybridCacheController):
    """Sharded DSA HiCache controller whose copies are this library's kernels."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self.is_kv_sharded:
            raise ValueError(
                "LibraryCopyController needs a KV-sharded host pool group "
                "(anchor PageInterleaveHostPool); build it only for PageInterleave pools"
            )
        anchor = self.mem_pool_host.anchor_entry.host_pool
        self.placement = CpPlacement(anchor.page_size, anchor.shard_size, anchor.shard_rank)
        self.l2_transfer_engine = LibraryL2TransferEngine(self.io_backend, self.placement)
        # Bumped on every preparation, so start-up can prove this override is
        # what upstream's write and load paths reach.
        self.prepared_operations = 0
        # What the library added to this stack (host room, device frees,
        # warm-up, L3), handed over by the strategy at the end of its build:
        # the controller exists before them, and they need the built cache.
        self.cp_stack: Optional[CpStack0523] = None
        # Host-to-device loads queued (load-backs) and their logical tokens,
        # for the live metrics (plain ints on the scheduler thread).
        self.load_backs = 0
        self.load_back_tokens = 0

    def load(
        self,
        host_indices: torch.Tensor,
        priority: Optional[int] = None,
        node_id: int = -1,
        extra_pools: Optional[list] = None,
        *,
        device_indices: Optional[torch.Tensor] = None,
        anchor_indices: Optional[torch.Tensor] = None,
    ) -> Optional[torch.Tensor]:
        """Upstream's ``load``, counted: a load-back is a load of host KV that
        got device rows (None: no device room, nothing queued)."""
        loaded = super().load(host_indices, priority, node_id, extra_pools,
                              device_indices=device_indices, anchor_indices=anchor_indices)
        if loaded is not None and host_indices.numel():
            self.load_backs += 1
            self.load_back_tokens += int(host_indices.numel())
        return loaded

    def _owned_host_rows(self, host_indices: torch.Tensor) -> torch.Tensor:
        """This rank's local host rows of ``host_indices`` (logical host slots,
        CPU), in order, on the controller's device."""
        anchor = self.mem_pool_host.anchor_entry.host_pool
        host = host_indices.cpu() if host_indices.device.type != "cpu" else host_indices
        mask = anchor.placement.local_mask(host, anchor.shard_rank)
        rows = anchor.placement.local_index(host[mask])
        if torch.device(self.device).type != "cpu":
            rows = rows.to(self.device, non_blocking=True)
        return rows

    def _move_kv_shard_indices(
        self, operation: CacheOperation, *, write_back_jit: bool
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[list[Any]]]:
        """(owned host rows, LOGICAL device locs, pool transfers likewise).

        ``write_back_jit`` is upstream's switch for its staged page_first
        kernel; the library's kernels write page_first hosts directly, so it
        changes nothing here.
        """
        self.prepared_operations += 1
        prepared: dict[int, torch.Tensor] = {}

        def host_rows(host: torch.Tensor) -> torch.Tensor:
            # The indexer transfer shares the anchor's host slots: narrow once.
            if id(host) not in prepared:
                prepared[id(host)] = self._owned_host_rows(host)
            return prepared[id(host)]

        host_indices = host_rows(operation.host_indices)
        device_indices = operation.device_indices
        resolved: Optional[list[Any]] = None
        if operation.pool_transfers:
            resolved = []
            for pool_transfer in operation.pool_transfers:
                if pool_transfer.host_indices is None or pool_transfer.device_indices is None:
                    raise ValueError(f"Unresolved L2 transfer for {pool_transfer.name}.")
                rows = host_rows(pool_transfer.host_indices)
                if rows.numel() == 0:
                    continue
                resolved.append(
                    replace(pool_transfer, host_indices=rows, device_indices=pool_transfer.device_indices)
                )
        # A rank that owns nothing still submits (an empty transfer list) and
        # publishes its ack, like upstream.
        return host_indices, device_indices, resolved


def library_stack(cache: Any) -> Optional[CpStack0523]:
    """The record of ``cache``'s stack when the library strategy built it,
    else None (upstream's stack, or no HiCache)."""
    controller = cache.cache_controller
    return controller.cp_stack if isinstance(controller, LibraryCopyController) else None
