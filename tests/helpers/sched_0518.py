"""SGLang 0.5.18's scheduler call shapes on one CP rank, without the scheduler.

What a server's scheduler does to the cache and the pools per request, in its
order: ``match_prefix`` and the ``PrefillAdder``'s lock, ``ReqToTokenPool.alloc``
then ``alloc_extend`` (per batch, in batch order) and the row writes of
``write_cache_indices``, the chunk checkpoint ``cache_unfinished_req``,
``alloc_decode`` and its row write, ``cache_finished_req`` and the slot free
of ``release_kv_cache``. The forward pass is the content fill of
:class:`~tests.helpers.cp_cluster.CpCluster` (every new token's KV from its
content key, on the rank owning its page).

``req_to_token`` is a device-index tensor when the no-host-read trap is on
(:mod:`tests.helpers.device_index`); the allocator's own read of
``last_loc`` (which 0.5.18's scheduler hands it as a device tensor) is the one
read left outside the trap, as documented for the allocation calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey

from sglang_cp_hicache.testing.content import prefix_keys

from tests.helpers.device_index import unwrap, wrap

MAX_CONTEXT = 1024


@dataclass(eq=False)
class FakeReq:
    """The fields of SGLang's ``Req`` the cache's and pool's calls read."""

    rid: str
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    fill_ids: list[int] = field(default_factory=list)
    req_pool_idx: Optional[int] = None
    prefix_indices: Any = None
    last_node: Any = None
    cache_protected_len: int = 0
    kv_committed_len: int = 0
    inflight_middle_chunks: int = 0
    extra_key: Any = None
    cache_salt: Any = None
    priority: int = 0

    def get_fill_ids(self) -> list[int]:
        return self.fill_ids

    @property
    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids


class SchedulerShapes:
    """One rank's scheduler calls. ``trap``: ``req_to_token`` (and the new
    locs) are device-index tensors, so a host read of them raises."""

    def __init__(self, cluster, stack, *, slots: int = 8, trap: bool = False) -> None:
        self.cluster, self.stack, self.trap = cluster, stack, trap
        self.cache, self.allocator = stack.cache, stack.allocator
        self.pool = ReqToTokenPool(size=slots, max_context_len=MAX_CONTEXT, device="cpu", enable_memory_saver=False)
        if trap:
            self.pool.req_to_token = wrap(self.pool.req_to_token)
        # What SGLang's cache construction hands the cache (and the CP cache
        # then watches): the scheduler's request pool.
        self.cache.req_to_token_pool = self.pool
        rows = getattr(self.cache, "cp_rows", None)
        if rows is not None:
            rows.watch_slots(self.pool)

    def admit(self, req: FakeReq) -> None:
        """Match and lock, as the ``PrefillAdder`` does (no host hit here)."""
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(req.origin_input_ids)))
        req.prefix_indices, req.last_node = m.device_indices, m.last_device_node
        req.cache_protected_len = len(m.device_indices)
        self.cache.inc_lock_ref(req.last_node)

    def extend(self, batch: list[tuple[FakeReq, int]]) -> None:
        """One extend batch: each request's fill grows to its end."""
        reqs = [r for r, _ in batch]
        for r, end in batch:
            r.fill_ids = r.origin_input_ids[:end]
        prefix = [len(r.prefix_indices) for r in reqs]
        seq = [end for _, end in batch]
        self.pool.alloc(reqs)
        last = torch.cat([unwrap(r.prefix_indices[-1:]) if len(r.prefix_indices) else torch.tensor([-1]) for r in reqs])
        out = self.allocator.alloc_extend(
            torch.tensor(prefix), torch.tensor(prefix), torch.tensor(seq), torch.tensor(seq), last,
            sum(s - p for p, s in zip(prefix, seq)),
        )
        assert out is not None, "the test sized the pool too small"
        out = wrap(out) if self.trap else out
        pt = 0
        for r, p, s in zip(reqs, prefix, seq):
            new = out[pt : pt + s - p]
            pt += s - p
            self.pool.write((r.req_pool_idx, slice(0, p)), r.prefix_indices)
            self.pool.write((r.req_pool_idx, slice(p, s)), new)
            self.cluster._fill(self.stack, new, prefix_keys(r.fill_ids)[p:s])
            r.kv_committed_len = s

    def checkpoint(self, req: FakeReq) -> None:
        """The chunk checkpoint (0.5.18: ``cache_unfinished_req``)."""
        req.inflight_middle_chunks = 1
        self.cache.cache_unfinished_req(req, chunked=True)

    def decode(self, reqs: list[FakeReq], token: int = 7) -> None:
        """One decode step: each request gets one more token."""
        for r in reqs:
            r.output_ids.append(token + len(r.output_ids))
        seq = [len(r.all_ids) for r in reqs]
        last = torch.cat([unwrap(self.pool.req_to_token[r.req_pool_idx, s - 2 : s - 1]) for r, s in zip(reqs, seq)])
        out = self.allocator.alloc_decode(torch.tensor(seq), torch.tensor(seq), last.to(torch.int64))
        assert out is not None, "the test sized the pool too small"
        out = wrap(out) if self.trap else out
        for i, (r, s) in enumerate(zip(reqs, seq)):
            self.pool.write((r.req_pool_idx, slice(s - 1, s)), out[i : i + 1])
            self.cluster._fill(self.stack, out[i : i + 1], prefix_keys(r.all_ids)[s - 1 : s])
            r.kv_committed_len = s

    def finish(self, req: FakeReq, *, is_insert: bool = True) -> None:
        """``release_kv_cache``: the finished insert, then the slot."""
        self.cache.cache_finished_req(req, is_insert=is_insert, kv_len_to_handle=req.kv_committed_len)
        self.pool.free(req)

    def step(self) -> None:
        self.cache.writing_check()
        self.cache.loading_check()
