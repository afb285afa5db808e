"""One simulator run on the committed Mooncake slice, checked whole (shared by
the 0.5.18 and 0.5.23 suites: one run per release costs one start-up).

CP 2, 24 device and 24 host pages a rank (the slice's 136 distinct pages do
not fit: host eviction, load-back and L3 restores all happen), a fresh L3
directory, the non-CP baseline in one process, progress on, JSON and PNG.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from sglang_cp_hicache.sim.ideal import ideal_hit_tokens
from sglang_cp_hicache.sim.workload import load_trace
from tests.sim.simrun import simulate

SLICE = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_slice.jsonl"
P = 64


def run_slice(tmp_path: Path, *extra: str) -> tuple[dict[str, Any], subprocess.CompletedProcess, Path]:
    out, png = tmp_path / "slice.json", tmp_path / "slice.png"
    args = ("--cp-size", "2", "--device-pages", "24", "--host-pages", "24", "--trace", str(SLICE),
            "--l3", str(tmp_path / "l3"), "--compare-non-cp", "--non-cp-group", "single",
            "--json", str(out), "--plot", str(png), *extra)
    proc, _ = simulate(*args, progress=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc, png


def check_slice_run(s: dict[str, Any], proc: subprocess.CompletedProcess, png: Path) -> None:
    trace = load_trace(SLICE, seed=0)
    ideal = ideal_hit_tokens(trace.packed, P)
    # bit-exact, agreed, and the run is the slice's
    assert s["ok"] and s["ranks_agree"] and s["corrupted_pages"] == 0 and s["restored_pages_verified"] > 0
    assert (s["trace_format"], s["trace_block_tokens"], s["requests"]) == ("mooncake", 64, 60)
    assert s["prompt_tokens"] == trace.packed.total_tokens == 50_794
    assert s["ideal_hit_tokens"] == sum(ideal) == 40_128 and s["series"]["ideal_hit_tokens"] == ideal
    # hits per tier: disjoint, adding up to what match_prefix reported, L3's as the ranks restored them
    tiers = s["hit_tokens_per_tier"]
    assert sum(tiers.values()) == s["hit_tokens"] == s["device_hit_tokens"] + s["host_hit_tokens"]
    assert min(tiers.values()) > 0, tiers  # every tier served something
    assert tiers["l3"] == s["l3_hit_tokens"] == sum(s["l3_hit_tokens_per_rank"])
    assert s["hit_ratio"] == s["hit_tokens"] / s["ideal_hit_tokens"] <= 1.0
    assert s["hit_rate_per_tier"]["host"] == tiers["host"] / s["prompt_tokens"]
    # no request hits more than an infinite cache would (a fresh L3 holds only this run's pages)
    hits = [d + h for d, h in zip(s["series"]["device_hit_tokens"], s["series"]["host_hit_tokens"])]
    assert all(h <= i for h, i in zip(hits, ideal)), [(n, h, i) for n, (h, i) in enumerate(zip(hits, ideal)) if h > i]
    # the non-CP baseline (N x the pages in one pool, no L3)
    assert 0 < s["non_cp_hit_tokens"] <= s["ideal_hit_tokens"]
    assert s["non_cp"]["host_pages"] == 48 and s["non_cp"]["corrupted_pages"] == 0
    assert s["capacity_efficiency"] == s["hit_tokens"] / s["non_cp_hit_tokens"]
    # bytes per tier and direction, from each rank's own pages
    moved, page = s["bytes_moved"], s["page_bytes"]
    assert moved["host_d2h"] == sum(s["backup_slots_per_rank"]) // P * page > 0
    assert moved["host_h2d"] == sum(s["load_slots_per_rank"]) // P * page > 0
    assert moved["l3_write"] == s["l3_written_pages"] * page > 0 and moved["l3_read"] == tiers["l3"] // P * page
    assert s["copy_gbps"]["d2h"] > 0 and s["copy_gbps"]["h2d"] > 0
    # start-up apart from the replay
    assert 0 < s["startup_wall_seconds"] < s["run_wall_seconds"] and s["replay_wall_seconds"] > 0
    # what the user sees: start-up progress, a replay bar with an estimate, the rates, a PNG
    for needle in ("CP2: 2/2 SGLang imported", "CP2: 2/2 stacks built", "CP2 replay [", "60/60 requests",
                   "about", "non-CP: 1/1 stacks built"):
        assert needle in proc.stderr, (needle, proc.stderr[-2000:])
    for needle in ("prompt tokens 50,794; ideal (an infinite cache starting empty, page-aligned) 40,128", "hit_ratio",
                   "capacity_efficiency (CP hits / non-CP hits)", "bytes moved", "time: start-up"):
        assert needle in proc.stdout, needle
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
