"""Device frees on the sharded stack without reading device locs on the host.

SGLang 0.5.23's ``PageInterleavePoolAllocator.free`` splits freed locs by
owner class with ``torch.unique(free_index // page_size)`` and one boolean
mask per class: on a GPU each is a device-to-host sync. On a prefill node
three kinds of frees reach it through ``free_segment``:

* a tree node's device eviction (``FullComponent.evict_component`` queues
  the node's value; the cache's drain frees it);
* the tree's duplicate frees during an insert (where the inserted key is
  already cached, the request's own pages for it go back): slices of the
  insert's value;
* the scheduler's frees of a request's own pages (``release_kv_cache`` ->
  ``free_kv_row`` -> ``free_segments``): slices of the request's
  ``req_to_token`` row.

Each is part of one owner-cyclic run of pages whose first class is known on
the host: the node's rotation phase; the chain's rotation base plus the
slice's page offset in the insert's value or in the request's row. That
offset is tensor metadata (the slice's storage offset), never its values.
:func:`~sglang_cp_hicache.policy_0523.device_free.cyclic_pages_by_class`
then splits the run with fixed-shape device work.

:class:`PhaseKnownDeviceFrees` wires that in on the library stack's instances:

* ``FullComponent.evict_component``: after upstream's method queued a node's
  device value for freeing, remember that tensor object with the node's phase;
* :meth:`PhaseKnownDeviceFrees.run` (used by :mod:`.request_free` around an
  insert and a request's row frees): slices of that run freed meanwhile are
  phase-known;
* ``PageInterleavePoolAllocator.free_segment``: a phase-known free goes into
  the class lists as upstream's ``free`` leaves them (``need_sort``:
  prepended to the release list, else to the free list); inside a free group
  it is split at once and held; anything else goes to upstream's;
* ``PageInterleavePoolAllocator.free_group_end``: the held splits, each
  class's pages ascending, prepended as upstream's one ``free`` of the
  group's locs would; when upstream's own deferrals are in the group too,
  everything goes through that one ``free`` (its read, as upstream);
* ``PageInterleavePoolAllocator.free``: upstream's, counted (every non-empty
  call outside a free group reads its locs on the host).

With ``SGLANG_CP_HICACHE_DEBUG=1`` each phase-known free is checked against
upstream's split (a host read, debugging only).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.components.base import EvictLayer

from sglang_cp_hicache import settings
from sglang_cp_hicache.placement import CpPlacement, page_owner, phase_owner
from sglang_cp_hicache.policy_0523.device_free import cyclic_pages_by_class

__all__ = ["CyclicRun", "DeviceFreeCounters", "PhaseKnownDeviceFrees", "free_cyclic_run"]

_FULL = ComponentType.FULL
#: What a phase-known free was, as counted.
KINDS = ("evicted", "duplicate", "request")


@dataclass
class DeviceFreeCounters:
    """Device frees on this rank's allocator, by how their pages were found."""

    from_phase: int = 0  # evicted nodes freed from their rotation phase: nothing read
    duplicates_from_phase: int = 0  # an insert's duplicates freed from the chain's rotation
    request_from_phase: int = 0  # a request's own pages freed from its rotation
    held_in_group: int = 0  # of the three, split at once and freed at free_group_end
    read_back: int = 0  # upstream's free: locs read on the host (a sync on a GPU)
    # Reads upstream would have made here: a phase-known free outside a free
    # group (upstream's free reads it), a free group closed with phase-known
    # frees alone (upstream's group end reads them once).
    reads_avoided: int = 0


@dataclass(frozen=True, eq=False)  # holds a tensor: compared by identity
class CyclicRun:
    """A 1-D tensor of locs whose position 0 starts a page of class
    ``start_class`` and whose pages are drawn owner-cyclically from there."""

    locs: torch.Tensor
    start_class: int
    kind: str

    def class_of(self, part: torch.Tensor, page_size: int, cp_size: int) -> Optional[int]:
        """The class of ``part``'s first page when ``part`` is a contiguous
        slice of this run from a page start, else None. Reads only tensor
        metadata (storage, offset, stride), never values."""
        run = self.locs
        if part.dim() != 1 or run.dim() != 1 or part.dtype != run.dtype or part.device != run.device:
            return None
        if (part.numel() > 1 and part.stride(0) != 1) or (run.numel() > 1 and run.stride(0) != 1):
            return None
        if part.untyped_storage().data_ptr() != run.untyped_storage().data_ptr():
            return None
        offset = part.storage_offset() - run.storage_offset()
        if offset < 0 or offset % page_size or offset + part.numel() > run.numel():
            return None
        return phase_owner(self.start_class, cp_size, offset // page_size)


def free_cyclic_run(allocator: Any, locs: torch.Tensor, start_class: int) -> None:
    """Free ``locs`` (one owner-cyclic run of pages from a page start of class
    ``start_class``, the last page possibly partial) into ``allocator``'s
    class lists as upstream's ``free`` would, without reading ``locs`` on the
    host. The caller vouches for the run."""
    _prepend(allocator, _split(allocator, locs, start_class))


def _split(allocator: Any, locs: torch.Tensor, start_class: int) -> list[torch.Tensor]:
    per_class = cyclic_pages_by_class(
        locs, page_size=allocator.page_size, cp_size=allocator.shard_size, start_class=start_class,
    )
    if settings.enabled(settings.DEBUG):
        _check_split(allocator, locs, per_class)
    return per_class


def _prepend(allocator: Any, per_class: list[torch.Tensor]) -> None:
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
        expected = pages[page_owner(pages, allocator.shard_size) == owner]
        if not torch.equal(freed, expected):
            raise AssertionError(
                f"owner class {owner}: pages {freed.tolist()} from the rotation phase, "
                f"{expected.tolist()} in the locs: the run's rotation phase is stale"
            )


@dataclass(frozen=True, eq=False)
class _Queued:
    locs: torch.Tensor
    start_class: int


class PhaseKnownDeviceFrees:
    """Device frees of evicted nodes, insert duplicates and request pages
    from their rotation phase (see the module doc)."""

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
        self._upstream_group_end: Callable[..., Any] = allocator.free_group_end
        # id(locs) -> the queued locs (held, so the id is not reused) and phase.
        self._queued: dict[int, _Queued] = {}
        self._runs: list[CyclicRun] = []  # open runs, innermost last
        # Splits held in the open free group, and that group's list (a clear
        # drops the group: then these are dropped with it).
        self._held: list[list[torch.Tensor]] = []
        self._held_group: Optional[list] = None

    def install(self) -> None:
        """Replace the four methods on their instances."""
        self._full.evict_component = self.evict_component
        self.allocator.free_segment = self.free_segment
        self.allocator.free = self.free
        self.allocator.free_group_end = self.free_group_end

    @contextlib.contextmanager
    def run(self, locs: torch.Tensor, start_class: int, kind: str) -> Iterator[None]:
        """While open, a free of a slice of ``locs`` (one owner-cyclic run
        from a page of ``start_class`` at position 0) is phase-known."""
        if kind not in KINDS[1:]:
            raise ValueError(f"kind must be one of {KINDS[1:]}, got {kind!r}")
        if not 0 <= start_class < self.allocator.shard_size:
            raise ValueError(f"start_class must be in [0, {self.allocator.shard_size}), got {start_class}")
        self._runs.append(CyclicRun(locs, start_class, kind))
        try:
            yield
        finally:
            self._runs.pop()

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
            self._queued[id(value)] = _Queued(value, phase_owner(phase, self.allocator.shard_size))
        return out

    def _known_class(self, free_index: torch.Tensor, start_pos: int) -> tuple[Optional[int], str]:
        queued = self._queued.pop(id(free_index), None)
        if queued is not None and queued.locs is free_index and start_pos == 0:
            return queued.start_class, "evicted"
        for run in reversed(self._runs):
            start = run.class_of(free_index, self.allocator.page_size, self.allocator.shard_size)
            if start is not None:
                return start, run.kind
        return None, ""

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        start, kind = self._known_class(free_index, start_pos)
        if start is None or free_index.numel() == 0:
            return self._upstream_free_segment(free_index, start_pos=start_pos)
        if self.allocator.free_group is None:
            free_cyclic_run(self.allocator, free_index, start)
            self.counters.reads_avoided += 1
        else:
            # Split now: the caller may overwrite a row view before the group
            # ends (upstream's free clones it for the same reason).
            if self._held_group is not self.allocator.free_group:
                self._held, self._held_group = [], self.allocator.free_group
            self._held.append(_split(self.allocator, free_index, start))
            self.counters.held_in_group += 1
        if kind == "evicted":
            self.counters.from_phase += 1
        elif kind == "duplicate":
            self.counters.duplicates_from_phase += 1
        else:
            self.counters.request_from_phase += 1
        return None

    def free_group_end(self) -> None:
        alloc = self.allocator
        held = self._held if self._held_group is alloc.free_group and alloc.free_group is not None else []
        self._held, self._held_group = [], None
        if held and alloc.free_group:
            # Upstream deferred frees of its own in this group: one free of
            # everything, exactly as upstream's (it reads them).
            alloc.free_group.extend(part * alloc.page_size for split in held for part in split if part.numel())
            return self._upstream_group_end()
        self._upstream_group_end()  # closes the group (nothing of upstream's to free)
        if held:
            self.counters.reads_avoided += 1  # upstream's group end would have read the held locs once
            # Upstream's one free of the group's locs: each class's pages
            # ascending, prepended once. The group's pages are distinct.
            merged = []
            for owner in range(alloc.shard_size):
                parts = [split[owner] for split in held if split[owner].numel()]
                merged.append(torch.sort(torch.cat(parts)).values if parts else held[0][owner])
            _prepend(alloc, merged)
        return None

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() and self.allocator.free_group is None:
            self.counters.read_back += 1
        return self._upstream_free(free_index)
