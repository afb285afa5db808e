"""Bodies carried over from SGLang 0.5.18's ``HiRadixCache``, changed only
where CP state is involved.

Each method below mirrors the method of the same name of
``sglang.srt.mem_cache.hiradix_cache.HiRadixCache`` in sglang 0.5.18 and
says what differs. They cannot call up to upstream: upstream reads and
slices ``host_value`` (token-indexed, one slot per token), which under CP is
None -- a node's host state is this rank's owned positions and host slots
(``cp_hicache``, ``host_len``), and its device pages have a CPU mirror
(``cp_pages``) that must follow every edit of ``value``. A release that
changes these upstream methods needs this module re-read against it (the
adapter refuses other releases, :func:`sglang_cp_hicache.sglang_0518.check_sglang_version`).
"""

from __future__ import annotations

import time

import torch
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, InsertResult, MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode
from sglang.srt.mem_cache.utils import compute_node_hash_values, split_node_hash_value

from sglang_cp_hicache.policy_0518.node_state import split_host_state
from sglang_cp_hicache.sglang_0518.tree_node import CpTreeNode

__all__ = ["Upstream0518Mixin"]


class Upstream0518Mixin:
    """Tree edits and device eviction of 0.5.18, on :class:`CpTreeNode`."""

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """0.5.18 ``HiRadixCache.match_prefix``. Differs: the host hit adds
        the node's logical ``host_len`` (upstream: ``len(host_value)``,
        which under CP would count only this rank's slots)."""
        if self.disable:
            return self._empty_match_result
        key, _ = params.key.maybe_to_bigram_view(self.is_eagle)
        key = key.page_aligned(self.page_size)
        if len(key) == 0:
            return self._empty_match_result
        value, last_node = self._match_prefix_helper(self.root_node, key)
        value = torch.cat(value) if value else self._empty_match_result.device_indices
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

    def _split_node(self, key: RadixKey, child: TreeNode, split_len: int):
        """0.5.18 ``HiRadixCache._split_node``. Differs: the new node is a
        :class:`CpTreeNode`; the CPU page mirror is split with ``value``;
        the host state is split by owned positions (``split_host_state``)
        instead of slicing ``host_value``; the prefix half's host-leaf
        status is refreshed (it has a child now)."""
        new_node = CpTreeNode(priority=child.priority)
        new_node.children = {key[split_len:].child_key(self.page_size): child}
        new_node.parent = child.parent
        new_node.lock_ref = child.lock_ref
        new_node.key = child.key[:split_len]
        new_node.hit_count = child.hit_count
        if child.evicted:
            new_node.value = None
        else:
            new_node.value = child.value[:split_len].clone()
            child.value = child.value[split_len:].clone()
            split_pages = split_len // self.page_size
            new_node.cp_pages = child.cp_pages[:split_pages]
            child.cp_pages = child.cp_pages[split_pages:]
        was_backed_up = child.backuped
        split_host_state(child, new_node, split_len)
        new_node.hash_value, child.hash_value = split_node_hash_value(
            child.hash_value, split_len, self.page_size
        )
        new_node.event_hash_value, child.event_hash_value = split_node_hash_value(
            child.event_hash_value, split_len, self.page_size
        )
        child.parent = new_node
        child.key = child.key[split_len:]
        new_node.parent.children[key.child_key(self.page_size)] = new_node
        if was_backed_up:
            self._replace_pending_write_through_node(child, [new_node, child])
        # The prefix part has a child now; the suffix keeps its leaf status.
        self._update_host_leaf_status(new_node)
        return new_node

    def insert(self, params: InsertParams) -> InsertResult:
        """0.5.18 ``HiRadixCache.insert``. Differs: the CPU page mirror
        (``CpInsertParams.value_pages``, or one read of ``value``) follows
        ``value`` into every node; new nodes are :class:`CpTreeNode`; the
        parent of a new leaf gets its host-leaf status refreshed; the
        split-then-evicted and whole-match-evicted branches are one (same
        effect); ``_inc_hit_count`` is not guarded by the write policy
        (write_back is refused at start-up)."""
        key, value, chunked = params.key, params.value, params.chunked
        priority = params.priority if params.priority is not None else 0
        key, value = key.maybe_to_bigram_view(self.is_eagle, value)
        key = key.page_aligned(self.page_size)
        if value is not None:
            value = value[: len(key)]
        if len(key) == 0:
            return InsertResult(prefix_len=0)
        P = self.page_size
        pages = self._pages_for(value, getattr(params, "value_pages", None))
        node = self.root_node
        child_key = key.child_key(self.page_size)
        total_prefix_length = 0
        while len(key) > 0 and child_key in node.children:
            node = node.children[child_key]
            node.last_access_time = time.monotonic()
            node.priority = max(node.priority, priority)
            prefix_len = node.key.match(key, page_size=self.page_size)
            if prefix_len < len(node.key):
                node = self._split_node(node.key, node, prefix_len)
                node.priority = max(node.priority, priority)
            if node.evicted:
                # recomputed KV replaces the evicted device copy
                node.value = value[:prefix_len].clone()
                node.cp_pages = pages[: prefix_len // P]
                self.evictable_size_ += len(node.value)
                self._update_leaf_status(node)
                self._update_host_leaf_status(node)
                self._update_leaf_status(node.parent)
            else:
                self._inc_hit_count(node, chunked)
                total_prefix_length += prefix_len
            key = key[prefix_len:]
            value = value[prefix_len:]
            pages = pages[prefix_len // P :]
            if len(key):
                child_key = key.child_key(self.page_size)
        if len(key):
            self._add_leaf(node, child_key, key, value, pages, priority, chunked)
        return InsertResult(prefix_len=total_prefix_length)

    def _add_leaf(self, node, child_key, key, value, pages, priority: int, chunked: bool) -> None:
        """The new-leaf tail of 0.5.18 ``HiRadixCache.insert`` (see there)."""
        new_node = CpTreeNode(priority=priority)
        new_node.parent = node
        new_node.key = key
        new_node.value = value.clone()
        new_node.cp_pages = pages
        node.children[child_key] = new_node
        self.evictable_size_ += len(value)
        self._update_leaf_status(node)
        self._update_leaf_status(new_node)
        self._update_host_leaf_status(node)
        if self.enable_storage or self.enable_kv_cache_events:
            new_node.hash_value = compute_node_hash_values(new_node, self.page_size)
        self._record_store_event(new_node)
        self._inc_hit_count(new_node, chunked)

    # ---- device eviction: free by the CPU mirror (no read of node.value) ----
    def _evict_backuped(self, node: TreeNode):
        """0.5.18 ``HiRadixCache._evict_backuped``. Differs: frees the
        node's pages through the CPU mirror (``free_mirrored``) instead of
        ``cache_controller.evict_device(node.value)``, which would read the
        device locs back."""
        pages, node.cp_pages = node.cp_pages, None
        num_evicted = self._detach_backuped(node)
        self.token_to_kv_pool_allocator.free_mirrored(pages)
        return num_evicted

    def _evict_regular(self, node: TreeNode):
        """0.5.18 ``HiRadixCache._evict_regular``. Differs: frees through
        the CPU mirror instead of ``mem_pool_device_allocator.free(node.value)``
        and clears the mirror."""
        assert len(node.children) == 0, f"non-leaf, {node.id=}"
        self._record_remove_event(node)
        self.token_to_kv_pool_allocator.free_mirrored(node.cp_pages)
        num_evicted = len(node.value)
        node.cp_pages = None
        self._delete_leaf(node)
        return num_evicted
