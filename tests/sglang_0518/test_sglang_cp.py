"""Real SGLang 0.5.18 HiRadixCache in CP mode, N ranks in one process, on CPU."""

import pytest
import torch

from sglang_cp_hicache.testing.stack_0518 import CpStackConfig

from tests.helpers.cp_cluster import CpCluster

P = 64


def seq(first: int, pages: int) -> list[int]:
    return list(range(first, first + pages * P))


@pytest.fixture
def cluster_factory(request):
    made = []

    def make(threaded=False, **kw):
        c = CpCluster(CpStackConfig(**kw), threaded=threaded)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("host_layout", ["layer_first", "page_first", "page_first_direct"])
def test_backup_evict_load_back_restores_every_owned_byte(cluster_factory, cp_size, host_layout, threaded):
    cl = cluster_factory(threaded=threaded, cp_size=cp_size, device_pages=6, host_pages=12, host_layout=host_layout,
                         io_backend="direct" if host_layout == "page_first_direct" else "kernel")
    tokens = seq(1000, 5)  # 5 pages: with N=4 some rank owns 2 pages, some 1
    cl.insert(tokens, seed=7)
    assert cl.check(tokens, seed=7) == {}
    cl.evict_device(len(tokens))
    for s in cl.stacks:  # poison: only restored bytes can pass the check
        for layer in range(s.kv_pool.layer_num):
            s.kv_pool.kv_buffer[layer].view(torch.uint8).fill_(0xA5)
            s.kv_pool.index_k_with_scale_buffer[layer].fill_(0xA5)
    assert all(len(d) == 0 for d in cl.device_locs(tokens))
    rep = cl.load_back(tokens)
    for prefix, vals, host_hit in rep.loaded_per_rank:
        assert host_hit == len(tokens) and vals.numel() == len(tokens)
    # every rank restored the same logical locs, with the same page owners as before
    locs = [v for _, v, _ in rep.loaded_per_rank]
    assert all(torch.equal(locs[0], l) for l in locs)
    assert cl.check(tokens, seed=7) == {}
    assert len({cl.tree_shape(c).__repr__() for c in cl.caches}) == 1
    counts = cl.ack_counts()
    assert counts == [counts[0]] * cp_size and counts[0] == (1, 1)


def test_zero_owned_rank_acks_and_stays_in_step(cluster_factory):
    cl = cluster_factory(cp_size=4, device_pages=4, host_pages=8)
    tokens = seq(5, 1)  # one page: exactly one rank owns it
    cl.insert(tokens, seed=3)
    owners = [s.allocator.placement.owner_of(cl.device_locs(tokens)[0][:1]).item() for s in cl.stacks]
    assert len(set(owners)) == 1
    stats = [c.cp_transfer.stats for c in cl.caches]
    assert sorted(s.zero_owned_writes for s in stats) == [0, 1, 1, 1]
    for c in cl.caches:
        assert not c.cache_controller.ack_write_queue  # every rank's ack was consumed
        node = c.root_node.children[next(iter(c.root_node.children))]
        assert node.backuped and node.host_len == P and node.host_value is None
    cl.evict_device(P)
    cl.load_back(tokens)
    assert [c.cp_transfer.stats.zero_owned_loads for c in cl.caches].count(1) == 3
    assert all(not c.cache_controller.ack_load_queue for c in cl.caches)
    assert all(not c.ongoing_load_back for c in cl.caches)
    assert cl.check(tokens, seed=3) == {}


def test_value_stays_logical_and_host_value_unused(cluster_factory):
    cl = cluster_factory(cp_size=2, device_pages=6, host_pages=12)
    tokens = seq(50, 3)
    locs = cl.insert(tokens, seed=1)
    for c, l in zip(cl.caches, locs):
        node = c.root_node.children[next(iter(c.root_node.children))]
        assert torch.equal(node.value, l)  # full logical locs, identical on every rank
        assert node.host_value is None
        meta = node.cp_hicache
        assert meta.logical_len == 3 * P
        placement = c.cp_placement
        assert torch.equal(meta.owned_positions, torch.nonzero(placement.owned_by_this_rank(l)).reshape(-1))
        assert meta.num_host_slots == int(placement.owned_by_this_rank(l).sum())


def test_partial_match_splits_cp_metadata(cluster_factory):
    cl = cluster_factory(cp_size=2, device_pages=8, host_pages=16)
    a = seq(100, 4)
    cl.insert(a, seed=2)
    b = a[: 2 * P] + seq(9000, 2)  # shares 2 pages, then diverges
    cl.insert(b, seed=2)
    for c in cl.caches:
        top = c.root_node.children[next(iter(c.root_node.children))]
        assert len(top.key) == 2 * P and top.host_len == 2 * P
        assert len(top.children) == 2
        total = top.cp_hicache.num_host_slots + sum(ch.cp_hicache.num_host_slots for ch in top.children.values())
        # host slots in use == sum over nodes (no leak from the split)
        assert c.token_to_kv_pool_host.size - c.token_to_kv_pool_host.available_size() == total
    cl.evict_device(8 * P)
    cl.load_back(a)
    assert cl.check(a, seed=2) == {}
