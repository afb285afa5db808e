"""Fault injection with rollback: after each fault the state is as before the
operation on every rank, nothing leaked, and the result is a clean refusal
or a clear error raised by every rank (never a hang, never a divergence).

Ranks run in threads with real gloo groups, so the step all-reduce that carries
each rank's failure status is a real collective.
"""

import pytest
import torch

from sglang_cp_hicache.sglang_0518.hiradix import CpHiCacheTransferError
from sglang_cp_hicache.testing.stack_0518 import CpStackConfig

from tests.helpers.cp_cluster import P, CpCluster, seq

N = 3


@pytest.fixture
def cl():
    with CpCluster(CpStackConfig(cp_size=N, device_pages=6, host_pages=10), threaded=True, timeout_s=30) as c:
        yield c


def snapshot(c):
    """Everything a rolled-back operation must leave as it found it."""
    cache = c.cache
    host = cache.token_to_kv_pool_host
    return (
        CpCluster.tree_shape(cache),
        host.available_size(),
        list(cache.host_slot_ledger.used),
        c.allocator.allocator_state_str(),
        len(cache.cache_controller.ack_write_queue),
        len(cache.cache_controller.ack_load_queue),
        len(cache.cache_controller.write_queue),
        len(cache.cache_controller.load_queue),
        sorted(cache.ongoing_write_through),
        sorted(cache.ongoing_load_back),
        cache.evictable_size_,
        cache.protected_size_,
    )


class FailOnce:
    """Wraps a callable; the first call (or the one after ``skip`` calls) fails."""

    def __init__(self, fn, *, exc=None, skip=0):
        self.fn, self.exc, self.skip, self.fired = fn, exc, skip, False

    def __call__(self, *a, **kw):
        if not self.fired:
            if self.skip == 0:
                self.fired = True
                if self.exc is not None:
                    raise self.exc
                return None
            self.skip -= 1
        return self.fn(*a, **kw)


def test_host_alloc_fails_on_one_rank_every_rank_refuses(cl):
    victim = cl.stacks[1]
    host = victim.cache.cache_controller.mem_pool_host
    host.alloc = FailOnce(host.alloc)
    before = [snapshot(s) for s in cl.stacks]
    tokens = seq(100, 3)
    cl.insert(tokens)
    assert host.alloc.fired
    for s, b in zip(cl.stacks, before):
        node = s.cache.root_node.children[next(iter(s.cache.root_node.children))]
        assert not node.backuped and node.cp_hicache is None  # nobody backed it up
        assert s.cache.token_to_kv_pool_host.available_size() == b[1]
        assert s.cache.host_slot_ledger.used == b[2]
        assert s.cache.cp_counters.write_failures == 1
    assert len({repr(CpCluster.tree_shape(c)) for c in cl.caches}) == 1
    # The next write of the same node succeeds everywhere.
    cl.insert(tokens)
    assert all(s.cache.root_node.children[next(iter(s.cache.root_node.children))].backuped for s in cl.stacks)


def test_copy_raises_midway_every_rank_rolls_back_and_raises(cl):
    victim = cl.stacks[2]
    kv_host = victim.cache.token_to_kv_pool_host.anchor_entry.host_pool
    kv_host.backup_from_device_all_layer = FailOnce(
        kv_host.backup_from_device_all_layer, exc=RuntimeError("DMA error (injected)")
    )
    tokens = seq(200, 3)  # round-robin allocation: every rank owns a page
    before = [snapshot(s) for s in cl.stacks]
    outcomes = cl.insert_outcomes(tokens)
    assert all(isinstance(o, CpHiCacheTransferError) for o in outcomes), outcomes
    assert "injected" in str(outcomes[2].__cause__)
    for s, b in zip(cl.stacks, before):
        after = snapshot(s)
        assert after[1:3] == b[1:3]  # host pool and ledger as before
        assert after[4:8] == b[4:8]  # no queued op, no stray ack
        assert not s.cache.ongoing_write_through
    assert len({repr(CpCluster.tree_shape(c)) for c in cl.caches}) == 1


def test_device_alloc_fails_at_load_back_on_one_rank_every_rank_takes_it_back(cl):
    """Every rank decides a load-back from the same allocator mirror, with no
    vote of its own. An allocation that fails on one rank although its lanes
    had room is an allocator fault: that rank reports it in the step's
    all-reduce, where every rank takes the step's load-backs back and raises,
    before any load ack is consumed."""
    tokens = seq(300, 3)
    cl.insert(tokens)
    cl.evict_device(3 * P)
    victim = cl.stacks[0]
    victim.allocator.alloc_with_owners_mirrored = FailOnce(victim.allocator.alloc_with_owners_mirrored)
    before = [snapshot(s) for s in cl.stacks]
    before_free = [s.allocator.available_size() for s in cl.stacks]
    outcomes = cl.load_back_outcomes(tokens)
    assert all(isinstance(o, CpHiCacheTransferError) for o in outcomes), outcomes
    assert "every lane had room" in str(outcomes[0].__cause__)
    for s, b, free in zip(cl.stacks, before, before_free):
        after = snapshot(s)
        assert after[0] == b[0], "nodes must be evicted again"
        assert after[1:3] == b[1:3]  # host pool and ledger as before
        assert after[4:8] == b[4:8]  # no queued op, no stray ack
        assert after[9:] == b[9:]  # no load-back in flight, sizes as before
        assert s.allocator.available_size() == free, "device pages must be free again"
    assert len({repr(CpCluster.tree_shape(c)) for c in cl.caches}) == 1
    assert len({s.allocator.allocator_state_str() for s in cl.stacks}) == 1
    # No fault now: the load-back succeeds, into the same pages on every rank.
    report = cl.load_back(tokens)
    assert all(v.numel() == 3 * P for _, v, _ in report.loaded_per_rank)
    assert all(torch.equal(v, report.loaded_per_rank[0][1]) for _, v, _ in report.loaded_per_rank)
    assert cl.check(tokens) == {}


def test_load_copy_raises_every_rank_undoes_the_load_back(cl):
    tokens = seq(400, 2)
    cl.insert(tokens)
    cl.evict_device(2 * P)
    victim = cl.stacks[1]
    idx_host = victim.cache.token_to_kv_pool_host.entry_map
    from sglang.srt.mem_cache.hicache_storage import PoolName

    pool = idx_host[PoolName.INDEXER].host_pool
    pool.load_to_device_per_layer = FailOnce(pool.load_to_device_per_layer, exc=RuntimeError("H2D fault (injected)"))
    before = [snapshot(s) for s in cl.stacks]
    before_free = cl.stacks[0].allocator.available_size()
    outcomes = cl.load_back_outcomes(tokens)
    assert all(isinstance(o, CpHiCacheTransferError) for o in outcomes), outcomes
    for s, b in zip(cl.stacks, before):
        after = snapshot(s)
        assert after[0] == b[0], "nodes must be evicted again"
        assert s.allocator.available_size() == before_free, "device pages must be free again"
        assert after[5] == b[5] and after[7] == b[7] and after[9:] == b[9:]
    # freed pages sit in the deferred lists now: identically on every rank
    assert len({s.allocator.allocator_state_str() for s in cl.stacks}) == 1
    report = cl.load_back(tokens)
    assert all(v.numel() == 2 * P for _, v, _ in report.loaded_per_rank)
    assert cl.check(tokens) == {}


def test_a_refused_and_a_failed_write_in_one_step_cut_at_the_first_and_every_rank_raises(cl):
    """Two ranks fail two different writes of one step: rank 0's host
    allocation comes up short for the first (REFUSED), rank 2's copy raises
    for the second (FAILED). Every rank takes both back (from the first on)
    and raises, from the one status folded into the step's ack words."""
    host0 = cl.stacks[0].cache.cache_controller.mem_pool_host
    host0.alloc = FailOnce(host0.alloc)
    kv_host2 = cl.stacks[2].cache.token_to_kv_pool_host.anchor_entry.host_pool
    kv_host2.backup_from_device_all_layer = FailOnce(
        kv_host2.backup_from_device_all_layer, exc=RuntimeError("DMA error (injected)"), skip=1
    )
    first, second = seq(500, 3), seq(900, 3)
    before = [snapshot(s) for s in cl.stacks]
    outcomes = cl.inserts_in_one_step(first, second)
    assert host0.alloc.fired and kv_host2.backup_from_device_all_layer.fired
    assert all(isinstance(o, CpHiCacheTransferError) for o in outcomes), outcomes
    assert "injected" in str(outcomes[2].__cause__)
    for s, b in zip(cl.stacks, before):
        after = snapshot(s)
        assert after[1:3] == b[1:3]  # host pool and ledger as before: both writes taken back
        assert after[4:8] == b[4:8]  # no queued op, no stray ack
        assert not s.cache.ongoing_write_through
        assert not any(n.backuped for n in s.cache.root_node.children.values())
        assert s.cache.cp_counters.write_failures == 2
    assert len({repr(CpCluster.tree_shape(c)) for c in cl.caches}) == 1
    # Nothing is left behind: both sequences back up on the next try.
    cl.insert(first)
    cl.insert(second)
    assert all(n.backuped for s in cl.stacks for n in s.cache.root_node.children.values())


def test_the_step_all_reduce_is_as_wide_as_sglangs_own(cl):
    """The status rides inside SGLang's two ack counts: every all-reduce the
    cache runs carries 2 int64 (a wider vector costs gloo ~10x the CPU)."""
    widths = []
    for s in cl.stacks:
        reduce = s.cache._all_reduce

        def counted(data, op, reduce=reduce):
            widths.append((data.dtype, data.numel()))
            return reduce(data, op)

        s.cache._all_reduce = counted
    tokens = seq(600, 3)
    cl.insert(tokens)
    cl.evict_device(3 * P)
    cl.load_back(tokens)
    cl.each(lambda s: s.cache._sync_hicache_ready_counts())
    cl.step()
    assert widths and set(widths) == {(torch.int64, 2)}
