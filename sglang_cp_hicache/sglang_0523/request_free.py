"""Which cyclic run an insert's duplicate frees and a request's own frees
come from, on the sharded stack's cache instance.

Under KV sharding a request's ``req_to_token`` row is one owner-cyclic run
of pages: position-page ``P`` is owned by class ``(b + P) mod N``, ``b`` the
request's rotation base (``Req.kv_rotation_base``, set at every sharded
allocation; the matched prefix is its chain's pages, and an insert that
would mix two rotations is declined, so the row keeps one). An insert's
value is a copy of such a row, or of a chain's path plus the pages drawn
after it, from ``InsertParams.rotation_base``. So:

* ``UnifiedRadixCache.insert``: while it runs, the value is an open run
  from class ``rotation_base mod N``: the tree's duplicate frees are
  slices of it (``FreeDeviceKV`` -> ``free_segment``);
* ``UnifiedRadixCache.claim_kv_row``: ``release_kv_cache`` calls it first
  with the request; a request whose kv row stays with it is remembered
  until ``on_release`` (the last call of the release);
* ``UnifiedRadixCache.free_kv_row``: for a remembered request's kv record,
  its row is an open run from ``kv_rotation_base mod N`` while upstream's
  method frees slices of it.

:class:`~.device_free.PhaseKnownDeviceFrees` frees those slices from their
class without reading them. Anything else (no rotation base, a record not
being released, a streaming session's row) keeps upstream's path.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from sglang_cp_hicache.placement import phase_owner
from sglang_cp_hicache.sglang_0523.device_free import PhaseKnownDeviceFrees

__all__ = ["KnownRunFrees"]


class KnownRunFrees:
    """Open runs for a cache's inserts and request releases."""

    def __init__(self, cache: Any, frees: PhaseKnownDeviceFrees) -> None:
        if not isinstance(frees, PhaseKnownDeviceFrees):
            raise TypeError(f"frees must be a PhaseKnownDeviceFrees, got {type(frees).__name__}")
        if frees.cache is not cache:
            raise ValueError("frees is wired to another cache")
        self.cache = cache
        self.frees = frees
        self.cp_size = frees.allocator.shard_size
        self._upstream_insert: Callable[..., Any] = cache.insert
        self._upstream_claim: Callable[..., Any] = cache.claim_kv_row
        self._upstream_free_kv_row: Callable[..., Any] = cache.free_kv_row
        self._upstream_on_release: Callable[..., Any] = cache.on_release
        # id(kv record) -> the request being released (held: the id is not reused).
        self._releasing: dict[int, Any] = {}

    def install(self) -> None:
        """Replace the four methods on the cache instance."""
        self.cache.insert = self.insert
        self.cache.claim_kv_row = self.claim_kv_row
        self.cache.free_kv_row = self.free_kv_row
        self.cache.on_release = self.on_release

    def insert(self, params: Any) -> Any:
        value, base = params.value, params.rotation_base
        if base is None or not isinstance(value, torch.Tensor) or value.dim() != 1:
            return self._upstream_insert(params)
        with self.frees.run(value, phase_owner(base, self.cp_size), "duplicate"):
            return self._upstream_insert(params)

    def claim_kv_row(self, req: Any) -> bool:
        claimed = self._upstream_claim(req)
        if not claimed and req.kv.holds_kv:
            self._releasing[id(req.kv)] = req
        return claimed

    def free_kv_row(self, kv: Any, ranges: list[tuple[int, int]]) -> None:
        req = self._releasing.get(id(kv))
        base = None if req is None or req.kv is not kv else req.kv_rotation_base
        pool = self.cache.req_to_token_pool
        if base is None or pool is None or kv.req_pool_idx is None:
            return self._upstream_free_kv_row(kv, ranges)
        with self.frees.run(pool.req_to_token[kv.req_pool_idx], phase_owner(base, self.cp_size), "request"):
            return self._upstream_free_kv_row(kv, ranges)

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        try:
            return self._upstream_on_release(req, checkpointed=checkpointed)
        finally:
            self._releasing.pop(id(req.kv), None)
