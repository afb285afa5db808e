"""Everything a raised step must leave as it found it, on one CP rank, in a
form that compares with ``==``; and call wrappers that fail on chosen calls.

:func:`rank_state` walks the tree page by page: each page of each node is
keyed by the tokens from the root to its end, so a split the step made (it
changes no page's state and stays, as upstream never merges nodes) compares
equal, while a page that moved on or off the device, changed its device page,
host slots, owners, locks or write state does not. Beside the tree: the
device and host leaf sets, the cache's size counters, the allocator (free
pages per owner lane -- a take-back sorts its free lists -- pages in use and
the round-robin cursor), the host pool's free slots, the ledger, the
controller's four queues, the operations in flight, the transfer counts and
the load-back shadow. :func:`shared_view` keeps what every rank must hold
alike, and :func:`exact_allocator` is the allocator list by list, both for
comparing ranks with each other.

Every node's page mirror (``cp_pages``) is checked against its ``value`` on
the way: a mismatch raises AssertionError naming the node.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

__all__ = ["FailOn", "exact_allocator", "rank_state", "shared_view"]

#: Where a page's state holds this rank's own host slots (rank-local numbers).
_HOST_SLOTS = 4


def _page_states(cache: Any) -> dict:
    """Per page of every node: (on device, device page, backed up, owner,
    this rank's host slots of it, lock_ref, host_ref_counter, write in flight)."""
    P = cache.page_size
    out: dict = {}
    stack = [(cache.root_node, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            tokens = path + tuple(child.key.token_ids)
            _check_mirror(child, P)
            meta = child.cp_hicache
            for i in range(len(child.key) // P):
                out[tokens[: len(path) + (i + 1) * P]] = (
                    not child.evicted,
                    None if child.evicted else int(child.cp_pages[i]),
                    child.backuped,
                    None if meta is None else int(meta.token_owners[i * P]),
                    _host_slots(meta, i, P),
                    child.lock_ref,
                    child.host_ref_counter,
                    child.write_through_pending_id is not None,
                )
            stack.append((child, tokens))
    return out


def _check_mirror(node: Any, P: int) -> None:
    if node.evicted:
        assert node.cp_pages is None, f"evicted node {node.id} keeps a page mirror"
        return
    expected = (node.cp_pages[:, None] * P + torch.arange(P)).reshape(-1)
    assert torch.equal(node.value.to("cpu", torch.int64), expected), f"node {node.id}: value != page mirror"


def _host_slots(meta: Any, page: int, P: int) -> Optional[tuple]:
    if meta is None:
        return None
    pos = meta.owned_positions
    mask = (pos >= page * P) & (pos < (page + 1) * P)
    return tuple(meta.host_indices[mask].tolist())


def _last_page_key(node: Any, root: Any) -> tuple:
    chunks = []
    while node is not root:
        chunks.append(tuple(node.key.token_ids))
        node = node.parent
    return tuple(t for chunk in reversed(chunks) for t in chunk)


def exact_allocator(allocator: Any) -> tuple:
    """The allocator's lists exactly as they are (what the next allocation reads)."""
    snap = allocator._lanes.snapshot()
    return snap.free, snap.release, snap.in_use, snap.rr_cursor


def _allocator(allocator: Any) -> tuple:
    snap = allocator._lanes.snapshot()
    lanes = tuple(tuple(sorted(f + r)) for f, r in zip(snap.free, snap.release))
    return lanes, snap.in_use, snap.rr_cursor


def _host_pool(cache: Any) -> tuple:
    pool = cache.token_to_kv_pool_host.anchor_entry.host_pool
    free = torch.cat([pool.free_slots, *pool.release_slots]) if pool.release_slots else pool.free_slots
    return pool.available_size(), tuple(sorted(free.tolist()))


def rank_state(stack: Any) -> dict:
    """One rank's state, comparable with ``==`` (see the module doc)."""
    cache = stack.cache
    ctrl = cache.cache_controller
    root = cache.root_node
    return {
        "pages": _page_states(cache),
        "device_leaves": sorted(_last_page_key(n, root) for n in cache.evictable_leaves),
        "host_leaves": sorted(_last_page_key(n, root) for n in cache.host_leaf_index),
        "sizes": (cache.evictable_size_, cache.protected_size_),
        "allocator": _allocator(stack.allocator),
        "host_pool": _host_pool(cache),
        "ledger": tuple(cache.host_slot_ledger.used),
        "queues": tuple(len(q) for q in (ctrl.write_queue, ctrl.load_queue, ctrl.ack_write_queue,
                                         ctrl.ack_load_queue)),
        "in_flight": (sorted(cache.ongoing_write_through), sorted(cache.ongoing_load_back),
                      len(cache.cp_writes.in_flight), len(cache.cp_loads.in_flight)),
        "transfers": dataclasses.astuple(cache.cp_transfer.stats),
        "load_shadow": tuple(cache.cp_loads.lane_shadow),
    }


def shared_view(state: dict) -> dict:
    """What every rank must hold alike: ``state`` without this rank's own
    host slot numbers, host pool and slot counts."""
    pages = {k: v[:_HOST_SLOTS] + v[_HOST_SLOTS + 1:] for k, v in state["pages"].items()}
    rank_local = ("pages", "host_pool", "transfers")
    return {"pages": pages, **{k: v for k, v in state.items() if k not in rank_local}}


class FailOn:
    """Wraps ``fn``: the calls numbered in ``calls`` (0-based) fail -- return
    None, or raise ``exc`` -- the others go through; ``when(*args)`` (if
    given) picks which calls count."""

    def __init__(self, fn: Callable, calls=(0,), *, exc: Optional[BaseException] = None,
                 when: Optional[Callable[..., bool]] = None) -> None:
        self.fn, self.calls, self.exc, self.when = fn, set(calls), exc, when
        self.seen = 0
        self.fired = 0

    def __call__(self, *args, **kwargs):
        if self.when is None or self.when(*args, **kwargs):
            n, self.seen = self.seen, self.seen + 1
            if n in self.calls:
                self.fired += 1
                if self.exc is not None:
                    raise self.exc
                return None
        return self.fn(*args, **kwargs)
