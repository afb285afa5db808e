"""The simulator's rank engine on 0.5.23 (two rank processes, both copy paths;
runs in tests/helpers/sglang_0523/scenarios.py::SIM_RUNS)."""

from __future__ import annotations


def _sim(two_ranks):
    return [r["sim"] for r in two_ranks]


def _bit_exact_and_consistent(run, where):
    assert run["corrupted_pages"] == 0, where
    assert run["load_backs"] > 0 and run["restored_pages_verified"] > 0, where
    assert run["indexer_pages_verified"] == run["verified_pages"] > 0, where
    assert run["invariant_violations"] == [], where
    writes_queued, loads_queued, write_acks, load_acks = run["acks"]
    assert (write_acks, load_acks) == (writes_queued, loads_queued), where


def _checked_runs(sims, up_name, lib_name):
    """(rank, upstream's run, the library's run) of each rank, both runs
    checked bit-exact and consistent first."""
    for rank, sim in enumerate(sims):
        up, lib = sim[up_name], sim[lib_name]
        for name, run in ((up_name, up), (lib_name, lib)):
            _bit_exact_and_consistent(run, (rank, name))
        yield rank, up, lib


def test_with_room_on_the_host_both_copy_paths_decide_alike_and_restore_bit_exact(two_ranks):
    sims = _sim(two_ranks)
    for rank, up, lib in _checked_runs(sims, "upstream", "library"):
        # the premise: nothing is evicted from the host and no backup fails, so
        # the bookkeeping agrees...
        assert up["host_evicted_nodes"] == lib["host_evicted_nodes"] == 0, rank
        assert up["backup_failures"] == lib["backup_failures"] == 0 and up["backups"] > 0, rank
        # ...and the same workload takes the same decisions: identical records and tree.
        assert up["records"] == lib["records"], rank
        assert up["digest"] == lib["digest"] and up["acks"] == lib["acks"], rank
        assert up["library_kernel_calls"] == 0 and lib["library_kernel_calls"] > 0, rank
    for path in ("upstream", "library"):
        assert len({s[path]["digest"] for s in sims}) == 1, path
        assert len({tuple(s[path]["acks"]) for s in sims}) == 1, path


def test_with_a_tight_host_the_library_loses_no_backup_where_upstream_does(two_ranks):
    sims = _sim(two_ranks)
    for rank, up, lib in _checked_runs(sims, "upstream-tight", "library-tight"):
        assert up["host_evicted_nodes"] > 0 and lib["host_evicted_nodes"] > 0, rank
        assert up["backup_failures"] > 0 and lib["backup_failures"] == 0, (rank, up["backup_failures"])
        assert lib["backups"] >= up["backups"] - up["backup_failures"], rank
    for path in ("upstream-tight", "library-tight"):
        assert len({s[path]["digest"] for s in sims}) == 1, path
        assert len({tuple(s[path]["records"]) for s in sims}) == 1, path


def test_a_flipped_byte_in_a_restored_page_is_caught(two_ranks):
    # rank 0 flips a KV byte, rank 1 an indexer byte, each in its own page
    for rank, sim in enumerate(_sim(two_ranks)):
        assert sim["library-corrupt"]["corrupted_pages"] > 0, (rank, "indexer" if rank % 2 else "kv")
        assert sim["library-tight"]["corrupted_pages"] == 0, rank
