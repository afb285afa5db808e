"""No device->host read on the CP write, host-eviction and load-back paths.

Every device-side index tensor the allocator hands out (and so every node
value, match result and load-back result derived from it) is a
:class:`~tests.helpers.device_index.DeviceIndex`: any host read of it --
``.cpu()``, ``.to("cpu")``,
``.tolist()``, ``.item()``, ``int()``, ``bool()``, ``nonzero``, ``unique``,
boolean-mask indexing, ``masked_select``, ``bincount``, ``torch.equal`` --
raises :class:`HostRead`. Only "device work" may look at the values: the copy
kernels (the dispatcher's four functions and the bound pool copies the
server path calls) and the test's own content fill and
check (the forward pass's job on a real server); both run inside
:func:`device_side`.

On a GPU the same sequence runs under ``torch.cuda.set_sync_debug_mode("error")``
(skipped without CUDA).
"""

from __future__ import annotations

import pytest
import torch

from sglang_cp_hicache.policy_0518.allocator import OwnerLaneAllocator, PageAllocation
from sglang_cp_hicache.kernels import transfer
from sglang_cp_hicache.kernels.bound import PoolCopies
from sglang_cp_hicache.sglang_0518.hiradix import CpInsertParams
from sglang_cp_hicache.testing.stack_0518 import CpStackConfig

from tests.helpers.cp_cluster import P, CpCluster, seq
from tests.helpers.device_index import DeviceIndex, HostRead, device_side, unwrap

N = 3


@pytest.fixture
def no_host_reads(monkeypatch, harness_is_device_work):
    """Wrap every allocation's device locs; let only device work read them."""
    make = OwnerLaneAllocator._allocation

    def wrapped_allocation(self, pages) -> PageAllocation:
        got = make(self, pages)
        return PageAllocation(locs=got.locs.as_subclass(DeviceIndex), pages=got.pages)

    monkeypatch.setattr(OwnerLaneAllocator, "_allocation", wrapped_allocation)
    copies = [
        (transfer, name)
        for name in ("backup_kv_all_layers", "load_kv_one_layer", "backup_indexer_all_layers", "load_indexer_one_layer")
    ]
    copies += [(PoolCopies, "backup"), (PoolCopies, "load")]  # the bound copies the server path uses
    for owner, name in copies:
        kernel = getattr(owner, name)

        def on_device(*args, _kernel=kernel, **kwargs):
            with device_side():
                return _kernel(*unwrap(args), **{k: unwrap(v) for k, v in kwargs.items()})

        monkeypatch.setattr(owner, name, on_device)


@pytest.fixture
def harness_is_device_work(monkeypatch):
    """The test's content fill and check stand for the forward pass."""
    for name in ("_fill", "mismatches"):
        harness = getattr(CpCluster, name)

        def as_device_work(self, *args, _fn=harness, **kwargs):
            with device_side():
                return _fn(self, *unwrap(args), **kwargs)

        monkeypatch.setattr(CpCluster, name, as_device_work)


def drive(cl: CpCluster) -> dict:
    """Writes (write-through), device eviction, host eviction, load-backs."""
    a, b, c, d = seq(1_000, 5), seq(1_000, 8), seq(50_000, 4), seq(90_000, 6)
    cl.insert(a)
    cl.insert(b)  # extends a: a split-free chain continuation
    cl.insert(c)
    cl.step()
    cl.evict_device(20 * P)
    cl.insert(d)  # host pool too small for all of it: host eviction
    cl.step()
    cl.evict_device(20 * P)
    reports = {}
    for name, tokens in (("b", b), ("c", c), ("d", d)):
        reports[name] = cl.load_back(tokens)
        cl.step()
    return {name: cl.check(tokens) for name, tokens in (("b", b), ("c", c), ("d", d))}


def test_the_wrapper_catches_host_reads(no_host_reads):
    locs = torch.arange(8).as_subclass(DeviceIndex)
    for read in (lambda: locs.tolist(), lambda: locs.to("cpu"), lambda: int(locs[0]), lambda: bool(locs.any()),
                 lambda: locs[locs > 3], lambda: torch.nonzero(locs), lambda: locs.cpu(), lambda: locs[0].item()):
        with pytest.raises(HostRead):
            read()
    # Device-side arithmetic, slicing and metadata are fine.
    assert len((locs[2:6] * 2 + 1).clone()) == 4 and locs.numel() == 8
    with device_side():
        assert locs.tolist() == list(range(8))


def test_write_evict_load_back_never_reads_device_indices(no_host_reads):
    cl = CpCluster(CpStackConfig(cp_size=N, device_pages=6, host_pages=4), threaded=True, timeout_s=60)
    try:
        transfer.reset_copy_stats()
        bad = drive(cl)
        assert bad == {"b": {}, "c": {}, "d": {}}
        for cache in cl.caches:
            assert cache.cp_counters.device_page_reads == 0
            assert cache.cp_counters.load_backs >= 2
            assert cache.cp_counters.host_evicted_nodes >= 1
        stats = transfer.copy_stats()
        assert stats.kv_backup_calls > 0 and stats.kv_load_calls > 0
        assert stats.indexer_backup_calls > 0 and stats.indexer_load_calls > 0
        assert stats.cp_size == N
    finally:
        cl.close()


def test_an_insert_without_the_page_mirror_is_caught(no_host_reads):
    """The test can fail: the fallback (reading the node's locs back) is a host read."""
    cl = CpCluster(CpStackConfig(cp_size=1, device_pages=6, host_pages=6))
    try:
        s = cl.stacks[0]
        got = s.allocator.alloc_mirrored(2 * P)
        from sglang.srt.mem_cache.radix_cache import RadixKey

        with pytest.raises(HostRead):
            s.cache.insert(CpInsertParams(key=RadixKey(seq(7, 2)), value=got.locs))
    finally:
        cl.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_write_evict_load_back_cuda_no_sync(harness_is_device_work):  # pragma: no cover - GPU only
    """The same sequence on a GPU under set_sync_debug_mode("error"). The
    ranks run one after the other in this thread (each with a one-rank
    group: the allocators are deterministic, so they stay in step), because
    the debug mode is process-wide and the harness's own fill and check --
    which do sync -- must switch it off without hiding another rank's sync."""
    cl = CpCluster(CpStackConfig(cp_size=N, device_pages=6, host_pages=6, device="cuda"))
    try:
        torch.cuda.set_sync_debug_mode("error")
        try:
            bad = drive(cl)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert bad == {"b": {}, "c": {}, "d": {}}
    finally:
        cl.close()
