"""A step that raises leaves every rank as it was before the step's writes and
load-backs: one regression test per way it did not (three threaded ranks,
real gloo groups; every rank compared with :func:`rank_state` before/after).

* a refused and then a failed write on ONE rank: every rank raises, with
  the copy's error as the cause;
* a request that split a restored node, or inserted below it, in the step:
  every piece evicted again, the new nodes removed, their pages free;
* a load queued but never started (its batch dropped): dropped too, so the
  retry starts no stale copy;
* a rank whose load-back allocation failed keeps evicting exactly as the
  others for the step's later load-backs;
* host slots a write planned before its planning raised are freed.
"""

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.radix_cache import RadixKey

from sglang_cp_hicache.policy_0518.plan import page_owners_of
from sglang_cp_hicache.sglang_0518.hiradix import CpHiCacheTransferError
from sglang_cp_hicache.testing.stack_0518 import CpStackConfig

from tests.helpers.cp_cluster import P, CpCluster, seq
from tests.helpers.rank_snapshot import FailOn, exact_allocator, rank_state, shared_view

N = 3


@pytest.fixture
def cl():
    with CpCluster(CpStackConfig(cp_size=N, device_pages=6, host_pages=10), threaded=True, timeout_s=30) as c:
        yield c


def backed_up_and_evicted(cl, *sequences):
    for tokens in sequences:
        cl.insert(tokens)
    cl.evict_device(sum(len(t) for t in sequences))
    assert all(cl.device_locs(t)[0].numel() == 0 for t in sequences)


def backup_copy_fails(stack, calls=(0,)):
    """The KV backup of this rank raises on its ``calls``-th non-empty copy."""
    pool = stack.cache.token_to_kv_pool_host.anchor_entry.host_pool
    pool.backup_from_device_all_layer = FailOn(
        pool.backup_from_device_all_layer, calls, exc=RuntimeError("DMA error (injected)"),
        when=lambda device_pool, host_indices, *a: host_indices.numel() > 0,
    )
    return pool.backup_from_device_all_layer


def load_copy_fails(stack):
    pool = stack.cache.token_to_kv_pool_host.entry_map[PoolName.INDEXER].host_pool
    pool.load_to_device_per_layer = FailOn(
        pool.load_to_device_per_layer, exc=RuntimeError("H2D fault (injected)")
    )
    return pool.load_to_device_per_layer


def assert_as_before(cl, before):
    for s, b in zip(cl.stacks, before):
        after = rank_state(s)
        for key in b:
            assert after[key] == b[key], f"cp_rank {s.cp_rank}: {key} differs from before the step"


def test_a_refused_then_a_failed_write_on_one_rank_makes_every_rank_raise_with_its_error(cl):
    """Rank 1's host allocation comes up short for the first write (REFUSED),
    then its copy raises for the second (FAILED): the FAILED must win on that
    rank, so every rank raises and rank 1's raise carries the copy's error."""
    first, second = seq(500, 3), seq(900, 3)
    cl.insert_resident(first)
    cl.insert_resident(second)
    victim = cl.stacks[1]
    host = victim.cache.cache_controller.mem_pool_host
    host.alloc = FailOn(host.alloc)
    copy = backup_copy_fails(victim)
    before = [rank_state(s) for s in cl.stacks]
    outcomes = cl.inserts_in_one_step(first, second)
    assert host.alloc.fired and copy.fired
    assert all(isinstance(o, CpHiCacheTransferError) for o in outcomes), outcomes
    assert "DMA error (injected)" in str(outcomes[1].__cause__)
    assert_as_before(cl, before)
    cl.insert(first)
    cl.insert(second)
    assert all(n.backuped for s in cl.stacks for n in s.cache.root_node.children.values())


def test_plan_write_raising_after_taking_host_slots_frees_them(cl):
    """The pool-transfer step of planning a write raises on rank 2 after its
    host slots were taken: they go back, so rank 2's pool and ledger agree."""
    tokens = seq(100, 3)  # every rank owns a page: rank 2 takes host slots
    cl.insert_resident(tokens)
    ctrl = cl.stacks[2].cache.cache_controller
    ctrl._resolve_pool_transfers_allocation = FailOn(
        ctrl._resolve_pool_transfers_allocation, exc=RuntimeError("pool transfer (injected)"),
        when=lambda extra_pools, alloc_host, **kw: alloc_host,
    )
    before = [rank_state(s) for s in cl.stacks]
    outcomes = cl.insert_outcomes(tokens)
    assert ctrl._resolve_pool_transfers_allocation.fired
    assert all(isinstance(o, CpHiCacheTransferError) for o in outcomes), outcomes
    assert "pool transfer (injected)" in str(outcomes[2].__cause__)
    assert_as_before(cl, before)
    cl.insert(tokens)  # backs up everywhere now
    for s in cl.stacks:
        node = s.cache.root_node.children[next(iter(s.cache.root_node.children))]
        assert node.backuped
        host = s.cache.token_to_kv_pool_host
        assert host.size - host.available_size() == node.cp_hicache.num_host_slots
        assert s.cache.host_slot_ledger.used[s.cp_rank] == node.cp_hicache.num_host_slots


@pytest.mark.parametrize("request_kind", ["split", "child"])
def test_what_a_request_built_on_a_restored_node_is_taken_back_with_it(cl, request_kind):
    """In the step, after the load-back, a request either splits the restored
    node (it shares its first page only) or extends it by a page. The H2D
    copy raises on rank 1: every piece of the restored node goes off the
    device again, the request's new node goes, and every page is free."""
    tokens = seq(300, 3)
    backed_up_and_evicted(cl, tokens)
    request = tokens[:P] + seq(5000, 2) if request_kind == "split" else tokens + seq(5000, 1)
    load_copy_fails(cl.stacks[1])
    before = [rank_state(s) for s in cl.stacks]
    insert_request = cl._insert_fn(request, check=False)

    def step(s):
        cl.start_load_back(s, tokens)
        insert_request(s)
        s.cache.writing_check()

    outcomes = cl.each(step, return_exceptions=True)
    assert all(isinstance(o, CpHiCacheTransferError) for o in outcomes), outcomes
    assert_as_before(cl, before)
    for locs in cl.device_locs(request):
        assert locs.numel() == 0, "nothing of the step may stay on the device"
    # The retry restores the same bytes.
    report = cl.load_back(tokens)
    assert all(v.numel() == 3 * P for _, v, _ in report.loaded_per_rank)
    assert cl.check(tokens) == {}


def test_a_load_queued_but_not_started_is_taken_back_too(cl):
    """SGLang's order when a batch is dropped: the load-back is queued, its
    copy never started, and the step's all-reduce comes first. A backup copy
    raising on rank 0 takes everything back: the queued load must go too,
    or the retry starts a stale copy into freed pages."""
    restored, written = seq(300, 3), seq(700, 3)
    backed_up_and_evicted(cl, restored)
    cl.insert_resident(written)
    backup_copy_fails(cl.stacks[0])
    before = [rank_state(s) for s in cl.stacks]
    write = cl._insert_fn(written, check=False)

    def step(s):
        write(s)
        cl.start_load_back(s, restored, start=False)  # the batch is dropped
        s.cache.check_hicache_events()

    outcomes = cl.each(step, return_exceptions=True)
    assert all(isinstance(o, CpHiCacheTransferError) for o in outcomes), outcomes
    assert_as_before(cl, before)
    assert all(len(c.cache_controller.load_queue) == 0 for c in cl.caches)
    report = cl.load_back(restored)
    assert all(v.numel() == 3 * P for _, v, _ in report.loaded_per_rank)
    assert cl.check(restored) == {}
    cl.insert(written)
    assert cl.check(written) == {}


def test_a_rank_whose_load_back_allocation_failed_evicts_as_the_others(cl):
    """Load-back 1 fits without evicting; its device allocation fails on
    rank 0 only. Load-back 2 of the same step needs evictions on every rank:
    rank 0 must evict the same nodes (it counts the pages the others took
    for load-back 1), so after the step's take-back the ranks still agree.
    (The quota counts evictable tokens, as a scheduler's may: SGLang 0.5.18
    passes none, and the cache's own leaves no room to evict for.)"""
    first, second = seq(300, 3), seq(700, 3)
    backed_up_and_evicted(cl, first, second)
    need = []
    for tokens in (first, second):
        node = cl.caches[0].match_prefix(MatchPrefixParams(key=RadixKey(tokens))).last_host_node
        owners = page_owners_of([node.cp_hicache], P)
        need.append([owners.count(lane) for lane in range(N)])
    filler = 10_000
    while True:  # fill the device until the first fits and both do not
        lanes = cl.stacks[0].allocator.lane_available_pages()
        assert all(a >= n for a, n in zip(lanes, need[0])), "scenario: load-back 1 must fit"
        if any(a < n1 + n2 for a, n1, n2 in zip(lanes, *need)):
            break
        cl.insert(seq(filler, 1))
        filler += P
    victim = cl.stacks[0].allocator
    victim.alloc_with_owners_mirrored = FailOn(victim.alloc_with_owners_mirrored)

    evicted = []

    def step(s):
        cl.start_load_back(s, first, start=False, mem_quota=10**9)
        free = s.allocator.available_size()
        restored = cl.start_load_back(s, second, mem_quota=10**9)
        evicted.append((s.cp_rank, restored, s.allocator.available_size() + restored - free))
        s.cache.check_hicache_events()

    outcomes = cl.each(step, return_exceptions=True)
    assert victim.alloc_with_owners_mirrored.fired
    assert {r: (n, e) for r, n, e in evicted} == {r: (3 * P, evicted[0][2]) for r in range(N)}
    assert evicted[0][2] > 0, "scenario: load-back 2 must evict"
    assert all(isinstance(o, CpHiCacheTransferError) for o in outcomes), outcomes
    assert "every lane had room" in str(outcomes[0].__cause__)
    views = [shared_view(rank_state(s)) for s in cl.stacks]
    for key in views[0]:
        assert all(v[key] == views[0][key] for v in views), f"ranks differ in {key}"
    assert len({repr(exact_allocator(s.allocator)) for s in cl.stacks}) == 1
    for tokens in (first, second):
        report = cl.load_back(tokens)
        assert all(torch.equal(v, report.loaded_per_rank[0][1]) for _, v, _ in report.loaded_per_rank)
        assert cl.check(tokens) == {}
