"""``python -m sglang_cp_hicache fleet`` end to end on the committed
Mooncake slice: two deployments of different CP sizes and releases on one
file L3 (each restores pages the other wrote, bit-exact, and requests start
in trace order across them), and a deployment killed mid-run (the other
serves on, nothing corrupt is restored, the lost requests are counted).

Runs from the 0.5.18 suite; the cross-release fleet needs ``.venv-0523``
(skipped where it is missing, except under CI, like the cross-release L3
test). Small shapes: one layer, 40 requests, pools at a tenth of the
trace's pages, so pages leave the host pools and come back from L3."""

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
PYTHON_0523 = Path(ROOT) / ".venv-0523" / "bin" / "python"
IN_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


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


@pytest.mark.slow(60)
def test_two_releases_of_different_cp_sizes_restore_each_others_pages_from_one_l3(tmp_path):
    if not PYTHON_0523.exists():
        if IN_CI:
            pytest.fail(f"under CI the cross-release fleet must run: {PYTHON_0523} is missing")
        pytest.skip(f"{PYTHON_0523} is missing (make install builds it)")
    proc, summary = fleet(tmp_path, "--deployment", "0.5.18:cp1", "--deployment", "0.5.23:cp2")
    check_each_restored_the_others_pages(proc, summary, ("0.5.18", 1, "0.5.23", 2))


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
