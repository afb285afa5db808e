"""Chunked prefill's checkpoint under CP on 0.5.18 (``cache_unfinished_req``
on every chunk), with the scheduler's call shapes
(:mod:`tests.helpers.sched_0518`): a request chunked in three, a second one
sharing its first chunk admitted while the first is still chunking.

After every checkpoint: the tree's page mirror is its locs' pages, every
checkpointed token's KV is on the rank owning its page, exactly the
requests' paths are locked. After both finish: every node backed up (the
chunk nodes too: their inserts skip the hit count, the finished insert
backs them up), ledgers equal host pools, nothing locked or leaked; then
with the device evicted and its buffers poisoned, each request's prefix
comes back from the host bit-exact. With L3 on, the chunks are written
there too: a CP 3 deployment reads them back bit-exact."""

from __future__ import annotations

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from sglang_cp_hicache import settings
from sglang_cp_hicache.testing.stack_0518 import CpStackConfig

from tests.helpers.cp_cluster import P, CpCluster
from tests.helpers.rank_snapshot import rank_state, shared_view
from tests.helpers.sched_0518 import FakeReq, SchedulerShapes
from tests.sglang_0518.test_scheduler_inserts import A, chunked_pair, mirror_lies

DECODES = 3


def path_nodes(cache, node) -> list:
    out = []
    while node is not cache.root_node:
        out.append(node)
        node = node.parent
    return out


def locked_nodes(cache) -> set[int]:
    out, stack = set(), list(cache.root_node.children.values())
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        if n.lock_ref:
            out.add(n.id)
    return out


def checkpoint_checks(cl: CpCluster, sh: SchedulerShapes, holders: list[FakeReq]) -> None:
    c = sh.cache
    assert mirror_lies(c) == []
    expected = {n.id for r in holders for n in path_nodes(c, r.last_node)}
    assert locked_nodes(c) == expected
    for r in holders:
        node_locks = {n.id: n.lock_ref for n in path_nodes(c, r.last_node)}
        assert all(v >= 1 for v in node_locks.values())
        assert len(r.prefix_indices) >= r.cache_protected_len == sum(len(n.key) for n in path_nodes(c, r.last_node))


def run_chunked(cl: CpCluster) -> None:
    shapes = {id(s): SchedulerShapes(cl, s) for s in cl.stacks}

    def on_rank(s):
        sh = shapes[id(s)]

        def checked(requests):
            checkpoint_checks(cl, sh, requests)
            if len(requests) == 2:  # the shared first chunk is held by both requests
                assert path_nodes(sh.cache, requests[1].last_node)[-1].lock_ref == 2
        return chunked_pair(sh, DECODES, checked)

    return cl.each(on_rank)


def after_finish_checks(cl: CpCluster, ids: list[list[int]]) -> None:
    for s in cl.stacks:
        c = s.cache
        assert locked_nodes(c) == set() and c.protected_size() == 0
        assert s.allocator.pages_in_use() * P == c.evictable_size()
        for tokens in ids:
            m = c.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
            assert len(m.device_indices) == len(tokens) // P * P
            assert all(n.backuped for n in path_nodes(c, m.last_device_node))
        host = c.cache_controller.mem_pool_host
        assert c.host_slot_ledger.used[s.cp_rank] == host.size - host.available_size()
    views = [shared_view(rank_state(s)) for s in cl.stacks]
    assert all(v == views[0] for v in views[1:])


def poison_device(cl: CpCluster) -> None:
    for s in cl.stacks:
        for buf in list(s.kv_pool.kv_buffer) + list(s.kv_pool.index_k_with_scale_buffer):
            buf.view(torch.uint8).fill_(0xA5)


@pytest.mark.parametrize("cp_size", [2, 3])
def test_chunk_checkpoints_keep_owner_pages_locks_and_host_backups(cp_size):
    cl = CpCluster(CpStackConfig(cp_size=cp_size, device_pages=8, host_pages=16))
    try:
        (a_ids, b_ids), *_ = run_chunked(cl)
        assert cl.check(a_ids) == {} and cl.check(b_ids) == {}
        after_finish_checks(cl, [a_ids, b_ids])
        cl.evict_device(10**6)
        assert all(s.allocator.pages_in_use() == 0 for s in cl.stacks)
        poison_device(cl)
        for tokens in (a_ids, b_ids):
            report = cl.load_back(tokens[: len(tokens) // P * P])
            assert [int(vals.numel()) for _, vals, _ in report.loaded_per_rank] == (
                [len(tokens) // P * P - (2 * P if tokens is b_ids else 0)] * cp_size
            )
            assert cl.check(tokens) == {}
    finally:
        cl.close()


def test_an_aborted_chunked_request_leaves_its_checkpoints_unlocked_and_nothing_leaked():
    cl = CpCluster(CpStackConfig(cp_size=2, device_pages=8, host_pages=16))
    try:
        for s in cl.stacks:
            sh = SchedulerShapes(cl, s)
            a = FakeReq("a", list(A))
            sh.admit(a)
            sh.extend([(a, 2 * P)])
            sh.checkpoint(a)
            sh.extend([(a, 4 * P)])
            sh.finish(a, is_insert=False)  # aborted mid-chunk: release_kv_cache without the insert
            sh.step()
            c = sh.cache
            assert locked_nodes(c) == set() and c.protected_size() == 0
            assert s.allocator.pages_in_use() * P == c.evictable_size() == 2 * P
            assert c.cp_rows.rows == {} and c.cp_rows.page_row == {}
            assert mirror_lies(c) == []
        assert cl.check(A[: 2 * P]) == {}
    finally:
        cl.close()


def test_chunks_reach_l3_and_another_cp_size_reads_them_back(tmp_path, monkeypatch):
    from tests.sglang_0518.test_l3 import io_done, read_back

    monkeypatch.setenv(settings.L3_DIR.name, str(tmp_path))
    # the writer's ranks run one after the other (each decides alone, as every rank does)
    writer = CpCluster(CpStackConfig(cp_size=2, device_pages=8, host_pages=16))
    try:
        (a_ids, b_ids), *_ = run_chunked(writer)
        io_done(writer)
    finally:
        writer.close()
    reader = CpCluster(CpStackConfig(cp_size=3, device_pages=8, host_pages=10), threaded=True, timeout_s=30)
    try:
        aligned = a_ids[: len(a_ids) // P * P]
        assert read_back(reader, aligned) == [len(aligned)] * 3
        assert reader.check(aligned) == {}
    finally:
        reader.close()
