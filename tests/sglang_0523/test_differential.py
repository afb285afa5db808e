"""Library vs upstream on SGLang 0.5.23's real sharded stack, same requests.

Per rank process, the same round trip runs on two stacks built side by side:
upstream's copy path (``owned_rows`` + the stock ops) and this library's
kernels (Triton, interpreted). Requests: A (a new chain), B (extends A), C (a
second chain), write-through, evict everything, poison the device, a filler
chain (so load-backs land elsewhere), then B and C again from host. Host and
device buffers start poisoned, so an unwritten or misplaced byte shows.
"""

from __future__ import annotations

from typing import Any

import pytest

#: (world size, host layout) pairs run; CP 3 (not a power of two) on the
#: layout with the most involved host addressing.
CASES = [(2, "layer_first"), (2, "page_first"), (3, "page_first")]


@pytest.fixture(params=CASES, ids=[f"cp{n}-{layout}" for n, layout in CASES])
def case(
    request: pytest.FixtureRequest, two_ranks: list[dict[str, Any]], three_ranks: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], str]:
    # Both launches named as arguments (not fetched by name): pytest-xdist then
    # keeps these tests on the worker that already holds the launches.
    world, layout = request.param
    if world == 2:
        return [r["differential"] for r in two_ranks], layout
    return three_ranks, layout


def test_library_path_ran_on_the_triton_kernels(case):
    ranks, layout = case
    for rank, result in enumerate(ranks):
        assert result["backend"] == "triton-interpret", rank
        counters = result[layout]["library_counters"]
        assert counters["kv_backups"] > 0 and counters["indexer_backups"] > 0, (rank, layout, counters)
        assert counters["kv_layer_loads"] > 0 and counters["indexer_layer_loads"] > 0, (rank, layout, counters)


def test_host_bytes_after_backup_are_identical(case):
    ranks, layout = case
    # Same logical host slots on both paths, and the KV and indexer host
    # buffers byte for byte equal (poison where nothing was written).
    for rank, result in enumerate(ranks):
        r = result[layout]
        assert r["same_backed_up_nodes"], (rank, layout)
        assert r["host_bytes_equal"] == [True, True], (rank, layout, "kv, indexer")


def test_host_slot_owners_follow_device_owners_after_backup(case):
    ranks, layout = case
    for rank, result in enumerate(ranks):
        r = result[layout]
        assert r["host_owner_mismatch"] == [], (rank, layout)
        for path in ("upstream", "library"):
            for req in ("B", "C"):
                p = r["paths"][path][req]
                assert p["backup_host_owners"] == p["backup_device_owners"], (rank, layout, path, req)


def test_restored_pages_keep_their_owners_and_move(case):
    ranks, layout = case
    world = len(ranks)
    for rank, result in enumerate(ranks):
        r = result[layout]
        assert r["same_restored_nodes"], (rank, layout)
        for path in ("upstream", "library"):
            for req, pages in (("B", 8), ("C", 3)):
                p = r["paths"][path][req]
                assert p["backup_tokens"] == p["restored_tokens"] == pages * 64, (rank, layout, path, req)
                assert p["restored_device_owners"] == p["backup_device_owners"], (rank, layout, path, req)
                # one chain: owners cycle through every rank
                owners = p["backup_device_owners"]
                assert owners == [(owners[0] + i) % world for i in range(pages)], (rank, path, req)
                assert p["moved"], (rank, layout, path, req)  # the filler took the old pages


def test_restored_device_bytes_are_identical_and_exact(case):
    ranks, layout = case
    for rank, result in enumerate(ranks):
        r = result[layout]
        assert r["device_bytes_equal"] == [True] * 4, (rank, layout, "kv[0], kv[1], index[0], index[1]")
        up, lib = r["per_path"]["upstream"], r["per_path"]["library"]
        for name, stats in (("upstream", up), ("library", lib)):
            assert stats["corrupted_pages"] == 0, (rank, layout, name)
            assert stats["restored_pages_verified"] > 0, (rank, layout, name)
            assert stats["invariant_violations"] == [], (rank, layout, name)
        for key in ("loaded_tokens", "host_hit_tokens", "restored_pages_verified", "backup_slots", "load_slots",
                    "evicted", "digest"):
            assert up[key] == lib[key], (rank, layout, key)
        assert up["loaded_tokens"][-2:] == [8 * 64, 3 * 64], (rank, layout)


def test_ranks_agree_on_every_decision(case):
    ranks, layout = case
    digests = {result[layout]["per_path"][path]["digest"] for result in ranks for path in ("upstream", "library")}
    assert len(digests) == 1, (layout, digests)
