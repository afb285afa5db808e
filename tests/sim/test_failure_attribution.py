"""The launcher's headline names the rank that failed first, not a healthy
peer that then lost its connection to it."""

from __future__ import annotations

import pytest

from sglang_cp_hicache.sim.config import FAIL_ENV
from sglang_cp_hicache.sim.failures import describe_exit, first_cause, is_peer_loss
from sglang_cp_hicache.sim.launcher import LaunchResult
from sglang_cp_hicache.sim.records import RankFailure, RankReport
from sglang_cp_hicache.sim.report import failure_message
from tests.sim.simrun import BOUND_S, simulate

CLOSED = ("DistBackendError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
          "Connection closed by peer [127.0.0.1]:4242")
TIMED_OUT = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
             "Timed out waiting 3000ms for recv operation to complete")


def failure(rank: int, at: float, error: str, step: int | None = 7) -> RankFailure:
    return RankFailure(rank=rank, step=step, error=error, traceback="Traceback ...", at=at)


def result(failures, exit_codes, *, seen=None, killed=(), reports=()) -> LaunchResult:
    return LaunchResult(label="CP4", failures=list(failures), exit_codes=dict(exit_codes),
                        exit_seen_at=dict(seen or {}), killed=list(killed), reports=list(reports),
                        log_dir="/tmp/sim-logs")


def test_a_rank_killed_by_a_signal_is_named_not_the_peer_that_lost_it():
    # what the launcher sees after SIGKILL of rank 2: rank 3's error even arrives
    # before the launcher notices rank 2's exit
    r = result(
        [failure(3, 10.50, CLOSED), failure(0, 10.60, CLOSED), failure(1, 10.70, CLOSED)],
        {0: 1, 1: 1, 2: -9, 3: 1}, seen={2: 10.55, 0: 10.8, 1: 10.8, 3: 10.8},
    )
    cause = first_cause(r)
    assert (cause.rank, cause.kind) == (2, "died")
    lines = failure_message(r).splitlines()
    assert lines[0] == "CP4: rank 2 died first: killed by SIGKILL, without a report"
    assert lines[1] == "  its output: /tmp/sim-logs/rank2.log"
    assert [ln for ln in lines if ln.startswith("  then")] == [
        f"  then rank {r} failed at request 7: {CLOSED}" for r in (3, 0, 1)
    ]
    assert lines[-1] == "  logs of every process: /tmp/sim-logs"


def test_a_stopped_rank_is_named_not_the_peers_that_timed_out_on_it():
    # SIGSTOP of rank 2: the others time out; rank 2 neither reports nor exits
    r = result(
        [failure(3, 20.0, TIMED_OUT), failure(0, 20.1, CLOSED), failure(1, 20.1, TIMED_OUT)],
        {0: 1, 1: 1, 2: -15, 3: 1}, killed=[2],
    )
    assert (first_cause(r).rank, first_cause(r).kind) == (2, "hung")
    headline = failure_message(r).splitlines()[0]
    assert headline.startswith("CP4: rank 2 stopped answering collectives: its peers gave up waiting for it")
    assert "the launcher terminated it" in headline


def test_a_real_error_beats_the_symptoms_whatever_the_arrival_order():
    r = result(
        [failure(0, 5.2, CLOSED), failure(1, 5.0, "ValueError: host_indices must be 1-D", step=3)],
        {0: 1, 1: 1},
    )
    lines = failure_message(r).splitlines()
    assert lines[0] == "CP4: rank 1 failed at request 3: ValueError: host_indices must be 1-D"
    assert lines[1] == "  traceback and output: /tmp/sim-logs/rank1.log"
    assert lines[2] == f"  then rank 0 failed at request 7: {CLOSED}"


def test_the_earliest_of_several_causes_wins():
    r = result(
        [failure(1, 9.0, "RuntimeError: late"), failure(3, 4.0, "KeyError: 'early'", step=None)],
        {0: 0, 1: 1, 2: 3, 3: 1}, seen={2: 6.0},
    )
    assert first_cause(r).rank == 3
    assert failure_message(r).splitlines()[0] == "CP4: rank 3 failed during startup: KeyError: 'early'"
    # a silent exit earlier than every error is the cause
    r.exit_seen_at[2] = 3.0
    assert failure_message(r).splitlines()[0] == "CP4: rank 2 died first: exited with status 3, without a report"


def test_only_symptoms_name_the_earliest_with_the_timeout_hint():
    r = result([failure(1, 2.0, TIMED_OUT), failure(0, 1.0, TIMED_OUT)], {0: 1, 1: 1})
    lines = failure_message(r).splitlines()
    assert lines[0].startswith("CP4: rank 0 failed at request 7: RuntimeError: [") and "Timed out" in lines[0]
    assert "longer than --collective-timeout" in lines[1]


def test_a_rank_that_reported_is_not_blamed_for_its_exit():
    report = RankReport.__new__(RankReport)
    report.rank = 0
    r = result([failure(1, 1.0, "RuntimeError: boom")], {0: 0, 1: 1}, reports=[report])
    assert first_cause(r).rank == 1
    assert first_cause(result([], {0: 0, 1: 0})) is None


@pytest.mark.parametrize(
    "error, expected",
    [
        (CLOSED, True),
        (TIMED_OUT, True),
        ("RuntimeError: Connection reset by peer", True),
        ("DistNetworkError: failed to recv, got 0 bytes", True),
        ("DistStoreError: Timed out after 181 seconds waiting for clients. 1/2 clients joined.", True),
        ("InjectedFailure: injected failure (SGLANG_CP_HICACHE_SIM_FAIL_RANK=1:2)", False),
        ("ModuleNotFoundError: No module named 'sglang.srt'", False),
        ("", False),
    ],
)
def test_peer_loss_classification(error, expected):
    assert is_peer_loss(error) is expected


def test_describe_exit():
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(-19) == "killed by SIGSTOP"
    assert describe_exit(3) == "exited with status 3"
    assert describe_exit(None) == "still running"


# ---------------------------------------------------------------------------
# End to end: the rank sends itself the signal (SGLANG_CP_HICACHE_SIM_FAIL_RANK)
# ---------------------------------------------------------------------------


@pytest.mark.slow(10)
def test_sigkill_of_a_rank_names_that_rank():
    proc, seconds = simulate("--cp-size", "2", "--requests", "10", env={FAIL_ENV: "1:3:kill"})
    assert proc.returncode == 1 and seconds < BOUND_S
    lines = proc.stderr.splitlines()
    assert lines[0] == "CP2: rank 1 died first: killed by SIGKILL, without a report", proc.stderr
    assert any(ln.startswith("  then rank 0 failed at request 3: ") for ln in lines), proc.stderr


@pytest.mark.slow(16)
@pytest.mark.waits  # mostly waits out a timeout or a death, little CPU
def test_sigstop_of_a_rank_names_that_rank():
    proc, seconds = simulate("--cp-size", "2", "--requests", "10", "--collective-timeout", "3",
                             env={FAIL_ENV: "1:3:stop"})
    assert proc.returncode == 1 and seconds < BOUND_S
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("CP2: rank 1 stopped answering collectives"), proc.stderr
    assert any(ln.startswith("  then rank 0 failed at request 3: ") for ln in lines), proc.stderr
