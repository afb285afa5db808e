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
