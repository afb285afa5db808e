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

from sglang_cp_hicache.policy_0518.node_state import CpNode, clear_host_state, is_backed_up
from sglang_cp_hicache.validation import check_int, check_int_list

__all__ = [
    "HostEvictionResult", "HostLeafIndex", "HostSlotLedger", "evict_host_slots", "is_host_leaf",
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
    """Every rank's host slot capacity and usage, kept identically on every rank.

    ``used`` defaults to all zeros. Every count list must have exactly one
    non-negative int per rank: a shorter list would make ``zip`` drop ranks
    and the ledgers of different ranks drift apart.
    """

    capacity: list[int]
    used: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        capacity = check_int_list("capacity", self.capacity, minimum=0)
        if not capacity:
            raise ValueError("capacity must list at least one rank")
        if isinstance(self.used, Sequence) and len(self.used) == 0:
            used = [0] * len(capacity)
        else:
            used = check_int_list("used", self.used, length=len(capacity), minimum=0)
        over = [r for r, (u, c) in enumerate(zip(used, capacity)) if u > c]
        if over:
            raise ValueError(f"used {used} exceeds capacity {capacity} on rank(s) {over}")
        self.capacity, self.used = capacity, used

    @property
    def cp_size(self) -> int:
        return len(self.capacity)

    def _counts(self, name: str, counts: object) -> list[int]:
        return check_int_list(name, counts, length=self.cp_size, minimum=0)

    def free_slots(self) -> list[int]:
        return [c - u for c, u in zip(self.capacity, self.used)]

    def shortfall(self, need: Sequence[int]) -> list[int]:
        """Per-rank slots still missing to place ``need``."""
        need = self._counts("need", need)
        return [max(0, n - f) for n, f in zip(need, self.free_slots())]

    def fits(self, need: Sequence[int]) -> bool:
        return not any(self.shortfall(need))

    def charge(self, counts: Sequence[int]) -> None:
        counts = self._counts("counts", counts)
        if not self.fits(counts):
            raise ValueError(f"charge: counts {counts} exceeds the free slots {self.free_slots()}")
        self.used = [u + c for u, c in zip(self.used, counts)]

    def release(self, counts: Sequence[int]) -> None:
        counts = self._counts("counts", counts)
        new = [u - c for u, c in zip(self.used, counts)]
        if any(u < 0 for u in new):
            raise ValueError(f"release: counts {counts} exceeds the used slots {self.used}")
        self.used = new


def _slot_counts(
    node: CpNode, cp_size: Optional[int], cp_rank: int, ledger: Optional[HostSlotLedger]
) -> Optional[list[int]]:
    """Host slots every rank frees with ``node`` (None when not needed),
    checked against this rank's own slots and the ledger before anything is
    freed: a mismatch would make the ranks' ledgers drift apart."""
    if cp_size is None:
        return None
    meta = node.cp_hicache
    counts = meta.owner_slot_counts(cp_size)
    if counts[cp_rank] != meta.num_host_slots:
        raise RuntimeError(
            f"host eviction: node {node.id} holds {meta.num_host_slots} host slots on "
            f"cp_rank {cp_rank} but its token_owners give that rank {counts[cp_rank]}"
        )
    if ledger is not None and any(c > u for c, u in zip(counts, ledger.used)):
        raise RuntimeError(
            f"host eviction: node {node.id} frees {counts} slots but the ledger holds {ledger.used}"
        )
    return counts


@dataclass(frozen=True)
class HostEvictionResult:
    physical_slots_freed: int  # this rank
    logical_tokens_freed: int
    nodes_evicted: int
    slots_freed_per_rank: tuple[int, ...] = ()


@dataclass
class _EvictionTally:
    """What one :func:`evict_host_slots` call has freed so far."""

    freed: list[int]  # the stop rule's counts: one per rank, or this rank's alone
    local_slots: int = 0
    logical_tokens: int = 0
    nodes: int = 0


def _eviction_targets(
    required: int | Sequence[int], ledger: Optional[HostSlotLedger], cp_rank: int
) -> tuple[bool, list[int], Optional[int]]:
    """(per-rank stop rule?, the counts to free, cp_size when every rank's
    share of a node is needed); checks the arguments before anything is evicted."""
    per_rank = not isinstance(required, int) or isinstance(required, bool)
    if per_rank:
        need = check_int_list("required", required, minimum=0)
        if not need:
            raise ValueError("required must list at least one rank")
    else:
        need = [check_int("required", required, 0)]
    if ledger is not None and not isinstance(ledger, HostSlotLedger):
        raise TypeError(f"ledger must be a HostSlotLedger, got {type(ledger).__name__}")
    if per_rank and ledger is not None and ledger.cp_size != len(need):
        raise ValueError(f"required lists {len(need)} ranks but the ledger has {ledger.cp_size}")
    # Per-rank counts need every rank's share of each node: one per rank.
    cp_size = len(need) if per_rank else (ledger.cp_size if ledger is not None else None)
    check_int("cp_rank", cp_rank, 0, None if cp_size is None else cp_size - 1)
    return per_rank, need, cp_size


def _remove_leaf(
    node: CpNode,
    index: HostLeafIndex,
    child_key: Callable[[Any], Any],
    on_remove: Optional[Callable[[CpNode], None]],
) -> None:
    """Take an evicted leaf out of its parent; the parent may become a host leaf."""
    parent = node.parent
    removed = parent.children.pop(child_key(node.key), None)
    if removed is not node:
        raise RuntimeError(f"host eviction: node {node.id} is not its parent's child")
    if on_remove is not None:
        on_remove(node)
    index.refresh(parent)


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
    per_rank, need, cp_size = _eviction_targets(required, ledger, cp_rank)
    tally = _EvictionTally(freed=[0] * len(need))
    skipped: list[CpNode] = []
    try:
        while not all(f >= r for f, r in zip(tally.freed, need)):
            node = index.pop()
            if node is None:
                break
            if not is_host_leaf(node):
                continue
            if is_protected(node):
                skipped.append(node)
                continue
            try:
                counts = _slot_counts(node, cp_size, cp_rank, ledger)
            except (ValueError, RuntimeError):
                index.add(node)  # untouched: it stays evictable
                raise
            cleared = clear_host_state(node, free_host)
            if ledger is not None:
                ledger.release(counts)
            if per_rank:
                tally.freed = [f + c for f, c in zip(tally.freed, counts)]
            else:
                tally.freed[0] += cleared.physical_slots
            tally.local_slots += cleared.physical_slots
            tally.logical_tokens += cleared.logical_tokens
            tally.nodes += 1
            _remove_leaf(node, index, child_key, on_remove)
    finally:
        for node in skipped:
            index.add(node)
    return HostEvictionResult(
        physical_slots_freed=tally.local_slots,
        logical_tokens_freed=tally.logical_tokens,
        nodes_evicted=tally.nodes,
        slots_freed_per_rank=tuple(tally.freed) if per_rank else (),
    )
