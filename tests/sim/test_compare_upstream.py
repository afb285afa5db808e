"""``simulate --compare-upstream``, pools sized from a trace, and the report's
words, read off saved summaries (no rank starts here; the one end-to-end run
is in tests/sglang_0523/test_simulate_cli.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from sglang_cp_hicache.sim.compare import UPSTREAM_L3_REFUSAL, compare_upstream, format_comparison
from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.sizing import size_pools
from sglang_cp_hicache.sim.table import format_table
from tests.sim.simrun import with_engine

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
SLICE = ROOT / "tests" / "data" / "mooncake_conversation_slice.jsonl"


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _cli(*args: str) -> int:
    from sglang_cp_hicache.__main__ import main

    return main(["simulate", "--no-progress", *with_engine(args)])


# ---- pools from the trace's working set ---------------------------------------------


def test_the_sizing_rule_a_quarter_of_the_distinct_pages_on_the_host_half_that_on_the_device():
    # the committed comparison's trace: 7,519 distinct pages, longest request 15,080 tokens, CP 4
    s = size_pools(distinct_pages=7519, longest_request_tokens=15080, cp_size=4, page_size=64, capacity=0.25)
    assert (s.host_pages, s.device_pages) == (470, 235)  # ceil(7519 / 4 / 4), ceil(470 / 2)
    assert (s.host_from, s.device_from) == ("--capacity", "--capacity")
    # the longest request decides the device when the host is small: ceil((ceil(15080 / 64) + 1) / 4) = 60
    s = size_pools(distinct_pages=7519, longest_request_tokens=15080, cp_size=4, page_size=64, capacity=0.01)
    assert (s.host_pages, s.device_pages) == (19, 60)
    assert SimConfig(cp_size=4, device_pages=60).max_request_tokens >= 15080
    # explicit sizes win, each for its own pool; a tiny trace still gets usable pools
    s = size_pools(distinct_pages=7519, longest_request_tokens=640, cp_size=4, page_size=64, capacity=0.25,
                   device_pages=9)
    assert (s.host_pages, s.device_pages, s.device_from) == (470, 9, "--device-pages")
    s = size_pools(distinct_pages=0, longest_request_tokens=10, cp_size=2, page_size=64, capacity=0.25)
    assert (s.host_pages, s.device_pages) == (4, 4)


def test_a_trace_sizes_the_pools_unless_told_and_capacity_needs_a_trace(captured_launch, capsys):
    assert _cli("--cp-size", "2", "--trace", str(SLICE), "--requests", "30") == 1
    assert _cli("--cp-size", "2", "--trace", str(SLICE), "--requests", "30", "--capacity", "1") == 1
    assert _cli("--cp-size", "2", "--trace", str(SLICE), "--requests", "30", "--device-pages", "40") == 1
    assert _cli("--cp-size", "2", "--trace", str(SLICE), "--device-pages", "40", "--host-pages", "5") == 1
    quarter, whole, device_given, both_given = captured_launch
    # 93 distinct pages in the first 30 lines; the longest request (2,012 tokens) needs 17 pages a rank
    assert (quarter.host_pages, quarter.device_pages) == (12, 17)
    assert (whole.host_pages, whole.device_pages) == (47, 24)
    assert (device_given.host_pages, device_given.device_pages) == (12, 40)
    assert (both_given.host_pages, both_given.device_pages) == (5, 40)
    capsys.readouterr()
    assert _cli("--capacity", "0.5") == 2
    assert "--capacity needs --trace" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _cli("--trace", str(SLICE), "--capacity", "0")
    assert "must be in (0, 64]" in capsys.readouterr().err


# ---- --compare-upstream: refusals, the comparison, its text ---------------------------


@pytest.mark.parametrize("args,needle", [
    (("--sglang", "0.5.18"), "--compare-upstream needs SGLang 0.5.23 (this is 0.5.18)"),
    (("--sglang", "0.5.23", "--copy", "upstream"), "--compare-upstream runs both copy paths itself"),
    (("--sglang", "0.5.23", "--compare-non-cp"), "--compare-upstream and --compare-non-cp do not combine"),
])
def test_compare_upstream_refusals_name_the_flag_before_any_rank_starts(captured_launch, capsys, args, needle):
    assert _cli("--compare-upstream", *args) == 2
    assert needle in capsys.readouterr().err
    assert captured_launch == []


def test_the_comparison_puts_both_paths_side_by_side_and_says_why_upstream_has_no_l3():
    lib, up = _load("traces/0523-library-cp4-l3.json"), _load("traces/0523-upstream-cp4.json")
    c = compare_upstream(lib, up, command="python -m sglang_cp_hicache simulate --compare-upstream")
    assert c["kind"] == "compare_upstream" and c["ok"] and c["upstream_l3"] == UPSTREAM_L3_REFUSAL
    assert c["runs"] == {"library": lib, "upstream": up}
    p, q = c["paths"]["library"], c["paths"]["upstream"]
    assert p["hit_tokens_per_tier"] == lib["hit_tokens_per_tier"] and p["hit_ratio"] == lib["hit_ratio"]
    assert p["l3"] and not q["l3"] and p["l3_written_pages"] == lib["l3_written_pages"]
    assert (q["backups_lost"], q["device_index_host_reads_max_per_rank"]) == (
        up["write_failures"], max(up["device_index_host_reads_per_rank"]))
    text = format_comparison(c)
    row = next(line for line in text.splitlines() if line.startswith("L3 hits (of the ideal)"))
    assert row.split()[-1] == "L3" and row.split()[-2] == "no"  # upstream's column: no L3
    assert f"upstream's run has none: {UPSTREAM_L3_REFUSAL}" in text
    assert "not measured: GPU copy time" in text and text.endswith("result: OK (both runs)")
    # without --l3 neither path has L3 and nothing is said about a refusal
    plain = compare_upstream(_load("traces/0523-library-cp4.json"), up)
    assert plain["upstream_l3"] is None and "refuses" not in format_comparison(plain)
    broken = copy.deepcopy(up)
    broken["problems"] = ["2 corrupted pages"]
    assert compare_upstream(lib, broken)["problems"] == ["upstream: 2 corrupted pages"]


def test_the_committed_comparison_is_what_its_runs_say_and_what_it_printed():
    c = _load("sim0523_compare_upstream.json")
    assert c["command"].startswith("python -m sglang_cp_hicache simulate --compare-upstream --l3 ")
    again = compare_upstream(c["runs"]["library"], c["runs"]["upstream"], command=c["command"])
    assert again == c
    printed = (RESULTS / "sim0523_compare_upstream.txt").read_text()
    assert format_comparison(c) in printed
    assert c["runs"]["upstream"]["copy_path"] == "upstream" and "l3_dir" not in c["runs"]["upstream"]


# ---- the one-path report: goals apart from checks, one meaning of "host hits" ---------


def test_goals_are_printed_as_targets_of_their_release_beside_the_checks():
    s0523 = _load("traces/0523-library-cp4.json")
    s0523["comparison"]["host_slots_goal_met"] = None  # as the summary now says on 0.5.23
    text = format_table(s0523)
    goals = next(line for line in text.splitlines() if line.startswith("goals of SGLang 0.5.23"))
    assert "targets, not checks" in goals and "host balance" not in goals
    assert "MISSED" not in text and text.splitlines()[-1] == "result: OK"
    s0518 = _load("traces/0518-cp4.json")
    goals = next(line for line in format_table(s0518).splitlines() if line.startswith("goals of SGLang 0.5.18"))
    assert "0.5.18's exact host balance" in goals


def test_the_host_slot_goal_is_0518s_only(monkeypatch):
    from sglang_cp_hicache.sim.report import _compare

    s = _load("traces/0523-library-cp4.json")
    nc = s["non_cp"]
    assert _compare(s, nc, 4, 64, host_goal=False)["host_slots_goal_met"] is None
    assert _compare(s, nc, 4, 64)["host_slots_goal_met"] in (True, False)


def test_host_hits_mean_the_host_tier_alone_and_a_warm_l3_is_explained():
    s = _load("traces/0523-library-cp4-l3.json")
    tiers = s["hit_tokens_per_tier"]
    text = format_table(s)
    assert f"device hits {tiers['device']}, host hits {tiers['host']}, L3 hits {tiers['l3']}," in text
    assert "host + L3 hit tokens" in text and "host hit tokens" not in text
    assert "held" not in text
    s["l3_objects_at_start"] = 41080
    assert "the L3 directory held 41,080 objects at the start" in format_table(s)


def test_the_l3_line_counts_losses_where_the_summary_has_them():
    s = _load("traces/0523-library-cp4-l3.json")  # committed before the loss counters: none said
    line = next(x for x in format_table(s).splitlines() if x.startswith("L3 ("))
    assert "lost:" not in line and line.endswith("objects rejected")
    s.update(l3_write_failures=3, l3_dropped_writes=2, l3_read_failures=1, l3_timeouts=0)
    line = next(x for x in format_table(s).splitlines() if x.startswith("L3 ("))
    assert line.endswith("; lost: 3 page writes failed, 2 dropped, 1 page reads failed, 0 lookups timed out")
