"""L3 metrics and ``clear_hicache_storage`` on SGLang 0.5.23's sharded stack
(2 rank processes, :func:`tests.helpers.sglang_0523.l3_observable_scenarios.observable_suite`).

* ``--enable-metrics``: SGLang's own storage metrics move with the library's
  L3 traffic -- ``sglang:backuped_tokens_total`` by the tokens each rank
  stored (every page once over the ranks), ``sglang:prefetched_tokens_total``
  by the tokens restored (every rank alike), the storage hits, and the
  per-operation histograms -- and the library's counters are exported as
  ``sglang_cp_hicache:l3_*_total``;
* SGLang's admin handler clears this deployment's namespaces on both ranks
  (each object removed once), another namespace's objects stay.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.sglang_0523 import l3_observable_scenarios as scenarios

pytest.importorskip("prometheus_client")


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from tests.helpers.sglang_0523.ranks import run_ranks

    workdir = tmp_path_factory.mktemp("l3-observable-0523")
    return run_ranks(scenarios.observable_suite, 2, str(workdir), timeout_s=400, l3_root=str(workdir))


def test_labels_are_sglangs_and_sglangs_own_feeds_stay_off(suite):
    for rank, out in enumerate(suite):
        for run in ("write", "read"):
            labels = out[run]["labels"]
            assert set(labels) == {"storage_backend", "tp_rank", "dp_rank", "pp_rank", "pp_size", "attn_cp_rank",
                                   "attn_cp_size"}
            assert (labels["storage_backend"], labels["attn_cp_rank"], labels["attn_cp_size"]) == ("file", rank, 2)
            assert out[run]["enable_storage_metrics"] is False


def test_backed_up_tokens_are_the_tokens_each_rank_stored(suite):
    written = [out["write"]["counters"]["written_pages"] for out in suite]
    assert all(written)
    for out in suite:
        run, P = out["write"], 64
        c, grown = run["counters"], run["grown"]
        assert grown["sglang:backuped_tokens_total"] == (c["written_pages"] + c["kept_pages"]) * P
        assert grown["sglang_cp_hicache:l3_written_pages_total"] == c["written_pages"]
        assert grown["sglang_cp_hicache:l3_written_bytes_total"] == (c["written_pages"] + c["kept_pages"]) * \
            run["page_bytes"]
        assert grown["sglang:backup_pgs_sum"] == c["written_pages"] + c["kept_pages"]
        assert grown["sglang:backup_pgs_count"] >= 1 and grown["sglang:backup_bandwidth_count"] >= 1


def test_prefetched_tokens_are_the_tokens_restored_from_l3(suite):
    restored = [out["read"]["counters"]["restored_tokens"] for out in suite]
    assert restored[0] > 0 and restored[0] == restored[1]  # every rank alike
    for out in suite:
        run = out["read"]
        c, grown = run["counters"], run["grown"]
        assert run["corrupted_pages"] == 0
        assert grown["sglang:prefetched_tokens_total"] == c["restored_tokens"]
        assert grown["sglang:storage_prefetch_hit_tokens_total"] >= c["restored_tokens"]
        assert grown["sglang_cp_hicache:l3_restored_pages_total"] == c["restored_pages"]
        assert grown["sglang:prefetch_pgs_sum"] == c["fetched_pages"]
        assert grown["sglang:prefetch_pgs_count"] >= 1 and grown["sglang:prefetch_bandwidth_count"] >= 1
        assert grown["sglang_cp_hicache:l3_read_bytes_total"] == c["fetched_pages"] * run["page_bytes"]
    assert suite[0]["read"]["grown"]["sglang:storage_prefetch_hit_tokens_total"] == \
        suite[1]["read"]["grown"]["sglang:storage_prefetch_hit_tokens_total"]


def test_clear_removes_this_deployments_objects_once_and_leaves_others(suite):
    assert [out["clear"]["success"] for out in suite] == [True, True]
    assert [out["clear"]["again"] for out in suite] == [True, True]
    objects = suite[0]["objects_before_clear"]
    assert sum(out["clear"]["cleared"] for out in suite) == objects - 3  # every own object, once
    assert suite[0]["left"] == suite[1]["left"] == [scenarios.FOREIGN] * 3
