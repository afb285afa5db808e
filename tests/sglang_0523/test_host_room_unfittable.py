"""The owner-aware host room evicts nothing for a run no host eviction can
make fit (the write fails either way), on the real 0.5.23 stack, CP 2: the
host-only pages stay and come back bit-exact; a run eviction can make fit
still gets its room; both ranks decide alike."""

from __future__ import annotations

from typing import Any

import pytest

from tests.sglang_0523.conftest import RANK_ENV


@pytest.fixture(scope="module")
def unfittable(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from tests.helpers.sglang_0523 import host_room_scenarios
    from tests.helpers.sglang_0523.ranks import run_ranks

    return run_ranks(host_room_scenarios.unfittable_runs, 2, str(tmp_path_factory.mktemp("host_room")), env=RANK_ENV)


def test_a_run_the_host_only_pages_cannot_cover_evicts_nothing(unfittable):
    for rank, out in enumerate(unfittable):
        before, after = out["before"], out["after_unfittable"]
        # the setting: host-only leaves exist, each of them could help, and the
        # rest of the host holds copies of pages still on the device
        assert before["host_only_nodes"] >= 2 and any(before["reach"]), rank
        assert out["unfittable_pages"] <= 2 * 5, rank  # an empty host would hold it
        assert out["unfittable_fits"] is False, rank
        assert after["host_leaves"] == before["host_leaves"], rank
        assert after["free"] == before["free"] and after["reach"] == before["reach"], rank
        assert after["room"]["leaves_evicted"] == before["room"]["leaves_evicted"], rank


def test_a_backup_larger_than_the_host_fails_without_evicting(unfittable):
    for rank, out in enumerate(unfittable):
        before, after = out["after_unfittable"], out["after_oversized"]
        assert out["oversized_write_failures"] == 1, rank  # as upstream's would
        assert after["room"]["backups_short"] == before["room"]["backups_short"] + 1, rank
        assert after["room"]["leaves_evicted"] == before["room"]["leaves_evicted"] == 0, rank
        # every host leaf that was there is still there (plus any the request's device eviction demoted)
        assert set(before["host_leaves"]) <= set(after["host_leaves"]), rank


def test_the_kept_pages_come_back_bit_exact_and_a_fittable_run_still_gets_room(unfittable):
    for rank, out in enumerate(unfittable):
        restore = out["records"][-1]  # the first request again, from the host
        assert restore["host_hit_tokens"] == restore["loaded_tokens"] == 3 * 64, rank
        assert restore["restored_pages_verified"] >= 1 and restore["corrupted_pages"] == 0, rank
        assert all(r["corrupted_pages"] == 0 for r in out["records"]), rank
        assert out["fittable_fits"] is True, rank
        assert out["after_fittable"]["room"]["leaves_evicted"] > out["after_restore"]["room"]["leaves_evicted"], rank
        assert out["invariant_violations"] == [], rank
    first, second = unfittable
    for key in ("digest", "unfittable_pages", "before", "after_unfittable", "after_oversized", "after_fittable"):
        assert first[key] == second[key], key
