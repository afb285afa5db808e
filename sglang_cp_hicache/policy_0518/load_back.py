"""Load-back assembly under CP: thresholds, quotas and retries in LOGICAL tokens.

A rank may own none of a node's pages, yet it must restore the node's full
logical locs like every other rank, so every decision here uses the node's
logical ``host_len``, never a rank's physical slot count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from sglang_cp_hicache.policy_0518.node_state import CpNode, is_backed_up, logical_host_len
from sglang_cp_hicache.validation import check_int

__all__ = ["LoadBackOutcome", "collect_evicted_chain", "cp_load_back"]


@dataclass
class LoadBackOutcome:
    device_locs: torch.Tensor  # full logical locs of the restored chain
    nodes: list  # restored nodes, root side first
    host_hit_len: int  # logical tokens restored
    retried_after_eviction: bool


def collect_evicted_chain(node: CpNode) -> tuple[list, CpNode]:
    """Evicted nodes from the first on-device ancestor down to ``node``."""
    chain: list = []
    while node.evicted:
        if not is_backed_up(node):
            raise RuntimeError(f"node {node.id} is evicted but has no host backup")
        chain.append(node)
        node = node.parent
    chain.reverse()
    return chain, node


def cp_load_back(
    node: CpNode,
    *,
    load_back_threshold: int,
    mem_quota: Optional[int],
    inc_lock_ref: Callable[[CpNode], int],
    dec_lock_ref: Callable[[CpNode], object],
    load: Callable[[list], Optional[torch.Tensor]],
    evict_device: Callable[[int], object],
) -> Optional[LoadBackOutcome]:
    """Restore ``node``'s evicted chain; None when below threshold, over quota
    or out of device pages even after evicting ``host_hit_len`` tokens.

    ``inc_lock_ref`` returns the lock delta (tokens that became protected),
    which, as in SGLang, counts towards the quota. On success each restored
    node's ``value`` is its slice of the returned logical locs.
    """
    check_int("load_back_threshold", load_back_threshold, 0)
    if mem_quota is not None:
        check_int("mem_quota", mem_quota)
    chain, ancestor = collect_evicted_chain(node)
    delta = inc_lock_ref(ancestor)
    try:
        host_hit_len = sum(logical_host_len(n) for n in chain)
        if host_hit_len == 0 or host_hit_len < load_back_threshold:
            return None
        if mem_quota is not None and host_hit_len > mem_quota + delta:
            return None
        device_locs = load(chain)
        retried = False
        if device_locs is None:
            evict_device(host_hit_len)
            retried = True
            device_locs = load(chain)
        if device_locs is None:
            return None
    finally:
        dec_lock_ref(ancestor)
    if device_locs.numel() != host_hit_len:
        raise RuntimeError(
            f"load returned {device_locs.numel()} locs for {host_hit_len} logical tokens"
        )
    offset = 0
    for n in chain:
        length = logical_host_len(n)
        n.value = device_locs[offset : offset + length].clone()
        offset += length
    return LoadBackOutcome(device_locs, chain, host_hit_len, retried)
