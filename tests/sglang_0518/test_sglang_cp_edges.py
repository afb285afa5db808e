"""Seed Tasks 1 and 2 adapted to 0.5.18, host exhaustion, and the ledger."""

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from sglang_cp_hicache.sglang_0518.allocator import CpSharedPagedTokenToKVPoolAllocator
from sglang_cp_hicache.sglang_0518.checks import check_cp_hicache_server_args
from sglang_cp_hicache.testing.stack_0518 import CpStackConfig, build_cp_rank_stack
from sglang_cp_hicache.sglang_0518.tree_node import CpTreeNode

from tests.helpers.cp_cluster import (
    P,
    CpCluster,
    RankSetup,
    build_each_rank,
    building_rank,
    runtime_context_per_thread,
    seq,
)


@pytest.fixture
def cluster():
    made = []

    def make(**kw):
        c = CpCluster(CpStackConfig(**kw))
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def test_missing_child_access_does_not_create_orphan_node():
    node = CpTreeNode()
    with pytest.raises(KeyError):
        _ = node.children["missing"]
    assert node.children == {}


def test_allocator_state_str_reports_free_and_release_pages():
    alloc = CpSharedPagedTokenToKVPoolAllocator(
        logical_size=64 * 8, physical_size=64 * 3, page_size=64, dtype=torch.bfloat16,
        device="cpu", kvcache=None, need_sort=True, cp_size=4, cp_rank=0,
    )
    locs = alloc.alloc(64 * 6)
    alloc.free(locs[:64])
    state = alloc.allocator_state_str()
    assert "allocator_available_size=192" in state
    assert "allocator_free_size=128" in state and "free_pages=2" in state
    assert "allocator_release_size=64" in state and "release_pages=1" in state


def test_allocator_rejects_too_small_physical_pool():
    # 9 logical pages (with padding) over 4 ranks: rank 0 owns pages 0, 4, 8.
    with pytest.raises(ValueError, match="physical_size"):
        CpSharedPagedTokenToKVPoolAllocator(
            logical_size=64 * 8, physical_size=64 * 2, page_size=64, dtype=torch.bfloat16,
            device="cpu", kvcache=None, need_sort=True, cp_size=4, cp_rank=0,
        )


def test_alloc_extend_and_decode_fill_open_pages_first():
    alloc = CpSharedPagedTokenToKVPoolAllocator(
        logical_size=4 * 16, physical_size=4 * 9, page_size=4, dtype=torch.bfloat16,
        device="cpu", kvcache=None, need_sort=True, cp_size=2, cp_rank=0,
    )
    # request A: prefix 2 tokens in page 3 (last loc 13), grows to 7 tokens
    out = alloc.alloc_extend(torch.tensor([2]), torch.tensor([2]), torch.tensor([7]), torch.tensor([7]),
                             torch.tensor([13]), extend_num_tokens=5)
    assert out[:2].tolist() == [14, 15]
    new_page = out[2].item() // 4
    assert out[2:].tolist() == [new_page * 4 + i for i in range(3)]
    # decode: token 8 (seq_len 8) still fits the page; token 9 opens a new page
    last = out[-1:]
    d = alloc.alloc_decode(torch.tensor([8]), torch.tensor([8]), last)
    assert d.tolist() == [last.item() + 1]
    d2 = alloc.alloc_decode(torch.tensor([9]), torch.tensor([9]), d)
    assert d2.item() % 4 == 0 and d2.item() // 4 not in (3, new_page)


def test_storage_backend_is_refused_naming_both_settings():
    args = SimpleNamespace(hicache_storage_backend="hf3fs", hicache_write_policy="write_through")
    with pytest.raises(ValueError, match="CP shared KV.*hicache_storage_backend"):
        check_cp_hicache_server_args(args, cp_shared_kv=True)
    check_cp_hicache_server_args(args, cp_shared_kv=False)  # non-CP: untouched
    with pytest.raises(ValueError, match="write_back"):
        check_cp_hicache_server_args(SimpleNamespace(hicache_storage_backend=None,
                                                     hicache_write_policy="write_back"), cp_shared_kv=True)


def test_cache_construction_refuses_a_storage_backend_it_cannot_serve(monkeypatch):
    """Only ``file`` and ``mooncake`` are served (by the library's own L3);
    any other backend is refused at construction, naming the flag."""
    from sglang_cp_hicache.testing import env

    real = env.make_cpu_server_args

    def with_storage(**kw):
        kw["hicache_storage_backend"] = "hf3fs"
        return real(**kw)

    monkeypatch.setattr(env, "make_cpu_server_args", with_storage)
    with pytest.raises(ValueError, match="hicache_storage_backend='hf3fs'.*--hicache-storage-backend"):
        build_cp_rank_stack(CpStackConfig(cp_size=2), 0)


def test_mem_quota_is_computed_when_scheduler_passes_none(cluster):
    cl = cluster(cp_size=2, device_pages=6, host_pages=12)
    tokens = seq(10, 4)
    cl.insert(tokens, seed=1)
    cl.evict_device(len(tokens))
    c = cl.caches[0]
    m = c.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
    available = c.token_to_kv_pool_allocator.available_size()  # 11 pages free
    # The request wants 4 cached pages + 7 new pages of its own: 4 + 7 + 1 slack > 11.
    req = SimpleNamespace(fill_ids=tokens + list(range(7 * P)), prefix_indices=torch.empty(0))
    params = InitLoadBackParams(best_match_node=m.last_host_node, host_hit_length=m.host_hit_length, req=req)
    assert c.load_back_mem_quota(params) == available - 8 * P
    vals, _ = c.init_load_back(params)
    assert vals.numel() == 0  # refused: loading would take the request's own pages
    small = SimpleNamespace(fill_ids=tokens + list(range(P)), prefix_indices=torch.empty(0))
    params = InitLoadBackParams(best_match_node=m.last_host_node, host_hit_length=m.host_hit_length, req=small)
    vals, _ = c.init_load_back(params)
    assert vals.numel() == len(tokens)


def test_oom_string_carries_allocator_state_and_evict_result(cluster):
    cl = cluster(cp_size=2, device_pages=4, host_pages=8)
    cl.insert(seq(10, 2), seed=1)
    c = cl.caches[0]
    c.evict(EvictParams(num_tokens=P))
    text = c.available_and_evictable_str()
    assert "allocator_free_size=" in text and "release_pages=" in text
    assert "evict_result=(num_tokens_evicted=" in text


def host_slots_in_use(c):
    return c.token_to_kv_pool_host.size - c.token_to_kv_pool_host.available_size()


def tree_host_slots(c):
    total, stack = 0, [c.root_node]
    while stack:
        n = stack.pop()
        if n.cp_hicache is not None:
            total += n.cp_hicache.num_host_slots
        stack.extend(n.children.values())
    return total


def test_host_exhaustion_evicts_by_physical_slots_consistently(cluster):
    # Host: 6 pages per rank. Each 4-page sequence costs each of 2 ranks 2 pages.
    cl = cluster(cp_size=2, device_pages=5, host_pages=6)
    seqs = [seq(1000 * (i + 1), 4) for i in range(5)]
    for i, s in enumerate(seqs):
        cl.insert(s, seed=i)
        cl.evict_device(4 * P)  # push to host only
        for c in cl.caches:
            assert host_slots_in_use(c) == tree_host_slots(c)
            assert c.host_slot_ledger.used[c.cp_placement.cp_rank] == host_slots_in_use(c)
            assert host_slots_in_use(c) <= 6 * P
        shapes = {repr(cl.tree_shape(c)) for c in cl.caches}
        assert len(shapes) == 1, "ranks evicted different host nodes"
    evicted = [c.cp_counters.host_evicted_nodes for c in cl.caches]
    assert evicted[0] == evicted[1] > 0
    # The most recent sequence survived on host and restores bit-exactly.
    cl.load_back(seqs[-1])
    assert cl.check(seqs[-1], seed=4) == {}


def test_write_that_cannot_fit_fails_cleanly_on_every_rank(cluster):
    cl = cluster(cp_size=2, device_pages=6, host_pages=2)  # 2 host pages per rank
    big = seq(10, 5)  # rank 0 and rank 1 own 2..3 pages each: more than the host holds
    cl.insert(big, seed=1)
    for c in cl.caches:
        node = c.root_node.children[next(iter(c.root_node.children))]
        assert not node.backuped and node.cp_hicache is None
        assert host_slots_in_use(c) == 0 and c.host_slot_ledger.used == [0, 0]
        assert c.cp_counters.write_failures >= 1 and not c.ongoing_write_through


def test_load_back_evicts_until_the_needed_owner_lane_has_room(cluster):
    # Logical pages 1..5 over 2 ranks: lane 0 = {2, 4}, lane 1 = {1, 3, 5}.
    cl = cluster(cp_size=2, device_pages=3, host_pages=8)
    a = seq(10_000, 1)
    cl.insert(a)  # lane 0 (page 2)
    cl.evict_device(P)
    for first in (20_000, 30_000, 40_000, 50_000):  # lanes 1, 0, 1, 0: lane 0 now full
        cl.insert(seq(first, 1))
    assert cl.stacks[0].allocator.lane_available_pages() == [0, 1]
    # The LRU device node sits in lane 1: evicting "one page" alone frees the wrong lane.
    report = cl.load_back(a)
    assert all(v.numel() == P for _, v, _ in report.loaded_per_rank)
    assert cl.check(a) == {}
    assert len({repr(CpCluster.tree_shape(c)) for c in cl.caches}) == 1


def test_a_short_lane_is_reclaimed_from_its_lru_leaf_on_every_rank(cluster):
    """When the least loaded lane has no free page, the allocator asks the
    cache to evict for that lane: the least recently used unlocked leaf
    holding a page of it goes (a backed-up one keeps its host copy), skipping
    older leaves of other lanes, identically on every rank; the page then
    comes from that lane and the host loads stay within a page."""
    cl = cluster(cp_size=2, device_pages=3, host_pages=8)  # lanes 0 = {2, 4}, 1 = {1, 3, 5}
    first, second = seq(10_000, 1), seq(20_000, 1)
    cl.insert(first)
    cl.insert(second)
    lanes_of = [int(n.cp_pages[0]) % 2 for n in cl.caches[0].root_node.children.values()]
    assert lanes_of == [1, 0]  # one page each; the older leaf sits in lane 1
    # A running request holds all free pages but one of lane 1 (not evictable).
    held = [s.allocator.alloc_with_owners_mirrored([0, 1]) for s in cl.stacks]
    assert cl.stacks[0].allocator.lane_available_pages() == [0, 1]
    # Lane 0 is now the least loaded in host slots ([P, 3P]); its only device
    # page is the newer leaf; lane 1's free page would make it [P, 4P].
    for s in cl.stacks:
        s.cache.host_slot_ledger.used[1] += 2 * P
    got = [s.allocator.alloc_mirrored(P) for s in cl.stacks]
    assert all(int(g.pages[0]) % 2 == 0 for g in got), [g.pages for g in got]
    for s in cl.stacks:
        older, newer = s.cache.root_node.children.values()
        assert not older.evicted, "the older leaf holds no lane-0 page: skipped"
        assert newer.evicted and newer.backuped, "the lane-0 leaf is evicted, its host copy kept"
        assert s.cache.cp_counters.lane_reclaim_tokens == P
        assert (s.allocator.lane_reclaims, s.allocator.uneven_picks) == (1, 0)
        s.cache.host_slot_ledger.used[1] -= 2 * P
    assert len({repr(CpCluster.tree_shape(c)) for c in cl.caches}) == 1
    for s, g, h in zip(cl.stacks, got, held):
        s.allocator.free_mirrored(torch.cat([g.pages, h.pages]))
    report = cl.load_back(second)  # the reclaimed leaf comes back, bit-exact
    assert all(v.numel() == P for _, v, _ in report.loaded_per_rank)
    assert cl.check(second) == {} and cl.check(first) == {}


def test_host_balance_policy_comes_from_the_environment(monkeypatch):
    from sglang_cp_hicache.sglang_0518.checks import HOST_BALANCE_ENV, host_balance_policy

    monkeypatch.delenv(HOST_BALANCE_ENV, raising=False)
    assert host_balance_policy() == "exact"
    monkeypatch.setenv(HOST_BALANCE_ENV, " Greedy ")
    assert host_balance_policy() == "greedy"
    monkeypatch.setenv(HOST_BALANCE_ENV, "balanced")
    with pytest.raises(ValueError, match=f"{HOST_BALANCE_ENV}='balanced' is not valid; use one of: exact, greedy"):
        host_balance_policy()


def test_greedy_host_balance_never_evicts_for_a_lane(cluster, monkeypatch):
    from sglang_cp_hicache.sglang_0518.checks import HOST_BALANCE_ENV

    monkeypatch.setenv(HOST_BALANCE_ENV, "greedy")
    cl = cluster(cp_size=2, device_pages=3, host_pages=8)
    for s in cl.stacks:
        assert s.cache.cp_host_balance == "greedy" and s.allocator._lanes.lane_reclaim is None
    monkeypatch.setenv(HOST_BALANCE_ENV, "exact")
    cl = cluster(cp_size=2, device_pages=3, host_pages=8)
    assert all(s.allocator._lanes.lane_reclaim == s.cache.cp_host.reclaim_lane for s in cl.stacks)


def test_ranks_with_different_host_balance_policies_refuse_to_start(monkeypatch):
    """The policy decides which device pages get evicted: ranks that differ
    would diverge, so the start-up agreement (one all-gather) refuses on
    every rank, naming the rank and both policies."""
    from sglang_cp_hicache.agreement import CpAgreementError
    from sglang_cp_hicache.sglang_0518 import hiradix
    from sglang_cp_hicache.sglang_0518.checks import HOST_BALANCE_ENV

    monkeypatch.setattr(hiradix, "host_balance_policy", lambda: "greedy" if building_rank() == 1 else "exact")
    outcomes = build_each_rank(CpStackConfig(cp_size=2, device_pages=3, host_pages=8), lambda r: RankSetup(r))
    expected = (
        f"CP ranks disagree on {HOST_BALANCE_ENV}: cp_rank 1 has 'greedy', cp_rank 0 has 'exact'; "
        f"start every rank with the same {HOST_BALANCE_ENV}"
    )
    assert [type(o) for o in outcomes] == [CpAgreementError] * 2
    assert [str(o) for o in outcomes] == [expected] * 2


def test_ranks_built_in_threads_read_their_own_published_settings():
    """SGLang reads ``hicache_ratio`` from its process-global runtime context;
    ranks built at once in threads must each read their own (else a rank with
    a different host pool is sized like its peer and the refusal below never
    fires: one CI run in many). Both threads publish before either reads."""
    import threading

    from sglang.srt.runtime_context import get_memory

    from sglang_cp_hicache.testing import env

    both_published = threading.Barrier(2)
    read = {}

    def rank(r: int) -> None:
        env.publish_server_args(env.make_cpu_server_args(page_size=P, hicache_ratio=2.0 + r))
        both_published.wait(timeout=10)
        read[r] = get_memory().hicache_ratio

    with runtime_context_per_thread():
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert read == {0: 2.0, 1: 3.0}


def test_ranks_with_different_host_pool_sizes_refuse_to_start():
    """Host pools are sized from the device pool; a rank whose pool differs
    would run out of host slots where the ledger says there is room: every
    rank refuses, naming the rank, both sizes and how to size the pools."""
    from sglang_cp_hicache.agreement import CpAgreementError

    config = CpStackConfig(cp_size=2, device_pages=3, host_pages=8)
    outcomes = build_each_rank(config, lambda r: RankSetup(r, {"host_pages": 6} if r == 1 else {}))
    expected = (
        f"CP ranks disagree on host_pool_slots: cp_rank 1 has {6 * P}, cp_rank 0 has {8 * P}; "
        "start every rank with the same host_pool_slots; host pools are sized from the device pool: "
        "size every rank's device pool with CpSharedPagedTokenToKVPoolAllocator.physical_size_for()"
    )
    assert [type(o) for o in outcomes] == [CpAgreementError] * 2
    assert [str(o) for o in outcomes] == [expected] * 2
