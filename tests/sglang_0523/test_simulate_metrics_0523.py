"""The library's live counters on SGLang 0.5.23 (``simulate --metrics``:
each rank's stack built as ``--enable-metrics`` builds it, its
``sglang_cp_hicache:*`` series scraped from the rank's registry at the end):
every counter the release exports is there, labelled per rank, with the
value the simulator's own report gives for the same run."""

from __future__ import annotations

import json

import pytest

from sglang_cp_hicache.library_metrics import GAUGE_HELP, RELEASE_COUNTERS
from tests.sim.simrun import simulate

P = 64
#: Host-pressured (as test_simulate_cli's tight run): backups need owner-aware host room.
_TIGHT = ("--cp-size", "2", "--device-pages", "8", "--host-pages", "8", "--requests", "60")
#: Room on the host: both copy paths take the same decisions.
_ROOMY = ("--cp-size", "2", "--device-pages", "8", "--host-pages", "64", "--requests", "40")


def _run(tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    proc = simulate(*args, "--json", str(out))[0]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _scrapes(s):
    scrapes = s["library_metrics_per_rank"]
    assert [int(m["labels"]["attn_cp_rank"]) for m in scrapes] == list(range(s["cp_size"]))
    return [m["samples"] for m in scrapes]


@pytest.mark.slow(40)
def test_the_scrape_matches_the_simulators_report(tmp_path):
    s = _run(tmp_path, "tight", *_TIGHT, "--metrics")
    expected = {f"sglang_cp_hicache:{n}_total" for n in RELEASE_COUNTERS["0.5.23"]} | \
        {f"sglang_cp_hicache:{n}" for n in GAUGE_HELP}
    for rank, m in enumerate(_scrapes(s)):
        labels = s["library_metrics_per_rank"][rank]["labels"]
        assert (labels["attn_cp_size"], labels["storage_backend"]) == ("2", "none")
        assert set(m) == expected, rank
        room, frees = s["host_room_per_rank"][rank], s["device_frees_per_rank"][rank]
        assert m["sglang_cp_hicache:backups_total"] == s["write_backups_per_rank"][rank] == \
            s["backups_attempted"] - s["write_failures_per_rank"][rank] > 0
        assert m["sglang_cp_hicache:backup_failures_total"] == s["write_failures_per_rank"][rank]
        # the premise of the workload: backups only fitted after owner-aware eviction
        assert m["sglang_cp_hicache:backups_kept_by_host_room_total"] == room["room_made"] > 0
        assert m["sglang_cp_hicache:backups_kept_lost_upstream_total"] == room["room_made_lost_upstream"] <= \
            room["room_made"]
        assert m["sglang_cp_hicache:backups_unfittable_evictions_spared_total"] == room["unfittable"]
        assert m["sglang_cp_hicache:device_index_host_reads_total"] == s["device_index_host_reads_per_rank"][rank]
        assert m["sglang_cp_hicache:device_index_host_reads_avoided_total"] == frees["reads_avoided"] > 0
        assert m["sglang_cp_hicache:load_backs_total"] == s["load_backs"] > 0
        assert m["sglang_cp_hicache:load_back_tokens_total"] == s["load_back_tokens"]
        # the gauge's last step is the last request's host use (the series' last sample)
        assert m["sglang_cp_hicache:host_pages_in_use"] * P == s["series"]["host_slots_per_rank"][rank][-1]
        assert m["sglang_cp_hicache:host_pages_capacity"] * P == s["host_slot_capacity_per_rank"][rank]


@pytest.mark.slow(60)
def test_the_reads_avoided_are_the_reads_upstream_makes_on_the_same_decisions(tmp_path):
    lib = _run(tmp_path, "library", *_ROOMY, "--metrics")
    up = _run(tmp_path, "upstream", *_ROOMY, "--copy", "upstream")
    assert lib["tree_digests"] == up["tree_digests"] and up["write_failures"] == 0  # the same decisions
    for rank, m in enumerate(_scrapes(lib)):
        made, avoided = (m[f"sglang_cp_hicache:device_index_host_reads{x}_total"] for x in ("", "_avoided"))
        assert made + avoided == up["device_index_host_reads_per_rank"][rank] > 0, rank
