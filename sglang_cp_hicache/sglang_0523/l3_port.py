"""SGLang 0.5.23's side of the L3 prefetch protocol
(:mod:`sglang_cp_hicache.l3.prefetch`) on the KV-sharded DSA stack.

* Owners: the chain's rotation phase -- the anchor's rotation base plus its
  depth in pages (a root anchor starts a chain on the least-full host
  class) -- so page ``i`` belongs to ``(phase + i) % N``, as the allocator
  places it; identical on every rank.
* The anchor is host-locked (``inc_host_lock_ref``) from the start until the
  lookup settles.
* Host room: the owner-aware host room evicts for the chain's classes and
  the mirrored host allocator hands out LOGICAL slots from the chain's phase
  (identical on every rank); each rank copies its own pages to their local rows.
* The insert: ``tree_core.insert_host`` of exactly the agreed pages, with the
  chain's rotation base stamped on the new node; the slots past it are freed.
* The asker's storage hit: upstream's ``prefetch_loaded_tokens_by_reqid`` and
  ``prefetch_loaded_storage_start_by_reqid``.
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass, field
from typing import Any, Hashable, Optional, Sequence

import torch
from sglang.srt.mem_cache.radix_cache import RadixKey

from sglang_cp_hicache.l3.host_tier import HostL3Tier
from sglang_cp_hicache.l3.plan import interleaved_owners
from sglang_cp_hicache.l3.prefetch import ChainPlan, chain_hashes_or_none, path_tokens
from sglang_cp_hicache.placement import CpPlacement, phase_owner

__all__ = ["ChainRelease", "HostRoom0523", "L3Port0523", "path_tokens"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChainRelease:
    """0.5.23's part of a chain plan: the anchor's host lock, the chain's
    rotation base and phase, and the tokens before it."""

    anchor_lock: Any  # DecLockRefParams of the anchor's host lock
    rotation_base: int
    phase: int
    storage_start: int


@dataclass
class HostRoom0523:
    """The logical host slots of a fetch (identical on every rank) and this
    rank's slot of each of its own pages (None: a local failure)."""

    slots: torch.Tensor
    own_slots: Optional[list[int]]


@dataclass(eq=False, repr=False)  # identity, not contents; the cache is too big to print
class L3Port0523:
    """The protocol's release side on one ``UnifiedRadixCache``."""

    cache: Any
    tier: HostL3Tier
    host_room: Any
    placement: CpPlacement = field(init=False)  # the tier's
    page_size: int = field(init=False)  # the tier's

    def __post_init__(self) -> None:
        self.placement, self.page_size = self.tier.placement, self.tier.page_size
        self.metrics: Any = None  # SGLang's storage-hit figures (--enable-metrics), set when installed

    # ---- what a lookup restores ---------------------------------------------------
    def plan(self, anchor_id: Any, new_input_tokens: Sequence[int], matched_prefix_tokens: Sequence[int],
             prefetch_threshold: int) -> Optional[ChainPlan]:
        """The whole pages of ``new_input_tokens`` under ``anchor_id``, or
        None when there is nothing to look up there (the same on every rank)."""
        core, P, N = self.cache.tree_core, self.page_size, self.placement.cp_size
        whole = len(new_input_tokens) // P * P
        if whole <= 0 or whole < prefetch_threshold:
            return None
        anchor = core.node_by_id(anchor_id)
        start = len(matched_prefix_tokens)
        first_page = tuple(int(t) for t in new_input_tokens[:P])
        if not self._can_hang(anchor, start, first_page):
            return None
        if anchor is core.root_node:
            base = self._host_slots().least_full_class()
        else:
            base = anchor.rotation_base
            if base is None:
                return None
        phase = base + start // P
        key = RadixKey(array("q", new_input_tokens[:whole]))
        owners = interleaved_owners(phase, whole // P, N)
        hashes, parent = chain_hashes_or_none(self.tier, list(matched_prefix_tokens) + list(key.token_ids), start // P)
        lock = self.cache.inc_host_lock_ref(anchor_id).to_dec_params()
        return ChainPlan(anchor_id, key, first_page, hashes, owners, ChainRelease(lock, base, phase, start), parent)

    def _can_hang(self, anchor: Any, depth: int, first_page: tuple[int, ...]) -> bool:
        """A chain can hang under ``anchor`` at ``depth`` tokens: the anchor is
        the root or a node whose host copy is final, it ends exactly there,
        and it has no child for the chain's first page yet."""
        core = self.cache.tree_core
        if anchor is not core.root_node:
            if anchor.parent is None or not anchor.backuped or anchor.write_through_pending_id is not None:
                return False
        if len(path_tokens(anchor)) != depth:
            return False
        return first_page not in {tuple(c.key.token_ids[: self.page_size]) for c in anchor.children.values()}

    def _host_slots(self) -> Any:
        return self.cache.cache_controller.mem_pool_host.anchor_entry.host_pool._slots

    # ---- L3Port --------------------------------------------------------------------
    def still_hangs(self, plan: ChainPlan) -> bool:
        anchor = self.cache.tree_core.node_by_id(plan.anchor)
        return self._can_hang(anchor, plan.release.storage_start, plan.first_page)

    def take_room(self, plan: ChainPlan, pages: int) -> Optional[HostRoom0523]:
        P, N = self.page_size, self.placement.cp_size
        if self.metrics is not None:  # the query's MIN: pages present on their owners
            self.metrics.hit(pages * P)
        start_class = phase_owner(plan.release.phase, N)
        if self.host_room is not None:
            self.host_room.make_room(start_class, pages)
        slots = self.cache.cache_controller.mem_pool_host.alloc(pages * P, start_owner=start_class)
        if slots is None:  # identical on every rank: the host allocator is mirrored
            if self.metrics is not None:
                self.metrics.unfulfilled(pages * P, "host_capacity")
            return None
        slots = slots.to("cpu", torch.int64).reshape(-1)
        owners = plan.owners[:pages]
        firsts = slots[::P]
        slot_owners = self.placement.owner_of(firsts).tolist()
        if slot_owners != owners:
            logger.error("sglang-cp-hicache L3: host slots of owners %s for a chain of owners %s", slot_owners, owners)
            return HostRoom0523(slots, None)
        rank = self.placement.cp_rank
        return HostRoom0523(slots, [int(s) for s, o in zip(firsts.tolist(), owners) if o == rank])

    def settle(self, plan: ChainPlan, pages: int, room: Optional[HostRoom0523]) -> int:
        if room is None:
            return 0
        P = self.page_size
        kept = pages * P if room.own_slots is not None else 0
        if kept:
            core = self.cache.tree_core
            result = core.insert_host(plan.anchor, plan.key[:kept], room.slots[:kept], plan.hashes[:pages])
            node_id = getattr(result, "inserted_host_node", None)
            node = None if node_id is None else core.node_by_id(node_id)
            if node is None or getattr(result, "host_insert_dropped", False) or node.parent.id != plan.anchor:
                kept = 0
                logger.warning("sglang-cp-hicache L3: chain of %d pages could not hang under node %s", pages, plan.anchor)
            else:
                node.rotation_base = plan.release.rotation_base
        if room.slots.numel() > kept:
            self.cache.cache_controller.mem_pool_host.free(room.slots[kept:])
            if self.metrics is not None:  # present on their owners, not restored (alike on every rank)
                self.metrics.unfulfilled(room.slots.numel() - kept, "storage_transfer")
        return kept

    def release_anchor(self, plan: ChainPlan) -> None:
        self.cache.dec_host_lock_ref(plan.anchor, plan.release.anchor_lock)

    def report(self, plan: ChainPlan, asker: Hashable, tokens: int) -> None:
        self.cache.prefetch_loaded_tokens_by_reqid[asker] = tokens
        self.cache.prefetch_loaded_storage_start_by_reqid[asker] = plan.release.storage_start
