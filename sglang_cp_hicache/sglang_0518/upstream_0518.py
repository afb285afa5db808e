"""Bodies carried over from SGLang 0.5.18's ``HiRadixCache``, changed only
where CP state is involved.

Each function below mirrors the method of the same name of
``sglang.srt.mem_cache.hiradix_cache.HiRadixCache`` in sglang 0.5.18 and
says what differs; the cache's method of that name calls it with itself as
``tree``, so a body reads only what SGLang's cache has (plus the CP node
fields) and gets anything of this library as an argument. They cannot call
up to upstream: upstream reads and slices ``host_value`` (token-indexed, one slot per token), which under CP is
None -- a node's host state is this rank's owned positions and host slots
(``cp_hicache``, ``host_len``), and its device pages have a CPU mirror
(``cp_pages``) that must follow every edit of ``value``. A release that
changes these upstream methods needs this module re-read against it (the
adapter refuses other releases, :func:`sglang_cp_hicache.sglang_0518.check_sglang_version`).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, InsertResult, MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode
from sglang.srt.mem_cache.utils import compute_node_hash_values, split_node_hash_value

from sglang_cp_hicache.policy_0518.node_state import split_host_state
from sglang_cp_hicache.sglang_0518.tree_node import CpTreeNode

__all__ = ["evict_backuped", "evict_regular", "insert", "match_prefix", "split_node"]

#: The CPU page mirror of a node's value: ``(value, value_pages or None) -> pages``.
PagesFor = Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


def match_prefix(tree, params: MatchPrefixParams) -> MatchResult:
    """0.5.18 ``HiRadixCache.match_prefix``. Differs: the host hit adds
    the node's logical ``host_len`` (upstream: ``len(host_value)``,
    which under CP would count only this rank's slots)."""
    if tree.disable:
        return tree._empty_match_result
    key, _ = params.key.maybe_to_bigram_view(tree.is_eagle)
    key = key.page_aligned(tree.page_size)
    if len(key) == 0:
        return tree._empty_match_result
    value, last_node = tree._match_prefix_helper(tree.root_node, key)
    value = torch.cat(value) if value else tree._empty_match_result.device_indices
    host_hit_length = 0
    last_host_node = last_node
    while last_node.evicted:
        host_hit_length += last_node.host_len  # logical length
        last_node = last_node.parent
    while not last_host_node.backuped:
        last_host_node = last_host_node.parent
    return MatchResult(
        device_indices=value,
        last_device_node=last_node,
        last_host_node=last_host_node,
        best_match_node=last_host_node,
        host_hit_length=host_hit_length,
    )


def split_node(tree, key: RadixKey, child: TreeNode, split_len: int):
    """0.5.18 ``HiRadixCache._split_node``. Differs: the new node is a
    :class:`CpTreeNode`; the CPU page mirror is split with ``value``;
    the host state is split by owned positions (``split_host_state``)
    instead of slicing ``host_value``; the prefix half's host-leaf
    status is refreshed (it has a child now)."""
    new_node = CpTreeNode(priority=child.priority)
    new_node.children = {key[split_len:].child_key(tree.page_size): child}
    new_node.parent = child.parent
    new_node.lock_ref = child.lock_ref
    new_node.key = child.key[:split_len]
    new_node.hit_count = child.hit_count
    if child.evicted:
        new_node.value = None
    else:
        new_node.value = child.value[:split_len].clone()
        child.value = child.value[split_len:].clone()
        split_pages = split_len // tree.page_size
        new_node.cp_pages = child.cp_pages[:split_pages]
        child.cp_pages = child.cp_pages[split_pages:]
    was_backed_up = child.backuped
    split_host_state(child, new_node, split_len)
    new_node.hash_value, child.hash_value = split_node_hash_value(
        child.hash_value, split_len, tree.page_size
    )
    new_node.event_hash_value, child.event_hash_value = split_node_hash_value(
        child.event_hash_value, split_len, tree.page_size
    )
    child.parent = new_node
    child.key = child.key[split_len:]
    new_node.parent.children[key.child_key(tree.page_size)] = new_node
    if was_backed_up:
        tree._replace_pending_write_through_node(child, [new_node, child])
    # The prefix part has a child now; the suffix keeps its leaf status.
    tree._update_host_leaf_status(new_node)
    return new_node


def insert(tree, params: InsertParams, pages_for: PagesFor) -> InsertResult:
    """0.5.18 ``HiRadixCache.insert``. Differs: the CPU page mirror
    (``CpInsertParams.value_pages``, or one read of ``value``) follows
    ``value`` into every node; new nodes are :class:`CpTreeNode`; the
    parent of a new leaf gets its host-leaf status refreshed; the
    split-then-evicted and whole-match-evicted branches are one (same
    effect); ``_inc_hit_count`` is not guarded by the write policy
    (write_back is refused at start-up)."""
    key, value, chunked = params.key, params.value, params.chunked
    priority = params.priority if params.priority is not None else 0
    key, value = key.maybe_to_bigram_view(tree.is_eagle, value)
    key = key.page_aligned(tree.page_size)
    if value is not None:
        value = value[: len(key)]
    if len(key) == 0:
        return InsertResult(prefix_len=0)
    P = tree.page_size
    pages = pages_for(value, getattr(params, "value_pages", None))
    node = tree.root_node
    child_key = key.child_key(tree.page_size)
    total_prefix_length = 0
    while len(key) > 0 and child_key in node.children:
        node = node.children[child_key]
        node.last_access_time = time.monotonic()
        node.priority = max(node.priority, priority)
        prefix_len = node.key.match(key, page_size=tree.page_size)
        if prefix_len < len(node.key):
            node = tree._split_node(node.key, node, prefix_len)
            node.priority = max(node.priority, priority)
        if node.evicted:
            # recomputed KV replaces the evicted device copy
            node.value = value[:prefix_len].clone()
            node.cp_pages = pages[: prefix_len // P]
            tree.evictable_size_ += len(node.value)
            tree._update_leaf_status(node)
            tree._update_host_leaf_status(node)
            tree._update_leaf_status(node.parent)
        else:
            tree._inc_hit_count(node, chunked)
            total_prefix_length += prefix_len
        key = key[prefix_len:]
        value = value[prefix_len:]
        pages = pages[prefix_len // P :]
        if len(key):
            child_key = key.child_key(tree.page_size)
    if len(key):
        _add_leaf(tree, node, child_key, key, value, pages, priority, chunked)
    return InsertResult(prefix_len=total_prefix_length)


def _add_leaf(tree, node, child_key, key, value, pages, priority: int, chunked: bool) -> None:
    """The new-leaf tail of 0.5.18 ``HiRadixCache.insert`` (see there)."""
    new_node = CpTreeNode(priority=priority)
    new_node.parent = node
    new_node.key = key
    new_node.value = value.clone()
    new_node.cp_pages = pages
    node.children[child_key] = new_node
    tree.evictable_size_ += len(value)
    tree._update_leaf_status(node)
    tree._update_leaf_status(new_node)
    tree._update_host_leaf_status(node)
    if tree.enable_storage or tree.enable_kv_cache_events:
        new_node.hash_value = compute_node_hash_values(new_node, tree.page_size)
    tree._record_store_event(new_node)
    tree._inc_hit_count(new_node, chunked)


# ---- device eviction: free by the CPU mirror (no read of node.value) ----


def evict_backuped(tree, node: TreeNode) -> int:
    """0.5.18 ``HiRadixCache._evict_backuped``. Differs: frees the
    node's pages through the CPU mirror (``free_mirrored``) instead of
    ``cache_controller.evict_device(node.value)``, which would read the
    device locs back."""
    pages, node.cp_pages = node.cp_pages, None
    num_evicted = tree._detach_backuped(node)
    tree.token_to_kv_pool_allocator.free_mirrored(pages)
    return num_evicted


def evict_regular(tree, node: TreeNode) -> int:
    """0.5.18 ``HiRadixCache._evict_regular``. Differs: frees through
    the CPU mirror instead of ``mem_pool_device_allocator.free(node.value)``
    and clears the mirror."""
    assert len(node.children) == 0, f"non-leaf, {node.id=}"
    tree._record_remove_event(node)
    tree.token_to_kv_pool_allocator.free_mirrored(node.cp_pages)
    num_evicted = len(node.value)
    node.cp_pages = None
    tree._delete_leaf(node)
    return num_evicted
