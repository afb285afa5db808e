"""The fleet's parts that need no SGLang: the router's policies, the
deployment flag, the feed pipes between coordinator and ranks, and the
flags refused before any deployment starts."""

from __future__ import annotations

import os
import sys

import pytest

from sglang_cp_hicache.sim.fleet.feed import FeedWriter, ParentFeed, RankFeed, make_feed_dir, parse_done
from sglang_cp_hicache.sim.fleet.router import AffinityParams, make_router
from sglang_cp_hicache.sim.fleet.spec import DeploymentSpec, parse_deployment, python_for
from tests.sim.simrun import ROOT

P = 64


def _req(*pages: int) -> list[int]:
    """A request of whole pages, page k filled with the id ``pages[k]``."""
    return [t for p in pages for t in [p] * P]


def test_round_robin_takes_turns_and_skips_the_dead():
    r = make_router("round-robin", 3, P)
    assert [r.pick(_req(1), [0, 1, 2]) for _ in range(4)] == [0, 1, 2, 0]
    assert [r.pick(_req(1), [0, 2]) for _ in range(3)] == [2, 0, 2]


def test_least_loaded_picks_the_fewest_outstanding_then_the_fewest_tokens():
    r = make_router("least-loaded", 2, P)
    r.sent(0, _req(1))
    assert r.pick(_req(1), [0, 1]) == 1
    r.sent(1, _req(1, 2))
    r.finished(0)
    r.finished(1)
    assert r.pick(_req(1), [0, 1]) == 0  # both idle: deployment 0 was sent fewer tokens


def test_prefix_affinity_keeps_a_conversation_on_its_deployment():
    r = make_router("prefix-affinity", 2, P)
    first = r.pick(_req(1, 2), [0, 1])
    other = r.pick(_req(7, 8), [0, 1])  # no match: the smaller tree
    assert other != first
    for _ in range(3):  # each turn extends the last: a match rate above 0.5 wins
        assert r.pick(_req(1, 2, 3), [0, 1]) == first
    # matching only 1 of 4 pages (0.25) is no affinity: the smaller tree takes it
    assert r.pick(_req(1, 9, 9, 9), [0, 1]) == other


def test_prefix_affinity_falls_back_to_the_least_loaded_when_imbalanced():
    r = make_router("prefix-affinity", 2, P, AffinityParams(balance_abs_threshold=1, balance_rel_threshold=1.5))
    home = r.pick(_req(1, 2), [0, 1])
    r.sent(home, _req(1, 2))
    r.sent(home, _req(1, 2))  # 2 outstanding against 0: imbalanced
    assert r.pick(_req(1, 2, 3), [0, 1]) == 1 - home


def test_the_deployment_flag_parses_and_names_itself_when_wrong():
    assert parse_deployment("0.5.23:cp4") == DeploymentSpec("0.5.23", 4)
    assert parse_deployment("0.5.18:cp2:host=8:device=16") == DeploymentSpec("0.5.18", 2, 16, 8)
    for bad in ("0.5.19:cp2", "0.5.18", "0.5.18:2", "0.5.18:cp0", "0.5.23:cp1", "0.5.18:cp2:host=0",
                "0.5.18:cp2:hosts=4", "0.5.18:cp2:host=4:host=5"):
        with pytest.raises(ValueError, match=f"--deployment {bad}"):
            parse_deployment(bad)


def test_a_missing_interpreter_names_the_flags(tmp_path):
    with pytest.raises(ValueError, match=r"--deployment 0\.5\.23: .*--python 0\.5\.23="):
        python_for("0.5.23", {"0.5.23": str(tmp_path / "nope")}, installed="0.5.18")
    assert python_for("0.5.18", {}, installed="0.5.18") == sys.executable


def test_the_feed_carries_indices_in_order_and_events_back(tmp_path):
    make_feed_dir(str(tmp_path), 2)
    writer = FeedWriter(str(tmp_path), 2)
    ranks = [RankFeed(str(tmp_path), r) for r in range(2)]
    for i in (3, 5, 8):
        writer.send(i)
    writer.end()
    assert [list(f.indices()) for f in ranks] == [[3, 5, 8], [3, 5, 8]]
    ranks[0].ready()
    ranks[0].started(3)
    ranks[1].started(3)  # only rank 0 says when a request starts
    ranks[1].done(3, 64, 128, 64, 2, 1)
    events = writer.events.read()
    assert events[:2] == [("ready",), ("start", "3")]
    done = parse_done(events[2])
    assert done is not None and (done.rank, done.index, done.l3, done.corrupted) == (1, 3, 64, 1)
    assert len(events) == 3
    for f in ranks:
        f.close()
    writer.close()


def test_the_scheduler_engines_one_feed_reads_without_blocking_and_reports_as_rank_0(tmp_path):
    make_feed_dir(str(tmp_path), 1)  # one reader: a second FIFO nobody reads would fill and block
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events", "rank0.feed"]
    writer = FeedWriter(str(tmp_path), 1)
    parent = ParentFeed(str(tmp_path))
    assert parent.read() == [] and not parent.ended  # nothing released yet: no wait, no end
    writer.send(4)
    writer.send(7)
    assert parent.read() == [4, 7]
    writer.end()
    writer.send(9)  # nothing after the end is served
    assert parent.read() == [] and parent.ended
    parent.ready()
    parent.started(4)
    parent.done(4, 128, 64, 64, 3)
    events = writer.events.read()
    assert events[:2] == [("ready",), ("start", "4")]
    done = parse_done(events[2])
    assert done is not None and (done.rank, done.index, done.device, done.host, done.l3, done.verified,
                                 done.corrupted) == (0, 4, 128, 64, 64, 3, 0)
    parent.close()
    writer.close()


@pytest.mark.parametrize("args,needle", [
    (("--deployment", "0.5.18:cp2", "--l3-scope", "deployment"), "--l3-scope deployment needs --l3"),
    (("--deployment", "0.5.18:cpx", "--l3", "L3"), "--deployment 0.5.18:cpx"),
    (("--deployment", "0.5.18:cp2", "--python", "0.5.18=/nonexistent/python", "--l3", "L3"),
     "--python 0.5.18=/nonexistent"),
    (("--deployment", "0.5.18:cp2", "--cache-threshold", "2", "--l3", "L3"), "--cache-threshold"),
    (("--deployment", "0.5.18:cp2", "--fault", "3:0:1:kill", "--l3", "L3"), "--fault 3:0:1:kill"),
    (("--deployment", "0.5.18:cp2", "--l3", "mooncake://nohost", "--engine", "loop"), "--l3 mooncake://nohost: expected mooncake://"),
    (("--deployment", "0.5.18:cp2", "--l3", "mooncake://127.0.0.1:5", "--l3-scope", "deployment", "--engine", "loop"),
     "--l3-scope deployment with --l3 mooncake://127.0.0.1:5"),
    (("--deployment", "0.5.18:cp2", "--l3", "L3", "--mooncake-segment", "64mb"), "--mooncake-segment needs --l3"),
    (("--deployment", "0.5.18:cp2", "--l3", "mooncake", "--mooncake-segment", "8mb", "--engine", "loop"),
     "--mooncake-segment must be at least"),
    (("--deployment", "0.5.18:cp2", "--l3", "L3", "--fault-master-restart", "3"),
     "--fault-master-restart 3: needs --l3 mooncake"),
    (("--deployment", "0.5.18:cp2", "--python", "0.5.18=NO_WHEEL", "--l3", "mooncake", "--engine", "loop"),
     "--l3 mooncake: --deployment 0.5.18:cp2: "),
    (("--deployment", "0.5.18:cp2", "--l3", "mooncake"), "--l3 mooncake needs --engine loop"),
    (("--deployment", "0.5.18:cp2", "--deployment", "0.5.18:cp1", "--l3", "L3"),
     "--deployment 0.5.18:cp1: --engine scheduler with --l3 needs CP >= 2"),
    (("--deployment", "0.5.18:cp2", "--l3", "L3", "--fault", "0:0:1:kill"), "fault injection needs --engine loop"),
    (("--deployment", "0.5.18:cp2", "--l3", "L3", "--engine", "loop", "--in-flight", "2"),
     "--in-flight needs --engine scheduler"),
])
def test_bad_flags_stop_the_fleet_before_anything_starts(tmp_path, capsys, args, needle):
    from sglang_cp_hicache.__main__ import main

    l3 = tmp_path / "never"
    no_wheel = tmp_path / "python"  # an interpreter whose environment has no mooncake wheel
    no_wheel.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'mooncake'\" >&2\nexit 1\n")
    no_wheel.chmod(0o755)
    argv = [str(l3) if a == "L3" else a.replace("NO_WHEEL", str(no_wheel)) for a in args]
    trace = os.path.join(ROOT, "tests/data/mooncake_conversation_slice.jsonl")
    assert main(["fleet", "--no-progress", "--trace", trace, *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "fleet: error:" in err
    assert not l3.exists()  # nothing made, nothing started


def test_restored_pages_are_attributed_to_the_deployment_that_alone_stored_them():
    from sglang_cp_hicache.sim.fleet.coordinator import Deployment
    from sglang_cp_hicache.sim.fleet.report import _attribution

    deps = [Deployment(spec=DeploymentSpec("0.5.18", 2), name=f"d{k}", command=[], l3_dir=None, json_path="", readers=2,
                       log_path="", env={}) for k in range(3)]
    jsons = [
        {"l3_stored_keys_per_rank": [["a"], ["b"]], "l3_restored_keys_per_rank": [["c", "a"], ["x"]]},
        {"l3_stored_keys_per_rank": [["c"], ["a"]], "l3_restored_keys_per_rank": [["b"], []]},
        None,  # died before it reported: what it stored is unknown
    ]
    by_writer = _attribution(deps, jsons)
    # d0 restored its own "a" (d1 stored it too: the restorer's own copy wins), "c" from d1, "x" from nobody known
    assert by_writer[0] == {"d0": 1, "d1": 1, "unknown": 1}
    assert by_writer[1] == {"d0": 1}
    assert by_writer[2] == {}
