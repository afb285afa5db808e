"""SGLang 0.5.18's side of the L3 prefetch protocol
(:mod:`sglang_cp_hicache.l3.prefetch`): what a lookup restores, host room,
the insert of a host-only node, the scheduler's storage-hit record.

* Owners of the restored pages: each page to the rank holding the fewest
  host slots (:func:`balanced_owners` on the host ledger, identical
  on every rank), fixed when the lookup starts.
* The anchor (the backed-up node, or the root, the chain hangs from) is
  protected (``protect_host``) from the start until the lookup settles.
* Host room: the ledger decides alike on every rank (evicting host leaves if
  needed); each rank then takes host slots for its own pages. A rank whose
  allocation fails answers 0, so the group restores nothing of that chain.
* The insert: a host-only :class:`CpTreeNode` of exactly the agreed pages,
  with the CP host state (owned positions, host slots, token owners) in place
  of ``host_value``; the slots past it and the ledger charge go back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Hashable, Optional

import torch
from sglang.srt.disaggregation.kv_events import StorageMedium
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sglang_cp_hicache.l3.prefetch import ChainPlan, chain_hashes_or_none, path_length, path_tokens, plain_key
from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.policy_0518.metadata import CpHiCacheNodeMetadata
from sglang_cp_hicache.policy_0518.node_state import set_host_state
from sglang_cp_hicache.sglang_0518.host_tier import HostTier
from sglang_cp_hicache.sglang_0518.tree_node import CpTreeNode

__all__ = ["HostRoom0518", "L3Port0518", "balanced_owners", "path_length", "path_tokens", "plain_key"]

logger = logging.getLogger(__name__)

_EMPTY = torch.empty((0,), dtype=torch.int64)


def balanced_owners(used: list[int], num_pages: int, page_size: int) -> list[int]:
    """Owners for ``num_pages`` restored pages: each page to the rank holding
    the fewest host slots so far (ties: the lowest rank). ``used`` is the
    host ledger, identical on every rank, so every rank picks the same."""
    load = list(used)
    owners = []
    for _ in range(num_pages):
        owner = min(range(len(load)), key=lambda r: (load[r], r))
        owners.append(owner)
        load[owner] += page_size
    return owners


@dataclass
class HostRoom0518:
    """The host room of a fetch: the ledger charge (tokens per rank) and this
    rank's host slots, one per token of its own pages (None: its allocation
    failed)."""

    pages: int
    owners: list[int]
    need: list[int]
    slots: Optional[torch.Tensor]
    page_size: int

    @property
    def own_slots(self) -> Optional[list[int]]:
        return None if self.slots is None else self.slots[:: self.page_size].tolist()


class L3Port0518:
    """The protocol's release side on one CP cache.

    ``tree``: the SGLang cache (its tree, host pool and storage-hit record
    are read from it, nothing of this library); ``host``: the ledger that
    places and charges restored pages, and the host leaves."""

    def __init__(self, tree: Any, tier: Any, placement: CpPlacement, host: HostTier) -> None:
        self.tree = tree
        self.tier = tier
        self.placement = placement
        self.host = host

    @property
    def page_size(self) -> int:
        return self.placement.page_size

    # ---- what a lookup restores ---------------------------------------------------
    def plan(self, anchor: TreeNode, chain: RadixKey) -> ChainPlan:
        """The chain ``chain`` (whole pages) under ``anchor``: hashes from the
        token ids from the root, owners from the host ledger."""
        P = self.page_size
        num_pages = len(chain) // P
        tokens = path_tokens(anchor) + list(chain.token_ids[: len(chain)])
        hashes, parent = chain_hashes_or_none(self.tier, tokens, len(tokens) // P - num_pages)
        owners = balanced_owners(self.host.ledger.used, num_pages, P)
        return ChainPlan(anchor, chain, tuple(chain.token_ids[:P]), hashes, owners, parent=parent)

    # ---- L3Port --------------------------------------------------------------------
    def still_hangs(self, plan: ChainPlan) -> bool:
        anchor = plan.anchor
        if anchor is not self.tree.root_node and (anchor.parent is None or not anchor.backuped):
            return False
        return plan.key.child_key(self.page_size) not in anchor.children

    def take_room(self, plan: ChainPlan, pages: int) -> Optional[HostRoom0518]:
        P, ledger = self.page_size, self.host.ledger
        owners = plan.owners[:pages]
        need = [owners.count(r) * P for r in range(len(ledger.used))]
        if not ledger.fits(need):
            self.host.evict_for(ledger.shortfall(need))
        if not ledger.fits(need):  # identical on every rank
            return None
        ledger.charge(need)
        return HostRoom0518(pages, owners, need, self._take_slots(owners), P)

    def _take_slots(self, owners: list[int]) -> Optional[torch.Tensor]:
        """This rank's host slots for its own pages (from now on the fetch's
        alone); None if the pool is short or the allocation raised."""
        P, rank = self.page_size, self.placement.cp_rank
        mine = sum(1 for o in owners if o == rank)
        try:
            slots = self.tree.cache_controller.mem_pool_host.alloc(mine * P) if mine else _EMPTY
        except Exception:
            logger.exception("sglang-cp-hicache L3: host allocation for a fetch raised on cp_rank %d", rank)
            return None
        if slots is None:
            logger.warning("sglang-cp-hicache L3: host pool short on cp_rank %d (ledger said it fits)", rank)
            return None
        return slots.to("cpu", torch.int64).reshape(-1)

    def settle(self, plan: ChainPlan, pages: int, room: Optional[HostRoom0518]) -> int:
        if room is None:
            return 0
        P, rank = self.page_size, self.placement.cp_rank
        mine = [i for i, o in enumerate(room.owners) if o == rank]
        kept = sum(1 for i in mine if i < pages) if room.slots is not None else 0
        if room.slots is not None and room.slots.numel() > kept * P:
            self.tree.cache_controller.mem_pool_host.free(room.slots[kept * P :])
        keep_need = [room.owners[:pages].count(r) * P for r in range(len(room.need))]
        self.host.ledger.release([a - b for a, b in zip(room.need, keep_need)])
        if pages == 0:
            return 0
        owned = torch.tensor(mine[:kept], dtype=torch.int64)
        positions = (owned[:, None] * P + torch.arange(P)).reshape(-1) if kept else _EMPTY
        token_owners = torch.tensor(room.owners[:pages], dtype=torch.int64).repeat_interleave(P)
        meta = CpHiCacheNodeMetadata._trusted(pages * P, positions, room.slots[: kept * P], token_owners)
        self.insert_host_node(plan.anchor, plan.key[: pages * P], meta)
        return pages * P

    def insert_host_node(self, anchor: TreeNode, key: RadixKey, meta: CpHiCacheNodeMetadata) -> None:
        """A host-only node under ``anchor``, as upstream's ``_insert_helper_host``
        builds one, with the CP host state instead of ``host_value``."""
        tree = self.tree
        node = CpTreeNode(priority=anchor.priority)
        node.parent = anchor
        node.key = key
        node.value = None
        set_host_state(node, meta)
        anchor.children[key.child_key(self.page_size)] = node
        self.host.refresh(node)
        tree._update_leaf_status(anchor)
        self.host.refresh(anchor)
        tree._record_store_event(node, medium=StorageMedium.CPU)

    def release_anchor(self, plan: ChainPlan) -> None:
        plan.anchor.release_host()

    def report(self, plan: ChainPlan, asker: Hashable, tokens: int) -> None:
        self.tree.prefetch_loaded_tokens_by_reqid[asker] = tokens
