"""Requests as SGLang 0.5.23's scheduler holds and releases them, for the
simulator and the tests.

The scheduler keeps a request's token locations in a ``req_to_token`` row
(``ReqToTokenPool``) and gives its pages back with ``release_kv_cache``:
``claim_kv_row``, with ``checkpoint`` the insert of its pages
(``checkpoint_into_tree``: the tree frees what it already holds and the row
is rebound to the tree's pages), ``free_kv_row`` of what the request still
owns past the tree's prefix, ``on_release``. :class:`SchedulerRequests`
gives the cache a pool of rows and runs exactly that on real ``Req``
objects, so the frees reach the allocator through upstream's own path.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from sglang_cp_hicache.validation import check_int

__all__ = ["LoadBackRequest", "SchedulerRequests"]


@dataclass
class LoadBackRequest:
    """The request fields ``UnifiedRadixCache.init_load_back`` reads (a
    request without mamba state)."""

    rid: str
    last_node: Any
    kv_rotation_base: Optional[int]
    swa_host_hit_length: int = 0
    mamba_host_hit_length: int = 0
    extra_key: Optional[str] = None
    prefix_len: int = 0

    @property
    def kv(self) -> Any:
        return _NoMamba


class _NoMamba:
    mamba_pool_idx = None


class SchedulerRequests:
    """Rows for ``cache`` (attached as its ``req_to_token_pool``) and the
    release of real ``Req`` objects through ``release_kv_cache``."""

    def __init__(self, cache: Any, *, rows: int, max_tokens: int) -> None:
        check_int("rows", rows, 1)
        check_int("max_tokens", max_tokens, 1)
        if cache.req_to_token_pool is not None:
            raise ValueError("the cache already has a req_to_token_pool")
        self.cache = cache
        self.rows = rows
        self.pool = self._new_pool(max_tokens)

    def _new_pool(self, max_tokens: int) -> Any:
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        pool = ReqToTokenPool(
            size=self.rows, max_context_len=max_tokens, device=self.cache.token_to_kv_pool_allocator.device,
            enable_memory_saver=False,
        )
        self.cache.req_to_token_pool = pool
        return pool

    def grow(self, max_tokens: int) -> None:
        """Rows of at least ``max_tokens`` locations (a new pool; no row may be held)."""
        check_int("max_tokens", max_tokens, 1)
        if len(self.pool.free_slots) != self.pool.size:
            raise RuntimeError("cannot grow the rows while a request holds one")
        if max_tokens > self.pool.max_context_len:
            self.pool = self._new_pool(max(max_tokens, 2 * self.pool.max_context_len))

    def admit(
        self,
        rid: str,
        tokens: Sequence[int],
        locs: torch.Tensor,
        *,
        protected_len: int,
        rotation_base: Optional[int],
        last_node: Any = None,
        lock: Any = None,
    ) -> Any:
        """A finished ``Req`` holding a row with ``locs`` (every allocated
        location, the partial last page's included) of which the tree owns
        ``[0, protected_len)``, its pages drawn from ``rotation_base``."""
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        check_int("protected_len", protected_len, 0, locs.numel())
        if locs.numel() > self.pool.max_context_len:
            raise ValueError(f"locs holds {locs.numel()} locations, a row {self.pool.max_context_len}")
        req = Req(rid, "", array("q", tokens), SamplingParams(max_new_tokens=1))
        if self.pool.alloc([req]) is None:
            raise RuntimeError(f"no free req_to_token row for {rid} (rows {self.pool.size})")
        # Device work: the row is written from device locs (the scheduler's
        # forward preparation does the same), nothing read on the host.
        self.pool.write((req.kv.req_pool_idx, slice(0, locs.numel())), locs.to(self.pool.req_to_token.dtype))
        req.kv.cache_protected_len = protected_len
        req.kv.kv_allocated_len = req.kv.kv_committed_len = locs.numel()
        req.kv_rotation_base = rotation_base
        req.last_node = last_node
        req.lock = lock
        req.output_ids = array("q")
        req.finished_reason = FINISH_LENGTH(length=0)
        return req

    def release(self, req: Any, *, checkpoint: bool) -> None:
        """``release_kv_cache`` as the scheduler calls it for a finished request."""
        from sglang.srt.mem_cache.common import release_kv_cache

        release_kv_cache(req, self.cache, checkpoint=checkpoint)
