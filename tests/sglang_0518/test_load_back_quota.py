"""0.5.18's scheduler passes no load-back quota: the cache's own counts the
device pages eviction can free, as stock ``HiRadixCache`` (whose load-back
evicts, then retries) and 0.5.23 do, and still keeps the request's own new
tokens' room. A quota of free pages only threw most host hits away once the
device filled up with cached pages."""

from types import SimpleNamespace

import torch
from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from sglang_cp_hicache.testing.stack_0518 import CpStackConfig

from tests.helpers.cp_cluster import P, CpCluster, seq


def _scheduler_load_back(tokens: list[int], own_pages: int):
    """One rank's ``PrefillAdder`` call shape: the request, no quota."""

    def run(s):
        c = s.cache
        m = c.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        req = SimpleNamespace(fill_ids=tokens + list(range(own_pages * P)), prefix_indices=m.device_indices)
        c.inc_lock_ref(m.last_device_node)  # PrefillAdder._lock_node
        try:
            vals, _ = c.init_load_back(InitLoadBackParams(
                best_match_node=m.last_host_node, host_hit_length=m.host_hit_length, req=req,
            ))
        finally:
            c.dec_lock_ref(m.last_device_node)
        c.ready_to_load_host_cache()
        c.writing_check()
        c.loading_check()
        return int(vals.numel())

    return run


def test_a_host_hit_is_loaded_back_when_evictable_pages_cover_it():
    cl = CpCluster(CpStackConfig(cp_size=2, device_pages=6, host_pages=12))  # 11 usable logical pages
    try:
        a, b = seq(10, 4), seq(50_000, 9)
        cl.insert(a)
        cl.step()
        cl.evict_device(len(a))  # a: host only
        cl.insert(b)
        cl.step()  # b: on device and backed up; 2 pages free
        for c in cl.caches:
            assert c.token_to_kv_pool_allocator.available_size() == 2 * P
            assert c.evictable_size() == len(b)
        # Own tokens that need every page eviction could free: declined, nothing evicted.
        assert cl.each(_scheduler_load_back(a, own_pages=9)) == [0, 0]
        for c in cl.caches:
            assert c.evictable_size() == len(b) and c.token_to_kv_pool_allocator.available_size() == 2 * P
            assert c.cp_counters.load_back_declined_tokens == len(a)
        # One own page: b is evicted (still on host) and a comes back, bit-exact.
        assert cl.each(_scheduler_load_back(a, own_pages=1)) == [len(a), len(a)]
        assert cl.check(a) == {}
        for c in cl.caches:
            assert c.cp_counters.load_backs == 1 and c.cp_counters.load_back_tokens == len(a)
            assert c.cp_counters.load_back_declined_tokens == len(a)  # only the first call's
            m = c.match_prefix(MatchPrefixParams(key=RadixKey(b)))
            assert len(m.device_indices) < len(b) and m.host_hit_length + len(m.device_indices) == len(b)
    finally:
        cl.close()


def test_the_quota_counts_evictable_tokens_less_the_request_own():
    cl = CpCluster(CpStackConfig(cp_size=2, device_pages=6, host_pages=12))
    try:
        a, b = seq(10, 4), seq(50_000, 5)
        cl.insert(a)
        cl.step()
        cl.evict_device(len(a))
        cl.insert(b)
        cl.step()
        c = cl.caches[0]
        m = c.match_prefix(MatchPrefixParams(key=RadixKey(a)))
        req = SimpleNamespace(fill_ids=a + list(range(3 * P)), prefix_indices=torch.empty(0))
        params = InitLoadBackParams(best_match_node=m.last_host_node, host_hit_length=m.host_hit_length, req=req)
        free = c.token_to_kv_pool_allocator.available_size()
        assert c.load_back_mem_quota(params) == free + len(b) - 4 * P  # 3 own pages + 1 of slack
    finally:
        cl.close()


def test_the_hit_own_path_is_never_counted_as_room():
    """The only evictable pages are the hit's own device prefix: they are
    locked while the quota is applied, so the hit is declined and the
    prefix stays on the device."""
    cl = CpCluster(CpStackConfig(cp_size=2, device_pages=6, host_pages=12))  # 11 usable logical pages
    try:
        a, tail, c = seq(10, 2), seq(5_000, 3), seq(90_000, 8)
        cl.insert(a)
        cl.insert(a + tail)
        cl.step()
        cl.evict_device(len(tail))  # the tail leaf: host only; a stays on the device
        cl.insert(c)
        cl.step()
        for cache in cl.caches:  # c held by a running request
            cache.inc_lock_ref(cache.match_prefix(MatchPrefixParams(key=RadixKey(c))).last_device_node)
            assert cache.evictable_size() == len(a) and cache.token_to_kv_pool_allocator.available_size() == P
        assert cl.each(lambda s: CpCluster.start_load_back(s, a + tail)) == [0, 0]
        for cache in cl.caches:
            m = cache.match_prefix(MatchPrefixParams(key=RadixKey(a + tail)))
            assert len(m.device_indices) == len(a) and m.host_hit_length == len(tail)
            assert cache.evictable_size() == len(a)  # nothing evicted
            assert cache.cp_counters.load_back_declined_tokens == len(tail)
    finally:
        cl.close()
