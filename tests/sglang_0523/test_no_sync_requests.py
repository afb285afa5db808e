"""No host read of device locs when the scheduler releases requests on the
library stack: the tree's duplicate frees during the insert and the frees
of a request's own pages (its unaligned tail, its whole row when the insert
is declined), inside and outside a free group, through upstream's own
``release_kv_cache`` on real ``Req`` objects
(tests/helpers/sglang_0523/scenarios_request_free.py::no_sync_requests, two ranks,
one launch of its own).

Every device loc the allocator hands out and every ``req_to_token`` row is a
:class:`~tests.helpers.device_index.DeviceIndex`. Upstream's stack,
driven the same way, reads them at the first free of request pages: the
check can fail.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.sglang_0523.conftest import RANK_ENV


@pytest.fixture(scope="module")
def released(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from tests.helpers.sglang_0523.ranks import run_ranks
    from tests.helpers.sglang_0523.scenarios_request_free import no_sync_requests

    return run_ranks(no_sync_requests, 2, str(tmp_path_factory.mktemp("no_sync_requests")), env=RANK_ENV)


def test_request_and_duplicate_frees_never_read_device_locs_on_the_library_stack(released):
    for rank, result in enumerate(released):
        lib = result["library"]
        assert lib["first_read"] is None and lib["reads"] == [], (rank, lib["first_read"])
        assert lib["served"] == 11, rank
        frees = lib["device_frees"]
        assert frees["read_back"] == 0, rank
        # every kind of free was taken: the insert's duplicates (in and out of
        # a free group), the requests' own pages (8 unaligned tails and the
        # declined copy's row at least), evicted nodes
        assert frees["duplicates_from_phase"] >= 2 and frees["request_from_phase"] >= 9, rank
        assert frees["from_phase"] >= 3 and frees["held_in_group"] >= 6, rank
        assert lib["loaded"] > 0 and lib["host_room"]["backups"] >= 4, rank  # write-through and load-back
        assert lib["verified_pages"] > 0 and lib["corrupted_pages"] == 0, rank
        assert lib["leaks"] == [], rank  # every page and row back where it belongs


def test_upstreams_stack_reads_them_when_a_batch_of_requests_is_released(released):
    """PageInterleavePoolAllocator.free: torch.unique of the freed locs, here
    the free group's one free at free_group_end (a device-to-host sync on a GPU)."""
    for rank, result in enumerate(released):
        up = result["upstream"]
        assert up["reads"] == ["unique"], rank
        assert up["first_read"][-1] == "sglang/srt/mem_cache/allocator/page_interleave.py:349 free", rank
        assert up["served"] < 11, rank
