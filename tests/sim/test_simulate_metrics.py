"""The library's live counters on SGLang 0.5.18 (``simulate --metrics``:
each CP rank's cache built as ``--enable-metrics`` builds it, its
``sglang_cp_hicache:*`` series scraped from the rank's registry at the end):
every counter the release exports is there, labelled per rank, with the
value the simulator's own report gives for the same run."""

from __future__ import annotations

import json

import pytest

from sglang_cp_hicache.library_metrics import GAUGE_HELP, RELEASE_COUNTERS
from tests.sim.simrun import simulate

P = 64


@pytest.mark.slow(40)
def test_the_scrape_matches_the_simulators_report(tmp_path):
    out = tmp_path / "sim.json"
    proc, _ = simulate("--sglang", "0.5.18", "--cp-size", "2", "--device-pages", "8", "--host-pages", "16",
                       "--requests", "60", "--metrics", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())
    expected = {f"sglang_cp_hicache:{n}_total" for n in RELEASE_COUNTERS["0.5.18"]} | \
        {f"sglang_cp_hicache:{n}" for n in GAUGE_HELP}
    scrapes = s["library_metrics_per_rank"]
    assert [int(m["labels"]["attn_cp_rank"]) for m in scrapes] == [0, 1]
    for rank, scrape in enumerate(scrapes):
        m = scrape["samples"]
        assert set(m) == expected, rank
        assert m["sglang_cp_hicache:backups_total"] == s["write_backups_per_rank"][rank] > 0
        assert m["sglang_cp_hicache:backup_failures_total"] == s["write_failures"]
        assert m["sglang_cp_hicache:device_index_host_reads_total"] == s["device_page_reads_per_rank"][rank] == 0
        assert m["sglang_cp_hicache:device_index_host_reads_avoided_total"] > 0  # every insert used the mirror
        assert m["sglang_cp_hicache:load_backs_total"] == s["load_backs"] > 0
        assert m["sglang_cp_hicache:load_back_tokens_total"] == s["load_back_tokens"]
        assert m["sglang_cp_hicache:load_backs_declined_total"] == s["load_backs_refused"]
        assert m["sglang_cp_hicache:host_pages_in_use"] * P == s["series"]["host_slots_per_rank"][rank][-1]
        assert m["sglang_cp_hicache:host_pages_capacity"] * P == s["host_slot_capacity_per_rank"][rank]
