"""``fleet --l3 mooncake`` end to end on the committed slice: the fleet
starts one ``mooncake_master`` on loopback and every CP rank of every
deployment opens its own client lending a segment. Two deployments of
different CP sizes restore each other's pages; the master restarted
mid-run; a deployment killed mid-run, its clients' segments gone with it.

SGLang 0.5.18 deployments only: the mooncake wheel is in ``.venv`` alone
(``.venv-0523`` has none, and the fleet refuses a deployment whose
environment lacks it, naming the flag). The checks are
tests/sim/test_fleet.py's, on a Mooncake store instead of a directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.sim.test_fleet import check_accounting, check_each_restored_the_others_pages, check_one_killed_at_16, fleet

pytest.importorskip("mooncake.store", reason="the mooncake wheel (mooncake-transfer-engine-non-cuda) is not installed")

MOONCAKE = ("--mooncake-segment", "16mb")
SEGMENT = 16 << 20


def _mooncake(summary: dict, ranks: int) -> dict:
    """The run's Mooncake facts: the fleet's own master, a 16 MiB segment per rank, all of them mounted;
    the master stopped at the end, its log kept only when the run failed."""
    m = summary["mooncake"]
    master = m["own_masters"]["fleet"]
    with pytest.raises(ProcessLookupError):
        os.kill(master["pid"], 0)
    assert Path(master["log"]).is_file() == (not summary["ok"])
    assert list(m["own_masters"]) == ["fleet"] and m["external_master"] is None
    assert m["segment_bytes_per_rank"] == SEGMENT and m["capacity_bytes"] == ranks * SEGMENT
    assert summary["l3_dir"] == "mooncake" and all(d["l3_dir"] == f"mooncake://{m['own_masters']['fleet']['address']}"
                                                   for d in summary["deployments"])
    return m


@pytest.mark.slow(20)
def test_two_cp_sizes_restore_each_others_pages_from_one_mooncake_cluster(tmp_path):
    proc, summary = fleet(tmp_path, "--deployment", "0.5.18:cp1", "--deployment", "0.5.18:cp2", *MOONCAKE,
                          l3="mooncake")
    check_each_restored_the_others_pages(proc, summary, ("0.5.18", 1, "0.5.18", 2))
    m = _mooncake(summary, ranks=3)
    assert m["master_restarts"] == [] and m["own_masters"]["fleet"]["starts"] == 1
    for key in ("l3_write_failures", "l3_dropped_writes", "l3_read_failures", "l3_timeouts", "l3_rejected_objects"):
        assert summary[key] == 0, key  # a healthy store loses nothing


@pytest.mark.slow(45)
def test_a_master_restarted_mid_run_forgets_its_objects_and_the_fleet_serves_on(tmp_path):
    # the master SIGKILLed and started again on its port once request 20 (of 40) started
    proc, summary = fleet(tmp_path, "--deployment", "0.5.18:cp1", "--deployment", "0.5.18:cp1", *MOONCAKE,
                          "--fault-master-restart", "20", l3="mooncake")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary["ok"] and summary["requests_lost"] == 0 and summary["corrupted_pages"] == 0
    assert summary["l3_rejected_objects"] == 0  # forgotten pages are misses, never refused objects
    m = _mooncake(summary, ranks=2)
    (restart,) = m["master_restarts"]
    assert restart["after_request"] == 20 and restart["old_pid"] != restart["new_pid"]
    assert m["own_masters"]["fleet"]["starts"] == 2
    # it held objects and the new one held none of them: every later lookup of those is a miss
    assert restart["keys_before"] > 0 and restart["keys_after"] < restart["keys_before"]
    # every client found the new master (the fleet waits for them) and wrote to it
    assert restart["clients_back_seconds"] is not None
    assert summary["store_size"][-1]["objects"] > 0
    for d in summary["deployments"]:
        assert d["ok"] and d["requests_lost"] == 0 and d["verified_pages"] > 0
        assert max(d["series"]["request_index"]) > 20  # served after the restart
    check_accounting(summary)
    assert "master restarted after request 20" in proc.stdout  # the table says what happened


@pytest.mark.slow(30)
def test_a_client_leaving_with_its_segment_loses_its_requests_and_l3_objects_and_the_other_serves_on(tmp_path):
    # deployment 1's only rank (a client lending a segment) SIGKILLs itself at its first request from 16 on
    proc, summary = fleet(tmp_path, "--deployment", "0.5.18:cp1", "--deployment", "0.5.18:cp1", *MOONCAKE,
                          "--fault", "1:0:16:kill", l3="mooncake")
    survivor, victim = check_one_killed_at_16(proc, summary)
    _mooncake(summary, ranks=2)
    assert summary["l3_rejected_objects"] == 0
    # what the store lost with the segment: the survivor's writes and reads that went to it failed, or
    # (once the master saw the client expire, 10 s on) the objects it held left the store
    lost_io = survivor["l3_write_failures"] + survivor["l3_read_failures"]
    sizes = [(s["requests"], s["objects"]) for s in summary["store_size"]]
    before = max(n for r, n in sizes if r <= 16)
    after = min(n for r, n in sizes if r > 17)  # the victim's first request from 16 on is 17
    assert lost_io > 0 or after < before, (lost_io, sizes)
    assert summary["l3_write_failures"] + summary["l3_read_failures"] == lost_io  # the victim reported nothing
    assert f"{victim['name']} exited" in proc.stdout


def test_deployment_scope_gives_each_deployment_its_own_master_and_the_fleet_stops_them(tmp_path):
    from sglang_cp_hicache.sim.fleet.l3 import FleetL3

    store = FleetL3("mooncake", "deployment", "32mb")
    store.open(["d0", "d1"], str(tmp_path))
    try:
        a, b = store.flags("d0"), store.flags("d1")
        assert a[0] == b[0] == "--l3" and a[1] != b[1] and a[2:] == b[2:] == ["--mooncake-segment", "32mb"]
        assert (store.where("d0"), store.where("d1")) == (a[1], b[1])
        assert sorted(store.masters) == ["d0", "d1"] and store.sample(0, 0.0).objects == 0
        assert sorted(p.name for p in tmp_path.iterdir()) == ["mooncake_master-d0.log", "mooncake_master-d1.log"]
    finally:
        store.stop()
    assert all(m.proc is not None and m.proc.poll() is not None for m in store.masters.values())
    assert store.as_dict()["own_masters"].keys() == {"d0", "d1"}
