"""Owner-aware host room for write-through backups on the sharded stack.

SGLang 0.5.23's ``UnifiedRadixCache._execute_kv_backup`` makes host room
with one ``evict_host(kv_tokens - available_size())``. Under KV sharding
``available_size()`` is ``N * P * min(free host pages per owner class)`` and
the backup's host slots are drawn owner-cyclically from the node's rotation
phase, so the backup needs free pages of specific classes. One eviction
sized in tokens frees least-recently-used host pages of whatever class; when
none is of the short class the backup fails although evictable pages of
that class remain, and the evicted pages are lost for nothing.

:class:`OwnerAwareHostRoom` replaces ``_execute_kv_backup`` on the library
stack's cache instance. It evicts host leaves in upstream's order (the FULL
component's eviction priority, a heap that takes in a parent when it becomes
a host leaf), but only those holding a page of a class the cyclic run is
still short of (:class:`~sglang_cp_hicache.policy_0523.host_room.HostRoom`),
until the run fits; a second pass also evicts a leaf that is the way to a
clearable host-only ancestor holding such a page
(:func:`~sglang_cp_hicache.policy_0523.host_room.reach_counts`: a tree holds
no child without its parent). When a leaf's own pages would make the run
fit, only its shortest tail that does is evicted, provided the prefix left
holds a page of every owner class
(:func:`~sglang_cp_hicache.policy_0523.host_room.covering_tail`; ``tail_rule``
from ``SGLANG_CP_HICACHE_HOST_TAIL``): upstream's node split cuts it there,
the prefix keeps the leaf's recency and later passes take it first until
something touches it -- it holds every class, so it helps whichever class a
run is short of. Only a leaf the split carries over whole is cut (host-only,
unlocked, nothing in flight, FULL data alone, hashes matching its pages).
When even every page eviction could free would leave the run short, it
evicts nothing: the write fails either way, where upstream's eviction loses
those pages for nothing. Then it queues the write exactly as upstream does
(write-back stacks keep upstream's method: their host eviction first
reclaims host copies that duplicate device pages). The decisions read only
the host allocator's class counts, the tree and the host slots (CPU), the
same on every CP rank: no collective.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import DriveHostEvictionResult

from sglang_cp_hicache import settings
from sglang_cp_hicache.placement import CpPlacement, phase_owner
from sglang_cp_hicache.policy_0523.host_room import (
    HostRoom,
    class_counts_of,
    covering_tail,
    cyclic_class_counts,
    reach_counts,
    shortest_tail,
)

__all__ = ["HostRoomCounters", "OwnerAwareHostRoom"]

_FULL = ComponentType.FULL



@dataclass(frozen=True)
class _TailRule:
    """How many last pages of a helpful leaf to evict (``tail``; None: the
    whole leaf, always), and whether a kept prefix goes first in later passes."""

    tail: Optional[Callable[[HostRoom, list[int]], Optional[int]]]
    prefix_first: bool


#: ``SGLANG_CP_HICACHE_HOST_TAIL`` -> its rule.
_TAIL_RULES: dict[str, _TailRule] = {
    "covering": _TailRule(covering_tail, prefix_first=True),
    "shortest": _TailRule(shortest_tail, prefix_first=False),
    "whole": _TailRule(None, prefix_first=False),
}


@dataclass
class HostRoomCounters:
    """What the owner-aware host room did on this rank (the same on every rank)."""

    backups: int = 0  # backups that went through it
    backups_short: int = 0  # of which no cyclic run fitted even after evicting
    leaves_evicted: int = 0  # host leaves evicted to make room
    pages_evicted: int = 0  # logical host pages those leaves held
    leaves_skipped: int = 0  # host leaves passed over: no page of a short class (first pass)
    leaves_evicted_for_ancestors: int = 0  # of leaves_evicted: no short page of their own, on the way to one
    # Every _execute_kv_backup call (upstream's fallback included), for the live metrics:
    written: int = 0  # the write was queued (host slots allocated)
    refused: int = 0  # it returned None: no host room
    # Of ``backups``: the cyclic run did not fit on arrival and fitted after
    # owner-aware eviction (the backups upstream's token-sized evict_host puts
    # at risk), and those that could not fit at all, where nothing was evicted.
    room_made: int = 0
    unfittable: int = 0
    # Of room_made: upstream's evict_host could not have freed the tokens
    # its floor asks for (all evictable pages are fewer): lost for certain.
    room_made_lost_upstream: int = 0


class OwnerAwareHostRoom:
    """``_execute_kv_backup`` for one sharded ``UnifiedRadixCache``."""

    def __init__(self, cache: Any, placement: CpPlacement, tail_rule: Optional[str] = None) -> None:
        if not isinstance(placement, CpPlacement):
            raise TypeError(f"placement must be a CpPlacement, got {type(placement).__name__}")
        if tail_rule is None:
            tail_rule = settings.read(settings.HOST_TAIL)
        if tail_rule not in _TAIL_RULES:
            raise ValueError(f"tail_rule must be one of {tuple(_TAIL_RULES)}, got {tail_rule!r}")
        self.cache = cache
        self.placement = placement
        self.tail_rule = tail_rule
        self._rule = _TAIL_RULES[tail_rule]
        # Kept prefixes that go first: node id -> (node, its recency when
        # kept). One touched since (a match, an insert) is an ordinary node again.
        self._first: dict[Any, tuple[Any, Any]] = {}
        self.counters = HostRoomCounters()
        # Of counters.leaves_evicted: tails split off a leaf whose own pages
        # made the run fit, and the pages their prefixes kept on the host.
        self.tails_split = 0
        self.pages_kept = 0
        # Upstream's method, for a node without a rotation phase (no shard owner).
        self._upstream_backup: Callable[..., Any] = cache._execute_kv_backup

    def install(self) -> None:
        """Replace ``_execute_kv_backup`` on the cache instance."""
        self.cache._execute_kv_backup = self.execute_kv_backup

    # ---- state (read at each call: a cache reset rebuilds the host slots) -----
    def _host_slots(self) -> Any:
        return self.cache.cache_controller.mem_pool_host.anchor_entry.host_pool._slots

    def _host_owners(self, node: Any) -> list[int]:
        """The owner class of each of ``node``'s host pages, in key order."""
        host = node.component(_FULL).host_value
        return self.placement.owner_of(host[:: self.placement.page_size].to(torch.int64)).tolist()

    def _host_classes(self, node: Any) -> list[int]:
        return class_counts_of(self._host_owners(node), self.placement.cp_size)

    # ---- the replacement ---------------------------------------------------------
    def execute_kv_backup(self, node_id: Any, device_value: torch.Tensor, comp_xfers: Any, sidecar_xfers: Any) -> Any:
        """Upstream's ``_execute_kv_backup`` with owner-aware room making."""
        cache = self.cache
        start_owner = cache.tree_core.rotation_phase_of(node_id)
        page_size = self.placement.page_size
        # Write-back backs up on device eviction and first reclaims host
        # copies that duplicate device pages (upstream's host eviction does
        # that pass); that policy stays upstream's.
        if start_owner is None or len(device_value) % page_size or cache.is_write_back:
            return self._counted(self._upstream_backup(node_id, device_value, comp_xfers, sidecar_xfers))
        self.counters.backups += 1
        if not self.make_room(phase_owner(start_owner, self.placement.cp_size), len(device_value) // page_size):
            self.counters.backups_short += 1
        # From here on line for line upstream's (0.5.23): the write fails
        # (returns None) when no cyclic run fits.
        aux_xfers = [x for xfers in comp_xfers.values() for x in xfers]
        aux_xfers.extend(sidecar_xfers)
        return self._counted(cache.cache_controller.write(
            device_value, node_id=node_id, extra_pools=aux_xfers or None, flush=False, start_owner=start_owner,
        ))

    def _counted(self, host_indices: Any) -> Any:
        """``host_indices`` (a backup's result), counted as written or refused."""
        if host_indices is None:
            self.counters.refused += 1
        else:
            self.counters.written += 1
        return host_indices

    def host_class_free_pages(self) -> list[int]:
        """Free host pages of each owner class now (the live metrics' host use)."""
        return list(self._host_slots().class_free_page_counts())

    def make_room(self, start_class: int, pages: int) -> bool:
        """Evict host leaves holding pages of the classes a cyclic run of
        ``pages`` pages from ``start_class`` is short of; True iff it fits."""
        room = HostRoom(
            cyclic_class_counts(start_class, pages, self.placement.cp_size),
            self._host_slots().class_free_page_counts(),
        )
        if room.satisfied or self.cache.host_memory_mode == "buffer_only":
            return room.satisfied  # buffer_only: the tree holds no host values
        reachable = self._reachable()
        if not room.can_fit(reachable):
            self.counters.unfittable += 1
            return False  # the write fails either way: keep every host page
        # Upstream's rule from here, for the live metrics: a run short of a
        # class has a token floor (N * P * the fewest free pages of a class)
        # below its tokens, so upstream evicts the difference; when every
        # evictable page together is less, its evict_host falls short and the
        # backup is lost for certain.
        P, N = self.placement.page_size, self.placement.cp_size
        lost_upstream = sum(reachable) * P < pages * P - N * P * min(room.free)
        for through_ancestors in (False, True):
            room = self._evict_helpful_leaves(room, through_ancestors)
            if room.satisfied:
                break
        self.counters.room_made += int(room.satisfied)
        self.counters.room_made_lost_upstream += int(room.satisfied and lost_upstream)
        return room.satisfied

    def _evict_helpful_leaves(self, room: HostRoom, through_ancestors: bool) -> HostRoom:
        """One pass over the host leaves in upstream's order, evicting those
        that help (``through_ancestors``: by their own pages or the
        clearable host-only ancestors they lead to)."""
        tree = self.cache.tree_core
        full = tree.components_by_type[_FULL]
        full._ensure_eviction_strategy()
        upstream_priority = full.session_ref_eviction_strategy
        self._first = {
            i: (n, t) for i, (n, t) in self._first.items()
            if n in tree.evictable_host_leaves and n.last_access_time == t
        }

        def priority(node: Any) -> tuple[int, Any]:
            entry = self._first.get(node.id)
            kept = entry is not None and entry[0] is node and node.last_access_time == entry[1]
            return (0 if kept else 1, upstream_priority(node))

        heap = [(priority(n), n) for n in tree.evictable_host_leaves]
        heapq.heapify(heap)
        while heap and not room.satisfied:
            _, leaf = heapq.heappop(heap)
            if leaf not in tree.evictable_host_leaves:
                continue
            owners = self._host_owners(leaf)
            freed = class_counts_of(owners, self.placement.cp_size)
            if not room.helps(self._reach(leaf, freed) if through_ancestors else freed):
                self.counters.leaves_skipped += int(not through_ancestors)
                continue
            self.counters.leaves_evicted_for_ancestors += int(not room.helps(freed))
            tail = None if self._rule.tail is None else self._rule.tail(room, owners)
            if tail is not None and tail < len(owners) and self._splittable(leaf, len(owners)):
                leaf = self._split_off_tail(leaf, tail)
                freed = class_counts_of(owners[-tail:], self.placement.cp_size)
                if self._rule.prefix_first:
                    self._first[leaf.parent.id] = (leaf.parent, leaf.parent.last_access_time)
            self._evict_host_leaf(leaf)
            self.counters.leaves_evicted += 1
            self.counters.pages_evicted += sum(freed)
            parent: Optional[Any] = leaf.parent
            if parent is not None and parent in tree.evictable_host_leaves:
                heapq.heappush(heap, (priority(parent), parent))
            # The allocator's counts, not the estimate: they are what the write sees.
            room = HostRoom(room.need, self._host_slots().class_free_page_counts())
        return room

    def _reach(self, leaf: Any, freed: list[int]) -> list[int]:
        """Pages of each class evicting ``leaf`` is the way to."""
        ancestors = []
        node = leaf.parent
        while node is not None and node is not self.cache.tree_core.root_node and self._clearable(node):
            ancestors.append((self._host_classes(node), True))
            node = node.parent
        return reach_counts(freed, ancestors)

    def _reachable(self) -> list[int]:
        """Pages of each class host eviction could free at most: every host
        leaf and every clearable host-only ancestor of one, each once."""
        tree = self.cache.tree_core
        total = [0] * self.placement.cp_size
        seen: set[int] = set()
        memo: dict[int, bool] = {}
        for leaf in tree.evictable_host_leaves:
            node = leaf
            while node is not None and node is not tree.root_node and id(node) not in seen:
                if node is not leaf and not self._clearable(node, memo):
                    break  # nor is anything above it: it holds this subtree
                seen.add(id(node))
                total = [t + c for t, c in zip(total, self._host_classes(node))]
                node = node.parent
        return total

    def _clearable(self, node: Any, memo: Optional[dict[int, bool]] = None) -> bool:
        """Host-only, backed up, unlocked on both tiers, and every descendant
        likewise: evicting host leaves below it makes it one. ``memo``: the
        answers of this pass by node (the tree does not change while it reads)."""
        if memo is not None and id(node) in memo:
            return memo[id(node)]
        ok = (
            node.evicted and node.backuped
            and not any(cd.lock_ref > 0 or cd.host_lock_ref > 0 for cd in node.component_data)
            and all(self._clearable(child, memo) for child in node.children.values())
        )
        if memo is not None:
            memo[id(node)] = ok
        return ok

    def _splittable(self, leaf: Any, pages: int) -> bool:
        """Whether upstream's node split keeps every piece of ``leaf``'s state
        on its prefix: a host-only, unlocked, unprotected host leaf of FULL
        data alone (no other component's device or host value), with no
        write or load in flight, whose key, host slots and hashes all cover
        the same ``pages`` pages. Anything else is evicted whole."""
        tree = self.cache.tree_core
        full = leaf.component(_FULL)
        tokens = pages * self.placement.page_size
        quiet = all(
            cd.lock_ref == 0 and cd.host_lock_ref == 0 and cd.session_ref == 0 and not cd.session_ids
            for cd in leaf.component_data
        )
        alone = all(
            cd.value is None and cd.host_value is None for ct, cd in enumerate(leaf.component_data) if ct != _FULL
        )
        hashes = all(h is None or len(h) == pages for h in (leaf.hash_value, leaf.event_hash_value))
        return (
            leaf in tree.evictable_host_leaves and not leaf.children and not tree.is_eagle
            and full.value is None and full.host_value is not None
            and len(leaf.key) == len(full.host_value) == tokens
            and leaf.write_through_pending_id is None and leaf.load_back_pending_id is None
            and quiet and alone and hashes
        )

    def _split_off_tail(self, leaf: Any, tail: int) -> Any:
        """Split ``leaf`` so its last ``tail`` pages are a leaf of their own
        and return that leaf (the prefix stays a host node, its parent).
        Both keep ``leaf``'s recency: nothing accessed them, and the prefix
        must keep its place in upstream's LRU order."""
        tree = self.cache.tree_core
        when = leaf.last_access_time
        keep = len(leaf.key) - tail * self.placement.page_size
        prefix, action = tree._split_node(leaf.key, leaf, keep)
        if action is not None:  # only a write in flight or buffer_only yields one; both were excluded
            raise RuntimeError(f"splitting host leaf {leaf.id} queued {action!r}; nothing may be in flight")
        prefix.last_access_time = when
        leaf.last_access_time = when
        self.tails_split += 1
        self.pages_kept += keep // self.placement.page_size
        return leaf

    def _evict_host_leaf(self, leaf: Any) -> None:
        """One host leaf, as upstream's host eviction evicts each, its frees
        applied at once (the same frees in the same order as upstream's
        batched drain, so the host free lists end up the same)."""
        result = DriveHostEvictionResult()
        self.cache.tree_core._evict_host_leaf(
            leaf, result.tracker, result.device_frees, result.host_frees, cache_actions=result.cache_actions,
        )
        self.cache._apply_eviction_result(result)
