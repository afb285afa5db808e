"""``python -m sglang_cp_hicache fleet`` end to end: two deployments of
different CP sizes and releases (0.5.23 and 0.5.18) on SGLang's own scheduler (the default engine) and one
file L3, each restoring pages the other wrote, bit-exact, with requests
started in order across them; and, on the loop engine and the committed
Mooncake slice, a deployment killed mid-run (the other serves on, nothing
corrupt is restored, the lost requests are counted).

Runs from the 0.5.18 suite. Small shapes: one layer; the slice's first 40
requests with pools at a tenth of the trace's pages, so pages leave the
host pools and come back from L3."""

from __future__ import annotations

import hashlib
import json
import os
from array import array
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from sglang_cp_hicache.sim.ideal import ideal_cache
from sglang_cp_hicache.sim.workload import load_trace
from tests.sim.simrun import ROOT, sim_env, with_engine

TRACE = os.path.join(ROOT, "tests", "data", "mooncake_conversation_slice.jsonl")
REQUESTS = 40


def fleet(tmp_path: Path, *args: str, l3: Optional[str] = None) -> tuple[subprocess.CompletedProcess, dict]:
    """The fleet on the slice; ``l3``: its --l3 (default a file L3 in ``tmp_path``); on the loop engine
    unless ``args`` name one."""
    out = tmp_path / "fleet.json"
    cmd = [sys.executable, "-m", "sglang_cp_hicache", "fleet", "--no-progress", "--trace", TRACE,
           "--requests", str(REQUESTS), "--layers", "1", "--capacity", "0.1", "--l3", l3 or str(tmp_path / "l3"),
           "--json", str(out), *with_engine(args)]
    proc = subprocess.run(cmd, cwd=ROOT, env=sim_env(), capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


def _prefix_pages(tokens) -> list[bytes]:
    """One digest per whole page, naming the page and every page before it."""
    ids, chain, out = array("q", tokens), hashlib.blake2b(digest_size=16), []
    for page in range(len(ids) // 64):
        chain.update(ids[page * 64:(page + 1) * 64].tobytes())
        out.append(chain.copy().digest())
    return out


def check_accounting(summary: dict) -> None:
    """Every request served once or counted lost; requests started in trace
    order; no request hit more than the pages of the requests that had
    started before it finished (the ones before it, and the later ones
    running at the same time elsewhere)."""
    trace = load_trace(TRACE, seed=0, limit=REQUESTS)
    ideal = ideal_cache(trace.packed, 64).hit_tokens
    assert summary["ideal_hit_tokens"] == sum(ideal)
    runs, hits = {}, {}
    for d in summary["deployments"]:
        series = d["series"]
        for k, i in enumerate(series["request_index"]):
            assert i not in runs
            runs[i] = (series["start_seconds"][k], series["done_seconds"][k])
            hits[i] = series["device_hit_tokens"][k] + series["host_hit_tokens"][k]
            assert series["ideal_hit_tokens"][k] == ideal[i]
    assert len(runs) + summary["requests_lost"] == REQUESTS
    ordered = [runs[i][0] for i in sorted(runs)]
    assert ordered == sorted(ordered), "a request started before an earlier one"
    pages = [_prefix_pages(trace.packed[i]) for i in range(REQUESTS)]
    for i, (_, done) in runs.items():
        seen = {p for j in range(REQUESTS) if j != i and (j < i or (j in runs and runs[j][0] < done))
                for p in pages[j]}
        reachable = next((k for k, p in enumerate(pages[i]) if p not in seen), len(pages[i]))
        assert hits[i] <= reachable * 64, (i, hits[i], reachable)


#: The scheduler engine's fleet, round-robin over two deployments of different CP sizes and releases (both
#: harness pools fp8_e4m3: the same page bytes, so the same keys) with one request in flight each: A (to
#: d0) and B (to d1) of six pages no other prompt shares, five two-page fillers, then A and one page more (to
#: d1) and B and one page more (to d0). The second of a pair is released only once the other deployment has
#: finished the first and two fillers since (its window of one holds the line), so the first's pages have
#: left for L3; the second's deployment never held them. (On the slice, where a conversation's next turn
#: follows its last without think time, how many pages cross depends on how fast the last turn's writes
#: land: 24 and 7 pages in one 40-request run at 0.5.18 CP 4 + CP 2; 11 and 8 at 0.5.23 CP 2 + 0.5.18 CP 2.)
_P = 64


def _pairs_trace(path: Path) -> None:
    def pages(base: int, n: int, extra: int = 1) -> list[int]:
        return list(range(base, base + n * _P + extra))

    a, b = pages(1_000_000, 6), pages(2_000_000, 6)
    fillers = [pages(3_000_000 + 10_000 * k, 2) for k in range(5)]
    prompts = [a, b, *fillers, a[:6 * _P] + pages(5_000_000, 1), b[:6 * _P] + pages(6_000_000, 1)]
    path.write_text("".join(json.dumps({"tokens": p}) + "\n" for p in prompts))


@pytest.mark.slow(60)
def test_on_sglangs_scheduler_two_cp_sizes_restore_each_others_pages_from_one_l3(tmp_path):
    trace, out = tmp_path / "pairs.jsonl", tmp_path / "fleet.json"
    _pairs_trace(trace)
    cmd = [sys.executable, "-m", "sglang_cp_hicache", "fleet", "--no-progress", "--engine", "scheduler",
           "--trace", str(trace), "--layers", "1", "--l3", str(tmp_path / "l3"), "--in-flight", "1",
           "--deployment", "0.5.23:cp4", "--deployment", "0.5.18:cp2", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=sim_env(), capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # ok: every deployment's requests' hits per tier add up to what its own scheduler summary says
    assert summary["ok"] and summary["engine"] == "scheduler" and "SGLang's scheduler" in proc.stdout
    assert summary["corrupted_pages"] == 0 and summary["requests_lost"] == 0
    d0, d1 = summary["deployments"]
    assert [d["series"]["request_index"] for d in (d0, d1)] == [[0, 2, 4, 6, 8], [1, 3, 5, 7]]
    for me, other, second in ((d0, d1, 8), (d1, d0, 7)):
        assert me["ok"] and me["engine_hit_tokens_per_tier"] == me["hit_tokens_per_tier"]
        # the pair's six pages: only the other deployment stored them, this one restored them from L3
        # and checked every row on its owner before the forward
        assert me["l3_restored_pages_by_writer"].get(other["name"], 0) > 0, me["l3_restored_pages_by_writer"]
        assert me["l3_restored_from_other_deployment"] == sum(me["l3_restored_pages_by_writer"].values())
        # the other deployment runs the other release: its pages are the same bytes under the same keys
        assert me["l3_restored_from_other_release"] == me["l3_restored_from_other_deployment"]
        k = me["series"]["request_index"].index(second)
        assert 0 < me["series"]["l3_hit_tokens"][k] <= 6 * _P and me["series"]["device_hit_tokens"][k] == 0
        assert me["verified_pages"] > 0 and me["l3_written_bytes"] > 0 and me["l3_read_bytes"] > 0
    starts = {i: t for d in (d0, d1) for i, t in zip(d["series"]["request_index"], d["series"]["start_seconds"])}
    assert [starts[i] for i in range(9)] == sorted(starts.values()), "a request started before an earlier one"


def check_each_restored_the_others_pages(proc: subprocess.CompletedProcess, summary: dict,
                                         shape: tuple[str, int, str, int]) -> None:
    """A two-deployment fleet of ``shape`` (release, CP size of each) that
    passed: nothing corrupted or lost, each deployment restored (and
    checked byte for byte) pages only the other stored, and every request
    is accounted for."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary["ok"] and summary["corrupted_pages"] == 0 and summary["requests_lost"] == 0
    a, b = summary["deployments"]
    assert (a["release"], a["cp_size"], b["release"], b["cp_size"]) == shape
    for me, other in ((a, b), (b, a)):
        assert me["ok"] and me["ranks_agree"] and me["verified_pages"] > 0
        # pages only the other deployment stored, restored here and checked byte for byte
        assert me["l3_restored_pages_by_writer"].get(other["name"], 0) > 0, me["l3_restored_pages_by_writer"]
        cross_release = me["release"] != other["release"]
        assert me["l3_restored_from_other_release"] == (me["l3_restored_from_other_deployment"] if cross_release
                                                         else 0)
        assert me["hit_tokens_per_tier"]["l3"] > 0 and me["l3_written_bytes"] > 0
    assert summary["store_size"][-1]["objects"] > 0
    check_accounting(summary)


@pytest.mark.slow(35)
@pytest.mark.waits  # mostly waits out a timeout or a death, little CPU
def test_a_deployment_killed_mid_run_loses_its_requests_and_the_other_serves_on(tmp_path):
    # deployment 1's only rank SIGKILLs itself at its first request from 16 on,
    # with its earlier requests' L3 writes possibly still in flight
    proc, summary = fleet(tmp_path, "--deployment", "0.5.18:cp1", "--deployment", "0.5.18:cp1",
                          "--fault", "1:0:16:kill")
    check_one_killed_at_16(proc, summary)


def check_one_killed_at_16(proc: subprocess.CompletedProcess, summary: dict) -> tuple[dict, dict]:
    """Round-robin over two deployments whose second was killed at its first
    request from 16 on: it lost that one, served the ones before; the first
    served everything else; nothing corrupt. The (survivor, victim)."""
    assert proc.returncode == 1, proc.stdout + proc.stderr
    survivor, victim = summary["deployments"]
    assert victim["exit_code"] != 0 and victim["requests_lost"] >= 1
    assert victim["requests_served"] >= 7  # it served until the kill: round-robin gave it every other one
    assert all(i < 16 for i in victim["series"]["request_index"])
    assert survivor["ok"] and survivor["requests_lost"] == 0
    assert survivor["series"]["request_index"][-1] == REQUESTS - 1  # everything after the kill went here
    assert summary["corrupted_pages"] == 0 and summary["verified_pages"] > 0
    assert summary["requests_lost"] == victim["requests_lost"]
    assert [p for p in summary["problems"] if victim["name"] not in p] == []
    check_accounting(summary)
    return survivor, victim
