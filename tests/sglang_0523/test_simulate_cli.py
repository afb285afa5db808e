"""``python -m sglang_cp_hicache simulate`` on SGLang 0.5.23's sharded stack:
the release is detected, every KV and indexer byte goes through this
library's kernels with the real cp_size, and the JSON says so."""

from __future__ import annotations

import json

import pytest

from tests.sim.simrun import ROOT, simulate


@pytest.mark.slow(45)
def test_simulate_on_the_sharded_pool_through_the_library_kernels(tmp_path):
    out = tmp_path / "sim.json"
    proc = simulate("--cp-size", "2", "--requests", "30", "--json", str(out))[0]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["sglang_version"] == "0.5.23" and s["copy_path"] == "library"
    assert s["corrupted_pages"] == 0 and s["restored_pages_verified"] > 0
    assert s["indexer_pages_verified"] == s["verified_pages"] > 0
    assert s["ranks_agree"]
    copies = s["copies"]
    assert copies["cp_size"] == 2
    assert min(copies["kv_backup_calls"], copies["kv_load_calls"],
               copies["indexer_backup_calls"], copies["indexer_load_calls"]) > 0
    assert all(c["copy_path"] == "library" and c["submit_calls"] > 0 for c in s["copy_path_cpu_seconds_per_rank"])


@pytest.mark.slow(70)
def test_simulate_with_l3_writes_own_pages_and_restores_them_bit_exact(tmp_path):
    out, directory = tmp_path / "l3.json", tmp_path / "l3"
    proc = simulate("--cp-size", "2", "--device-pages", "16", "--host-pages", "24", "--requests", "40",
                    "--l3", str(directory), "--json", str(out))[0]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["ranks_agree"] and s["corrupted_pages"] == 0
    written = s["l3_written_pages_per_rank"]
    assert len(written) == 2 and min(written) > 0 and s["l3_written_pages"] == sum(written)
    assert len(list(directory.rglob("*.bin"))) <= 2 * s["l3_written_pages"]  # KV + indexer per page
    # the workload revisits chains the host evicted: they come back from L3, checked on the device
    assert s["l3_hit_tokens"] > 0 and s["l3_pages_verified"] > 0 and s["l3_rejected_objects"] == 0
    assert "L3 pages verified" in proc.stdout


def test_l3_is_refused_on_upstreams_copy_path(tmp_path):
    directory = tmp_path / "l3"
    proc = simulate("--cp-size", "2", "--copy", "upstream", "--l3", str(directory))[0]
    assert proc.returncode == 2 and "--l3 needs --copy library on --sglang 0.5.23" in proc.stderr
    assert not directory.exists()


#: A host-pressured workload: 8 host pages per rank fill after a few requests,
#: so every later backup needs host room. Upstream's one evict_host sized in
#: tokens refuses a backup here; the library's owner-aware host room does not.
_TIGHT = ("--cp-size", "2", "--device-pages", "8", "--host-pages", "8", "--requests", "60")
_PER_RANK = ("write_failures_per_rank", "host_hit_tokens_per_rank", "device_evictions_per_rank",
             "device_eviction_tokens_per_rank", "device_index_host_reads_per_rank", "request_free_reads_per_rank")
_TOTALS = ("backups_attempted", "write_failures", "host_hit_tokens", "device_evictions", "device_eviction_tokens",
           "device_index_host_reads")
_HOST_ROOM = ("backups", "backups_short", "leaves_evicted", "leaves_evicted_for_ancestors", "pages_evicted",
              "written", "refused", "room_made", "unfittable", "room_made_lost_upstream",
              "leaves_skipped")


def _count(value):
    return type(value) is int and value >= 0


def _run_tight(tmp_path, copy_path):
    out = tmp_path / f"{copy_path}.json"
    proc = simulate(*_TIGHT, "--copy", copy_path, "--json", str(out))[0]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["copy_path"] == copy_path and s["ranks_agree"] and s["corrupted_pages"] == 0
    for key in _TOTALS:
        assert _count(s[key]), (copy_path, key, s[key])
    for key in _PER_RANK:
        assert len(s[key]) == 2 and all(_count(v) for v in s[key]), (copy_path, key, s[key])
        if key != "device_index_host_reads_per_rank" and key != "request_free_reads_per_rank":
            assert s[key][0] == s[key][1], (copy_path, key)  # every rank takes the same decisions
    assert s["write_failures"] == s["write_failures_per_rank"][0]
    assert s["host_hit_tokens"] == s["host_hit_tokens_per_rank"][0]
    assert s["device_index_host_reads"] == sum(s["device_index_host_reads_per_rank"])
    assert s["device_evictions"] > 0 and s["device_eviction_tokens"] >= s["device_evictions"] * 64
    for row in ("node backups refused", "host + L3 hit tokens", "device evictions (nodes)",
                "host reads of device locs"):
        assert row in proc.stdout, (copy_path, row)
    return s, proc.stdout


@pytest.mark.slow(90)
def test_bookkeeping_counters_on_a_tight_host_upstream_loses_backups_and_reads_locs(tmp_path):
    up, up_text = _run_tight(tmp_path, "upstream")
    lib, lib_text = _run_tight(tmp_path, "library")
    # upstream's stack carries none of the library's counters
    assert not {"host_room", "device_frees_per_rank", "warmup_per_rank"} & up.keys()
    assert "library host room" not in up_text and "library host room" in lib_text
    # upstream frees every evicted node through free (a host read each), plus the request pages
    for r in range(2):
        assert up["device_index_host_reads_per_rank"][r] >= (
            up["device_evictions_per_rank"][r] + up["request_free_reads_per_rank"][r]
        ), r
    # the findings: upstream refuses backups and reads device locs on eviction; the library neither
    assert up["write_failures"] > 0 and lib["write_failures"] == 0, (up["write_failures"], lib["write_failures"])
    assert lib["device_index_host_reads"] < up["device_index_host_reads"]
    # ...nor on releasing a request: the scheduler's frees of its own pages read nothing either
    assert sum(up["request_free_reads_per_rank"]) > 0
    assert lib["device_index_host_reads"] == 0 and lib["request_free_reads_per_rank"] == [0, 0]
    assert lib["backups_attempted"] > 0 and lib["host_hit_tokens"] > 0
    room = lib["host_room"]
    assert set(room) == set(_HOST_ROOM) and all(_count(room[k]) for k in _HOST_ROOM)
    assert lib["host_room_per_rank"] == [room, room]
    assert room["backups"] == lib["backups_attempted"] and room["backups_short"] == 0
    assert room["leaves_evicted"] > 0  # the host was under pressure
    for r, frees in enumerate(lib["device_frees_per_rank"]):
        # every device eviction freed from its rotation phase, nothing read back...
        assert frees["from_phase"] == lib["device_evictions_per_rank"][r] > 0, r
        # ...and the library's own count of upstream frees is the simulator's
        assert frees["read_back"] == lib["device_index_host_reads_per_rank"][r], r
        assert frees["request_from_phase"] > 0, r  # request pages freed from the request's rotation
    for warm in lib["warmup_per_rank"]:
        assert isinstance(warm["backend"], str) and warm["seconds"] >= 0.0


@pytest.mark.slow(90)
def test_compare_upstream_runs_both_paths_and_only_the_library_gets_the_l3(tmp_path):
    out, directory = tmp_path / "compare.json", tmp_path / "l3"
    trace = f"{ROOT}/tests/data/mooncake_conversation_slice.jsonl"
    proc = simulate("--compare-upstream", "--cp-size", "2", "--trace", trace, "--requests", "12",
                    "--l3", str(directory), "--json", str(out))[0]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    c = json.loads(out.read_text())
    assert c["kind"] == "compare_upstream" and c["ok"] and c["sglang_version"] == "0.5.23"
    lib, up = c["runs"]["library"], c["runs"]["upstream"]
    assert (lib["copy_path"], up["copy_path"]) == ("library", "upstream")
    # one workload, one pool size (sized from the trace), checked alike on both paths
    for key in ("prompt_tokens", "ideal_hit_tokens", "device_pages", "host_pages", "pool_sizing"):
        assert lib[key] == up[key] == c[key], key
    assert lib["corrupted_pages"] == up["corrupted_pages"] == 0 and lib["ranks_agree"] and up["ranks_agree"]
    assert lib["l3_dir"] == str(directory) and lib["l3_written_pages"] > 0 and "l3_dir" not in up
    assert c["paths"]["upstream"]["hit_tokens_per_tier"]["l3"] == 0 and c["upstream_l3"]
    assert "upstream's run has none" in proc.stdout and "no L3" in proc.stdout
    assert proc.stdout.rstrip().endswith("result: OK (both runs)")
