"""The L3 I/O threads: deadlines, cancellation, no head-of-line blocking."""

from __future__ import annotations

import threading
import time

import pytest

from sglang_cp_hicache.l3.workers import L3Cancelled, L3Workers


def test_jobs_run_off_the_callers_thread_and_report_results_and_errors():
    workers = L3Workers("t", 2)
    try:
        ok = workers.submit(lambda job, x: x * 2, 21, timeout_s=5)
        bad = workers.submit(lambda job: 1 / 0, timeout_s=5)
        name = workers.submit(lambda job: threading.current_thread().name, timeout_s=5)
        assert workers.wait([ok, bad, name], timeout=5)
        assert ok.result() == 42
        with pytest.raises(ZeroDivisionError):
            bad.result()
        assert name.result().startswith("t-") and name.result() != threading.current_thread().name
    finally:
        workers.shutdown()


def test_a_hung_job_does_not_hold_up_later_ones():
    """Every thread busy with a job stuck past its deadline: a spare thread
    takes over, and later jobs finish long before the stuck ones."""
    release = threading.Event()
    workers = L3Workers("t", 2, spare=2)
    try:
        stuck = [workers.submit(lambda job: release.wait(30), timeout_s=0.05) for _ in range(2)]
        time.sleep(0.2)  # both threads are in their jobs, past the deadline
        assert all(j.overdue() for j in stuck) and workers.stuck() == 2
        later = [workers.submit(lambda job, i=i: i, timeout_s=5) for i in range(5)]
        assert workers.wait(later, timeout=5)
        assert [j.result() for j in later] == list(range(5))
        assert not any(j.done() for j in stuck)
    finally:
        release.set()
        workers.shutdown()


def test_when_every_thread_is_stuck_new_jobs_wait_only_until_their_deadline():
    release = threading.Event()
    workers = L3Workers("t", 1, spare=1)
    try:
        for _ in range(2):
            workers.submit(lambda job: release.wait(30), timeout_s=0.05)
        time.sleep(0.2)
        late = workers.submit(lambda job: 1, timeout_s=0.1)
        start = time.monotonic()
        assert workers.wait([late], timeout=5)  # ready to be given up on, not done
        assert time.monotonic() - start < 1.0
        assert late.overdue() and not late.done()
    finally:
        release.set()
        workers.shutdown()


def test_a_cancelled_job_publishes_nothing_once_cancel_returns():
    reached, go = threading.Event(), threading.Event()
    written: list[int] = []

    def job_fn(job):
        job.publish(lambda: written.append(1))
        reached.set()
        go.wait(5)
        job.publish(lambda: written.append(2))  # after cancel: refused
        return "unreachable"

    workers = L3Workers("t", 1)
    try:
        job = workers.submit(job_fn, timeout_s=5)
        assert reached.wait(5)
        job.cancel()
        go.set()
        assert job.wait(5)
        with pytest.raises(L3Cancelled):
            job.result()
        assert written == [1]
    finally:
        workers.shutdown()


def test_shutdown_finishes_queued_jobs_as_cancelled():
    release, running = threading.Event(), threading.Event()
    workers = L3Workers("t", 1, spare=0)
    busy = workers.submit(lambda job: (running.set(), release.wait(5))[1], timeout_s=5)
    assert running.wait(5)
    queued = workers.submit(lambda job: 1, timeout_s=5)
    workers.shutdown()
    assert queued.done() and queued.cancelled
    with pytest.raises(RuntimeError, match="shut down"):
        workers.submit(lambda job: 1, timeout_s=1)
    release.set()
    assert busy.wait(5) and busy.result() is True


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf")])
def test_a_deadline_must_be_positive_and_finite(bad):
    workers = L3Workers("t", 1)
    try:
        with pytest.raises(ValueError, match="timeout_s must be a finite number > 0"):
            workers.submit(lambda job: 1, timeout_s=bad)
    finally:
        workers.shutdown()


def test_a_huge_deadline_is_waited_on_without_overflow():
    """threading's waits raise OverflowError past TIMEOUT_MAX (~292 years);
    a job's deadline stops well inside it, so waiting on it works."""
    workers = L3Workers("t", 1)
    release = threading.Event()
    try:
        job = workers.submit(lambda job: release.wait(5), timeout_s=1e300)
        assert workers.wait([job], timeout=0.05) is False  # not done, not overdue: a plain timeout
        release.set()
        assert workers.wait([job]) and job.result() is True  # no timeout: waits on the capped deadline
    finally:
        release.set()
        workers.shutdown()


@pytest.mark.parametrize("bad", [float("inf"), 1e300, 86401])
def test_a_timeout_setting_beyond_a_day_is_refused_naming_it(bad):
    from sglang_cp_hicache.l3.location import L3Timeouts

    with pytest.raises(ValueError, match=r"prefetch_timeout_max in hicache_storage_backend_extra_config must be a number of seconds in \[0, 86400\]"):
        L3Timeouts.from_extra_config({"prefetch_timeout_max": bad})
