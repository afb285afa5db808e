"""SGLang 0.5.18's own inserts (``cache_unfinished_req`` / ``cache_finished_req``,
plain ``InsertParams``: no page mirror) and the frees in them read no device
index on the host: the cache answers them from each request's CPU row.

Driven with the scheduler's call shapes (:mod:`tests.helpers.sched_0518`):
chunked prefill with a second request sharing the prefix while the first is
still chunking, both in one extend batch, decode across page boundaries,
then both finished. ``req_to_token`` and every allocation's locs raise on any
host read (:mod:`tests.helpers.device_index`)."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from sglang_cp_hicache.testing.stack_0518 import CpStackConfig

from tests.helpers.cp_cluster import P, CpCluster, seq
from tests.helpers.device_index import device_side
from tests.helpers.sched_0518 import FakeReq, SchedulerShapes
from tests.sglang_0518.test_no_sync import harness_is_device_work, no_host_reads  # noqa: F401 - fixtures

A = seq(1_000, 4) + list(range(9_000, 9_000 + P // 2))  # 4.5 pages, chunked 2 + 2 + 0.5
B = A[: 2 * P] + list(range(20_000, 20_000 + P + P // 2))  # shares A's first chunk
DECODES = 40  # A: 288 -> 328 tokens, B: 224 -> 264 tokens: each opens a page in decode


def chunked_pair(
    sh: SchedulerShapes, decodes: int, checked: Callable[[list[FakeReq]], None] = lambda reqs: None,
) -> tuple[list[int], list[int]]:
    """Request a (``A``) prefilled in chunks of 2 + 2 + 0.5 pages; b (``B``)
    admitted after a's first chunk, which it hits, and extended in a's second
    chunk's batch; both decoded ``decodes`` tokens, then finished.
    ``checked(requests)`` runs after each checkpoint. Both token id lists."""
    a, b = FakeReq("a", list(A)), FakeReq("b", list(B))
    sh.admit(a)
    sh.extend([(a, 2 * P)])
    sh.checkpoint(a)
    checked([a])
    sh.step()
    sh.admit(b)  # hits a's first chunk, already in the tree
    assert len(b.prefix_indices) == 2 * P
    sh.extend([(a, 4 * P), (b, len(B))])  # one batch: the chunked request and a new one
    sh.checkpoint(a)
    checked([a, b])
    sh.step()
    sh.extend([(a, len(A))])
    for _ in range(decodes):
        sh.decode([a, b])
    sh.finish(b)
    sh.finish(a)
    sh.step()
    return a.all_ids, b.all_ids


def run_two_requests(cl: CpCluster, *, trap: bool) -> list:
    return [chunked_pair(SchedulerShapes(cl, s, trap=trap), DECODES) for s in cl.stacks]


def mirror_lies(cache) -> list[int]:
    """Nodes on the device whose CPU page mirror is not their locs' pages."""
    bad, stack = [], list(cache.root_node.children.values())
    with device_side():
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if not n.evicted and not torch.equal(n.value[::P].to(torch.int64) // P, n.cp_pages):
                bad.append(n.id)
    return bad


@pytest.mark.usefixtures("no_host_reads")
@pytest.mark.parametrize("cp_size", [2, 3])
def test_scheduler_inserts_and_frees_read_no_device_index(cp_size):
    cl = CpCluster(CpStackConfig(cp_size=cp_size, device_pages=8, host_pages=16))
    try:
        (a_ids, b_ids), *_ = run_two_requests(cl, trap=True)
        assert cl.check(a_ids) == {} and cl.check(b_ids) == {}
        for c in cl.caches:
            assert c.cp_counters.device_page_reads == 0
            assert c.cp_counters.device_page_reads_avoided == 4  # 2 checkpoints + 2 finished inserts
            assert c.cp_rows.rows == {} and c.cp_rows.page_row == {} and c.cp_rows.rows_dropped == 0
            assert mirror_lies(c) == []
            # every page in use is the tree's: nothing leaked, nothing freed twice
            assert c.token_to_kv_pool_allocator.pages_in_use() * P == c.evictable_size() + c.protected_size()
            assert c.protected_size() == 0
            m = c.match_prefix(MatchPrefixParams(key=RadixKey(a_ids)))
            assert len(m.device_indices) == len(a_ids) // P * P
    finally:
        cl.close()


def test_a_request_the_rows_cannot_follow_falls_back_to_one_read():
    """A row never guessed: with the request order unknown (the pool's
    ``alloc`` not reported), the inserts read the device, and say so."""
    cl = CpCluster(CpStackConfig(cp_size=2, device_pages=8, host_pages=16))
    try:
        sh = SchedulerShapes(cl, cl.stacks[0])
        c = sh.cache
        a = FakeReq("a", list(A))
        del sh.pool.alloc  # upstream's alloc again: the batch order goes unreported
        sh.admit(a)
        sh.extend([(a, 2 * P)])
        sh.checkpoint(a)
        assert c.cp_counters.device_page_reads == 1 and c.cp_rows.rows == {}
        assert mirror_lies(c) == []
    finally:
        cl.close()


def test_a_batch_that_is_not_the_reported_one_ties_nothing():
    """Slots reported for one batch, an extend whose lengths are another's:
    every row is dropped (their inserts read the device), none is guessed."""
    cl = CpCluster(CpStackConfig(cp_size=2, device_pages=8, host_pages=16))
    try:
        sh = SchedulerShapes(cl, cl.stacks[0])
        c = sh.cache
        a, b = FakeReq("a", list(A)), FakeReq("b", list(B))
        sh.admit(a)
        sh.extend([(a, 2 * P)])
        sh.checkpoint(a)
        assert set(c.cp_rows.rows) == {a.req_pool_idx} and c.cp_counters.device_page_reads == 0
        sh.admit(b)  # same prefix length as a's next chunk: only the fill tells them apart
        upstream = type(sh.pool).alloc.__get__(sh.pool)
        sh.pool.alloc([b])  # reported: b alone ...
        sh.pool.alloc = upstream
        sh.extend([(a, 4 * P)])  # ... but the extend is a's next chunk
        assert c.cp_rows.rows == {} and c.cp_rows.page_row == {} and c.cp_rows.rows_dropped == 1
        sh.checkpoint(a)
        assert c.cp_counters.device_page_reads == 1 and mirror_lies(c) == []
        assert cl.check(A[: 4 * P]) == {}
    finally:
        cl.close()
