"""The simulator's rank engine on 0.5.23 (two rank processes, both copy paths)."""

from __future__ import annotations


def _sim(two_ranks):
    return [r["sim"] for r in two_ranks]


def test_both_copy_paths_restore_bit_exact_and_agree(two_ranks):
    sims = _sim(two_ranks)
    for rank, sim in enumerate(sims):
        up, lib = sim["upstream"], sim["library"]
        for name, run in (("upstream", up), ("library", lib)):
            assert run["corrupted_pages"] == 0, (rank, name)
            assert run["load_backs"] > 0 and run["restored_pages_verified"] > 0, (rank, name)
            assert run["indexer_pages_verified"] == run["verified_pages"] > 0, (rank, name)
            assert run["invariant_violations"] == [], (rank, name)
            writes_queued, loads_queued, write_acks, load_acks = run["acks"]
            assert (write_acks, load_acks) == (writes_queued, loads_queued), (rank, name)
        # Same workload, same decisions: identical records and tree.
        assert up["records"] == lib["records"], rank
        assert up["digest"] == lib["digest"] and up["acks"] == lib["acks"], rank
        assert up["library_kernel_calls"] == 0 and lib["library_kernel_calls"] > 0, rank
    for path in ("upstream", "library"):
        assert len({s[path]["digest"] for s in sims}) == 1, path
        assert len({tuple(s[path]["acks"]) for s in sims}) == 1, path


def test_a_flipped_byte_in_a_restored_page_is_caught(two_ranks):
    # rank 0 flips a KV byte, rank 1 an indexer byte, each in its own page
    for rank, sim in enumerate(_sim(two_ranks)):
        assert sim["library-corrupt"]["corrupted_pages"] > 0, (rank, "indexer" if rank % 2 else "kv")
        assert sim["library"]["corrupted_pages"] == 0, rank
