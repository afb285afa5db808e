"""``TreeNode`` for CP mode: plain-dict children and CP host state.

``value`` keeps the full logical device locs; ``cp_pages`` is their CPU
mirror (one logical page id per page, None while evicted), which the CP
write, load and eviction paths read instead of ``value``; ``host_value``
(SGLang's non-CP field) stays None; ``host_len`` + ``cp_hicache`` carry host
state.
``backuped`` is answered from the CP state, so SGLang's own eviction and
hit-count code, which reads ``backuped``, does the right thing unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch
from sglang.srt.mem_cache.radix_cache import TreeNode

from sglang_cp_hicache.policy_0518.metadata import CpHiCacheNodeMetadata
from sglang_cp_hicache.policy_0518.node_state import is_backed_up

__all__ = ["CpTreeNode"]


class CpTreeNode(TreeNode):
    # The root holds no KV but counts as backed up (upstream gives it
    # host_value=[]), so walks up to "the last backed-up node" end there.
    is_cp_root: bool = False

    def __init__(self, id: Optional[int] = None, priority: int = 0) -> None:
        super().__init__(id=id, priority=priority)
        # A missed lookup must raise, not insert an orphan child (SGLang's
        # defaultdict(TreeNode) does the latter).
        self.children = {}
        self.host_len: int = 0
        self.cp_hicache: Optional[CpHiCacheNodeMetadata] = None
        self.cp_pages: Optional[torch.Tensor] = None

    @property
    def backuped(self) -> bool:
        return self.is_cp_root or is_backed_up(self)
