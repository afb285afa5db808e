"""Upstream behaviour this project found with the 0.5.23 harness (see
docs/sglang-0.5.23.md). Each test pins the behaviour as SGLang 0.5.23 ships
it; when a release fixes it, the test fails and the doc entry must move to
"fixed in".
"""

from __future__ import annotations


def test_finding_1_backup_fails_after_evicting_host_pages_of_the_wrong_owner(two_ranks):
    for rank, result in enumerate(two_ranks):
        finding = result["finding_host_eviction"]
        assert finding["write_failures"] == 1, rank
        (failure,) = finding["failures"]
        need, before, after = failure["need_by_class"], failure["host_free_before"], failure["host_free_after"]
        evictable = failure["evictable_host_pages_after"]
        assert failure["pages"] == sum(need) == 3 and need == [2, 1], rank
        # the floor (2 ranks x 1 page) was short by one page of tokens: one page was evicted...
        assert sum(after) - sum(before) == 1, rank
        # ...of the class that was not short, so class 0 still lacks a page
        assert after[0] < need[0] and after[1] >= need[1], rank
        # while host-only pages of class 0 were there to evict
        assert evictable[0] >= need[0] - after[0], rank


def test_the_library_backs_up_every_node_of_finding_1_bit_exact_on_every_rank(two_ranks):
    """The same requests on the library stack: its owner-aware host room
    evicts only host leaves holding pages of the short class, so no backup
    fails; what comes back from the host is exact; the ranks decide alike."""
    library = [r["finding_host_eviction_library"] for r in two_ranks]
    upstream = [r["finding_host_eviction"] for r in two_ranks]
    for rank, (lib, up) in enumerate(zip(library, upstream)):
        assert lib["write_failures"] == lib["write_failures_total"] == 0 and lib["failures"] == [], rank
        room = lib["host_room"]
        assert room["backups"] == len(lib["backups"]) and room["backups_short"] == 0, rank
        assert room["leaves_skipped"] >= 1, rank  # a leaf of the class that was not short stayed
        assert room["leaves_evicted"] >= 1, rank
        assert [pages for _, pages in lib["backups"]][:4] == [2, 4, 2, 3], rank  # D's 3-page node too
        assert up["write_failures_total"] >= 1 and len(lib["backups"]) > len(up["backups"]), rank
        assert lib["corrupted_pages"] == 0 and lib["restored_pages_verified"] > 0, rank
        assert lib["invariant_violations"] == [], rank
    for key in ("digest", "backups", "host_room", "host_hit_tokens", "loaded_tokens"):
        assert library[0][key] == library[1][key], key
