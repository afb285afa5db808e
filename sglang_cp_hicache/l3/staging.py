"""Staging buffers for L3 objects, lent one page at a time.

A read that cannot go straight into the host rows (not all in the page
cache, or a store that is not a file store) lands in a staging buffer, is
verified there, and only then copied into the host pools; a write checks an
object already stored through one. Buffers are lent per page, not held per
thread: on flaky storage the I/O pools replace stuck threads with fresh
ones, and per-thread buffers would pile up with every hiccup (2.9 MiB a
page pair at DeepSeek-V3.2 sizes, registered with Mooncake for good). Here
the buffers alive are at most the pages in flight plus ``keep`` idle ones,
whatever the storage does; a buffer let go is unregistered from the store
that registered it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from sglang_cp_hicache.l3.capabilities import StoreCapabilities
from sglang_cp_hicache.l3.envelope import HEADER_BYTES, byte_view
from sglang_cp_hicache.l3.keys import L3Namespace
from sglang_cp_hicache.validation import check_int

__all__ = ["Staging", "StagingPool"]


@dataclass
class Staging:
    """Buffers for one page's objects: header + page, KV and indexer."""

    kv_head: memoryview
    kv_page: torch.Tensor
    idx_head: memoryview
    idx_page: torch.Tensor

    @classmethod
    def for_namespaces(cls, kv: L3Namespace, idx: L3Namespace) -> "Staging":
        return cls(memoryview(bytearray(HEADER_BYTES)), torch.empty(kv.page_bytes, dtype=torch.uint8),
                   memoryview(bytearray(HEADER_BYTES)), torch.empty(idx.page_bytes, dtype=torch.uint8))

    def kv(self) -> tuple[memoryview, memoryview]:
        return self.kv_head, byte_view(self.kv_page)

    def indexer(self) -> tuple[memoryview, memoryview]:
        return self.idx_head, byte_view(self.idx_page)

    def views(self) -> list[memoryview]:
        return [*self.kv(), *self.indexer()]


class StagingPool:
    """Lends :class:`Staging` buffers of one namespace pair; keeps at most
    ``keep`` idle. A store that registers buffers (one that reads in place:
    Mooncake) has each new buffer registered, and each buffer let go
    unregistered."""

    def __init__(self, kv: L3Namespace, idx: L3Namespace, caps: StoreCapabilities, keep: int = 4) -> None:
        check_int("keep", keep, 0)
        if not isinstance(caps, StoreCapabilities):
            raise TypeError(f"caps must be StoreCapabilities, got {type(caps).__name__}")
        self.kv_ns, self.idx_ns, self.keep = kv, idx, keep
        self._registry = caps.registers_buffers
        self._lock = threading.Lock()
        self._idle: list[Staging] = []
        self.created = 0  # buffers ever made
        self.freed = 0  # buffers let go (idle beyond ``keep``)

    @property
    def alive(self) -> int:
        """Buffers that exist now: lent out or idle."""
        with self._lock:
            return self.created - self.freed

    @contextmanager
    def borrow(self) -> Iterator[Staging]:
        """A buffer for one page, returned when the block ends."""
        staging = self._take()
        try:
            yield staging
        finally:
            self._give_back(staging)

    def _take(self) -> Staging:
        with self._lock:
            if self._idle:
                return self._idle.pop()
            self.created += 1
        staging = Staging.for_namespaces(self.kv_ns, self.idx_ns)
        if self._registry is not None:  # a store that reads in place (Mooncake)
            self._registry.register_buffers(staging.views())
        return staging

    def _give_back(self, staging: Staging) -> None:
        with self._lock:
            if len(self._idle) < self.keep:
                self._idle.append(staging)
                return
            self.freed += 1
        if self._registry is not None:
            self._registry.unregister_buffers(staging.views())
