"""Device eviction on the sharded stack without reading device locs on the host.

SGLang 0.5.23's ``PageInterleavePoolAllocator.free`` splits freed locs by
owner class with ``torch.unique(free_index // page_size)`` and one boolean
mask per class: on a GPU each is a device-to-host sync, and every device
eviction of a tree node reaches it (``FullComponent.apply_component_action``
-> ``free_segment`` -> ``free``).

A tree node's device locs are one owner-cyclic run of whole pages starting
at the node's rotation phase (the allocator draws them so, a load-back
allocates them from the host pages' classes, and inserts that would break
the rotation are declined). So the pages per class follow from host ints,
and :func:`~sglang_cp_hicache.policy_0523.device_free.cyclic_pages_by_class`
splits the run with fixed-shape device work. :class:`PhaseKnownDeviceFrees`
wires that in on the library stack's instances:

* ``FullComponent.evict_component`` (on the cache's FULL component): after
  upstream's method queued a node's device value for freeing, remember that
  tensor object with the node's rotation phase;
* ``PageInterleavePoolAllocator.free_segment`` (on the allocator): a
  remembered tensor is freed from its phase -- the same class lists, in the
  same order, as upstream's ``free`` leaves (``need_sort``: prepended to the
  release list, else to the free list); anything else, or a free while a
  free group is open, goes to upstream's ``free_segment``;
* ``PageInterleavePoolAllocator.free`` (on the allocator): upstream's, counted
  (every non-empty call outside a free group reads its locs on the host).

With ``SGLANG_CP_HICACHE_DEBUG=1`` each phase-known free is checked against
upstream's split (a host read, debugging only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.components.base import EvictLayer

from sglang_cp_hicache import settings
from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.policy_0523.device_free import cyclic_pages_by_class

__all__ = ["DeviceFreeCounters", "PhaseKnownDeviceFrees", "free_cyclic_run"]

_FULL = ComponentType.FULL


@dataclass
class DeviceFreeCounters:
    """Device frees on this rank's allocator, by how their pages were found."""

    from_phase: int = 0  # node locs freed from the rotation phase: nothing read
    read_back: int = 0  # upstream's free: locs read on the host (a sync on a GPU)


@dataclass(frozen=True, eq=False)  # holds a tensor: compared by identity
class _Queued:
    locs: torch.Tensor
    start_class: int


def free_cyclic_run(allocator: Any, locs: torch.Tensor, start_class: int) -> None:
    """Free ``locs`` (one owner-cyclic run of whole pages from ``start_class``)
    into ``allocator``'s class lists as upstream's ``free`` would, without
    reading ``locs`` on the host. The caller vouches for the run."""
    per_class = cyclic_pages_by_class(
        locs, page_size=allocator.page_size, cp_size=allocator.shard_size, start_class=start_class,
    )
    if settings.enabled(settings.DEBUG):
        _check_split(allocator, locs, per_class)
    for owner, freed in enumerate(per_class):
        if freed.numel() == 0:  # a shape: known on the host
            continue
        if allocator.need_sort:
            allocator.class_release_pages[owner] = torch.cat((freed, allocator.class_release_pages[owner]))
        else:
            allocator.class_free_pages[owner] = torch.cat((freed, allocator.class_free_pages[owner]))
    if allocator.debug_mode:
        allocator.debug_check_classes()


def _check_split(allocator: Any, locs: torch.Tensor, per_class: list[torch.Tensor]) -> None:
    pages = torch.unique(locs.long() // allocator.page_size)
    for owner, freed in enumerate(per_class):
        expected = pages[pages % allocator.shard_size == owner]
        if not torch.equal(freed, expected):
            raise AssertionError(
                f"owner class {owner}: pages {freed.tolist()} from the rotation phase, "
                f"{expected.tolist()} in the locs: the node's rotation phase is stale"
            )


class PhaseKnownDeviceFrees:
    """Device frees of evicted tree nodes from their rotation phase."""

    def __init__(self, cache: Any, allocator: Any, placement: CpPlacement) -> None:
        if not isinstance(placement, CpPlacement):
            raise TypeError(f"placement must be a CpPlacement, got {type(placement).__name__}")
        if (allocator.page_size, allocator.shard_size) != (placement.page_size, placement.cp_size):
            raise ValueError(
                f"allocator pages ({allocator.page_size}, shard_size {allocator.shard_size}) differ from the "
                f"placement ({placement.page_size}, cp_size {placement.cp_size})"
            )
        self.cache = cache
        self.allocator = allocator
        self.counters = DeviceFreeCounters()
        self._full = cache.components[_FULL]
        self._upstream_evict: Callable[..., Any] = self._full.evict_component
        self._upstream_free_segment: Callable[..., Any] = allocator.free_segment
        self._upstream_free: Callable[..., Any] = allocator.free
        # id(locs) -> the queued locs (held, so the id is not reused) and phase.
        self._queued: dict[int, _Queued] = {}

    def install(self) -> None:
        """Replace the three methods on their instances."""
        self._full.evict_component = self.evict_component
        self.allocator.free_segment = self.free_segment
        self.allocator.free = self.free

    def evict_component(
        self,
        node: Any,
        device_frees: dict,
        host_frees: dict,
        cache_actions: list,
        target: EvictLayer = EvictLayer.DEVICE,
    ) -> tuple[int, int]:
        value = node.component(_FULL).value
        phase = None
        if value is not None and EvictLayer.DEVICE in target and node.rotation_base is not None:
            phase = self.cache.tree_core.rotation_phase_of(node.id)
        out = self._upstream_evict(node, device_frees, host_frees, cache_actions, target=target)
        queued = device_frees.get(_FULL) or []
        if phase is not None and queued and queued[-1] is value and value.numel() % self.allocator.page_size == 0:
            self._queued[id(value)] = _Queued(value, phase % self.allocator.shard_size)
        return out

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        queued = self._queued.pop(id(free_index), None)
        if (
            queued is None
            or queued.locs is not free_index
            or start_pos != 0
            or self.allocator.free_group is not None
            or free_index.numel() == 0
        ):
            return self._upstream_free_segment(free_index, start_pos=start_pos)
        free_cyclic_run(self.allocator, free_index, queued.start_class)
        self.counters.from_phase += 1
        return None

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() and self.allocator.free_group is None:
            self.counters.read_back += 1
        return self._upstream_free(free_index)
