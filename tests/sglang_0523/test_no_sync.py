"""No host read of device locs on the library stack's write-through, device
eviction, host eviction and load-back paths, upstream's code on those paths
included (tests/helpers/sglang_0523/scenarios_bookkeeping.py::no_sync, two ranks).

Every device loc the allocator hands out or holds is a
:class:`~tests.helpers.device_index.DeviceIndex`; only the copy kernels
and the content fill and check (the forward pass's work) may read one.
Upstream's stack, driven the same way, reads them at its first device
eviction: the check can fail.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.device_index import DeviceIndex, HostRead, device_side, wrap
from tests.helpers.sglang_0523.scenarios_bookkeeping import _chains


def test_the_wrapper_catches_host_reads():
    locs = wrap(torch.arange(8))
    for read in (lambda: locs.tolist(), lambda: locs.to("cpu"), lambda: int(locs[0]), lambda: bool(locs.any()),
                 lambda: locs[locs > 3], lambda: torch.nonzero(locs), lambda: locs.cpu(), lambda: locs[0].item(),
                 lambda: torch.unique(locs // 2), lambda: repr(locs)):
        with pytest.raises(HostRead):
            read()
    # device-side arithmetic, sorting, slicing, concatenation and metadata are fine
    assert len(torch.cat([locs[2:6] * 2 + 1, torch.sort(locs).values])) == 12 and locs.numel() == 8
    with device_side():
        assert locs.tolist() == list(range(8))
    DeviceIndex.reads.clear()


def test_write_evict_load_back_never_read_device_locs_on_the_library_stack(two_ranks):
    for rank, result in enumerate(two_ranks):
        lib = result["no_sync"]["library"]
        assert lib["first_read"] is None and lib["reads"] == [], (rank, lib["first_read"])
        assert lib["served"] == len(_chains()), rank
        # every path was taken
        assert lib["copies"]["kv_backups"] >= 3 and lib["copies"]["indexer_backups"] >= 3, rank  # write-through
        assert lib["device_frees"]["from_phase"] >= 3 and lib["device_frees"]["read_back"] == 0, rank
        assert lib["host_room"]["leaves_evicted"] >= 1, rank  # host eviction
        assert lib["loaded"] > 0 and lib["copies"]["kv_layer_loads"] > 0, rank  # load-back
        assert lib["copies"]["indexer_layer_loads"] > 0, rank
        assert lib["verified_pages"] > 0 and lib["corrupted_pages"] == 0, rank


def test_upstreams_stack_reads_them_at_its_first_device_eviction(two_ranks):
    """PageInterleavePoolAllocator.free: torch.unique of the freed locs (a
    device-to-host sync per device eviction on a GPU)."""
    for rank, result in enumerate(two_ranks):
        up = result["no_sync"]["upstream"]
        assert up["reads"] == ["unique"], rank
        assert up["first_read"][-2:] == [
            "sglang/srt/mem_cache/allocator/page_interleave.py:371 free_segment",
            "sglang/srt/mem_cache/allocator/page_interleave.py:349 free",
        ], rank
        assert up["served"] < len(_chains()), rank
