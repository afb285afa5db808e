"""Host-tier eviction under CP, counted in physical host slots.

Every rank must evict the *same* nodes, or the radix trees diverge. Ranks
free different numbers of physical slots per node (a rank owning nothing in a
node frees none), so the stop rule is evaluated for every rank at once from
each node's ``token_owners`` (identical everywhere), with a
:class:`HostSlotLedger` that mirrors every rank's host usage.

The evictable set is kept ordered incrementally (:class:`HostLeafIndex`): a
lazy heap keyed by (priority, insertion sequence), so evicting k of L leaves
costs O(k log L), never a rebuild of the whole heap.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from sglang_cp_hicache.node_state import CpNode, clear_host_state, is_backed_up

__all__ = [
    "HostEvictionResult",
    "HostLeafIndex",
    "HostSlotLedger",
    "evict_host_slots",
    "is_host_leaf",
]


def is_host_leaf(node: CpNode) -> bool:
    """Evicted from device, backed up on host, no children, not the root."""
    return (
        node.parent is not None
        and node.evicted
        and is_backed_up(node)
        and len(node.children) == 0
    )


class HostLeafIndex:
    """Ordered set of host leaves with O(log L) insert/discard/pop.

    ``priority`` may change while a node sits in the index (LRU access); a
    popped entry whose stored priority is stale is re-pushed with the fresh
    one, so order stays exact as long as priorities only grow.
    """

    def __init__(self, priority: Callable[[CpNode], Any]) -> None:
        self._priority = priority
        self._heap: list[tuple[Any, int, CpNode]] = []
        self._member_seq: dict[int, int] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._member_seq)

    def __contains__(self, node: CpNode) -> bool:
        return id(node) in self._member_seq

    def __iter__(self) -> Iterator[CpNode]:
        live = {seq for seq in self._member_seq.values()}
        return (n for _, s, n in self._heap if s in live)

    def add(self, node: CpNode) -> None:
        if id(node) in self._member_seq:
            return
        seq = next(self._seq)
        self._member_seq[id(node)] = seq
        heapq.heappush(self._heap, (self._priority(node), seq, node))

    def discard(self, node: CpNode) -> None:
        self._member_seq.pop(id(node), None)
        # Stale heap entries are skipped on pop; compact when they dominate.
        if len(self._heap) > 64 and len(self._heap) > 4 * len(self._member_seq):
            self._compact()

    def refresh(self, node: CpNode) -> None:
        """Add or drop ``node`` according to :func:`is_host_leaf`."""
        if is_host_leaf(node):
            self.add(node)
        else:
            self.discard(node)

    def pop(self) -> Optional[CpNode]:
        """Remove and return the lowest-priority member, or None."""
        while self._heap:
            prio, seq, node = heapq.heappop(self._heap)
            if self._member_seq.get(id(node)) != seq:
                continue
            current = self._priority(node)
            if current != prio:
                new_seq = next(self._seq)
                self._member_seq[id(node)] = new_seq
                heapq.heappush(self._heap, (current, new_seq, node))
                continue
            del self._member_seq[id(node)]
            return node
        return None

    def _compact(self) -> None:
        live = set(self._member_seq.values())
        self._heap = [e for e in self._heap if e[1] in live]
        heapq.heapify(self._heap)


@dataclass
class HostSlotLedger:
    """Every rank's host slot capacity and usage, kept identically on every rank."""

    capacity: list[int]
    used: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.capacity:
            raise ValueError("capacity must list at least one rank")
        if any(c < 0 for c in self.capacity):
            raise ValueError(f"capacity must be non-negative, got {self.capacity}")
        if not self.used:
            self.used = [0] * len(self.capacity)
        if len(self.used) != len(self.capacity):
            raise ValueError("used and capacity must have the same length")

    @property
    def cp_size(self) -> int:
        return len(self.capacity)

    def free_slots(self) -> list[int]:
        return [c - u for c, u in zip(self.capacity, self.used)]

    def shortfall(self, need: Sequence[int]) -> list[int]:
        """Per-rank slots still missing to place ``need``."""
        return [max(0, n - f) for n, f in zip(need, self.free_slots())]

    def fits(self, need: Sequence[int]) -> bool:
        return not any(self.shortfall(need))

    def charge(self, counts: Sequence[int]) -> None:
        if not self.fits(counts):
            raise ValueError(f"charge {list(counts)} exceeds free slots {self.free_slots()}")
        self.used = [u + c for u, c in zip(self.used, counts)]

    def release(self, counts: Sequence[int]) -> None:
        new = [u - c for u, c in zip(self.used, counts)]
        if any(u < 0 for u in new):
            raise ValueError(f"release {list(counts)} exceeds used slots {self.used}")
        self.used = new


@dataclass(frozen=True)
class HostEvictionResult:
    physical_slots_freed: int  # this rank
    logical_tokens_freed: int
    nodes_evicted: int
    slots_freed_per_rank: tuple[int, ...] = ()


def evict_host_slots(
    index: HostLeafIndex,
    required: int | Sequence[int],
    *,
    cp_rank: int,
    child_key: Callable[[Any], Any],
    free_host: Callable[[torch.Tensor], Any],
    ledger: Optional[HostSlotLedger] = None,
    is_protected: Callable[[CpNode], bool] = lambda n: n.lock_ref > 0 or n.host_ref_counter > 0,
    on_remove: Optional[Callable[[CpNode], None]] = None,
) -> HostEvictionResult:
    """Evict host leaves, lowest priority first, until enough physical slots are free.

    ``required`` is either this rank's slot count, or one count per rank: then
    eviction goes on until *every* rank has freed its count, which makes all
    ranks evict the same nodes (needs ``token_owners`` in the metadata).
    Locked or protected nodes are skipped and stay in the index. A parent
    that becomes a childless, evicted, backed-up node joins the index and can
    be evicted in the same call.
    """
    per_rank = not isinstance(required, int)
    need = list(required) if per_rank else [int(required)]
    if any(r < 0 for r in need):
        raise ValueError(f"required must be non-negative, got {required}")
    if per_rank and not 0 <= cp_rank < len(need):
        raise ValueError(f"cp_rank {cp_rank} outside required's {len(need)} ranks")
    freed = [0] * len(need)
    local_freed = logical_freed = evicted = 0
    skipped: list[CpNode] = []

    def satisfied() -> bool:
        return all(f >= r for f, r in zip(freed, need))

    while not satisfied():
        node = index.pop()
        if node is None:
            break
        if not is_host_leaf(node):
            continue
        if is_protected(node):
            skipped.append(node)
            continue
        meta = node.cp_hicache
        counts = meta.owner_slot_counts(len(need)) if (per_rank or ledger) else None
        cleared = clear_host_state(node, free_host)
        if ledger is not None and counts is not None:
            ledger.release(counts)
        if per_rank:
            freed = [f + c for f, c in zip(freed, counts)]
        else:
            freed[0] += cleared.physical_slots
        local_freed += cleared.physical_slots
        logical_freed += cleared.logical_tokens
        evicted += 1
        parent = node.parent
        removed = parent.children.pop(child_key(node.key), None)
        if removed is not node:
            raise RuntimeError(f"host eviction: node {node.id} is not its parent's child")
        if on_remove is not None:
            on_remove(node)
        index.refresh(parent)
    for node in skipped:
        index.add(node)
    return HostEvictionResult(
        physical_slots_freed=local_freed,
        logical_tokens_freed=logical_freed,
        nodes_evicted=evicted,
        slots_freed_per_rank=tuple(freed) if per_rank else (),
    )
