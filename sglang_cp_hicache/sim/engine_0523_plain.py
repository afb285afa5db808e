"""The non-CP baseline on SGLang 0.5.23: the same request loop as
:mod:`.engine_0523` on a plain (non-sharded) DSA HiCache stack
(:func:`sglang_cp_hicache.testing.stack_0523.build_plain_rank_stack`), whose
one pool owns every page: no rotation bases, and the host pool counts its
slots itself (``available_size``)."""

from __future__ import annotations

from sglang_cp_hicache.sim.engine_0523 import ShardedSimRankEngine
from sglang_cp_hicache.testing.stack_0523 import ShardedRankStack

__all__ = ["PlainSimRankEngine"]


class PlainSimRankEngine(ShardedSimRankEngine):
    """Drives a plain 0.5.23 stack (``stack.config.cp_size == 1``)."""

    def __init__(self, stack: ShardedRankStack, *, content_seed: int = 0) -> None:
        if stack.config.cp_size != 1:
            raise ValueError(f"a plain stack has cp_size 1, got {stack.config.cp_size}")
        host = stack.cache.cache_controller.mem_pool_host.anchor_entry.host_pool
        self._host_capacity = int(host.available_size())  # nothing is in use yet (padding page excluded)
        super().__init__(stack, content_seed=content_seed)

    def _host_slots(self) -> tuple[int, int]:
        host = self.cache.cache_controller.mem_pool_host.anchor_entry.host_pool
        return self._host_capacity - int(host.available_size()), self._host_capacity

    def _device_tokens_in_use(self) -> int:
        return int(self.allocator.size - self.allocator.available_size())

    def _host_class_free_pages(self) -> list[int]:
        """One class: every page is this process's."""
        host = self.cache.cache_controller.mem_pool_host.anchor_entry.host_pool
        return [int(host.available_size()) // self.page_size]
