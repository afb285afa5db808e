"""Radix-node host bookkeeping under CP, against a minimal node protocol.

SGLang's ``TreeNode`` satisfies :class:`CpNode` once it carries ``host_len``
and ``cp_hicache``; the tests use a tiny dataclass. ``value`` stays the full
logical device locs; ``host_value`` (SGLang's non-CP field) is never touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch

from sglang_cp_hicache.policy_0518.metadata import CpHiCacheNodeMetadata

__all__ = [
    "CpNode", "HostClearResult", "clear_host_state", "is_backed_up", "logical_host_len", "set_host_state",
    "split_host_state",
]


class CpNode(Protocol):
    parent: Optional["CpNode"]
    children: dict[Any, "CpNode"]
    key: Any
    value: Optional[torch.Tensor]
    host_len: int
    cp_hicache: Optional[CpHiCacheNodeMetadata]
    lock_ref: int
    host_ref_counter: int
    id: int

    @property
    def evicted(self) -> bool: ...


@dataclass(frozen=True)
class HostClearResult:
    physical_slots: int  # this rank's host slots released
    logical_tokens: int  # the node's logical length that left the host tier


def is_backed_up(node: CpNode) -> bool:
    """True once a CP write has recorded the node on host (on every rank,
    including ranks that own none of its pages)."""
    return node.cp_hicache is not None and node.host_len > 0


def logical_host_len(node: CpNode) -> int:
    return node.host_len if node.cp_hicache is not None else 0


def set_host_state(node: CpNode, metadata: CpHiCacheNodeMetadata) -> None:
    node.cp_hicache = metadata
    node.host_len = metadata.logical_len


def split_host_state(child: CpNode, new_node: CpNode, split_len: int) -> None:
    """``new_node`` takes ``child``'s first ``split_len`` tokens (SGLang's
    ``_split_node`` shape); the CP metadata follows the same cut."""
    if child.cp_hicache is None:
        new_node.cp_hicache = None
        new_node.host_len = 0
        return
    new_node.cp_hicache, child.cp_hicache = child.cp_hicache.split(split_len)
    new_node.host_len = split_len
    child.host_len = child.host_len - split_len


def clear_host_state(
    node: CpNode, free_host: Callable[[torch.Tensor], Any]
) -> HostClearResult:
    """Drop the node's host copy; frees this rank's slots (if any)."""
    meta = node.cp_hicache
    if meta is None:
        return HostClearResult(0, 0)
    physical = meta.num_host_slots
    if physical > 0:
        free_host(meta.host_indices)
    logical = node.host_len
    node.host_len = 0
    node.cp_hicache = None
    return HostClearResult(physical, logical)
