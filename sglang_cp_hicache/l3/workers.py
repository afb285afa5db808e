"""L3 I/O off the scheduler thread: a bounded pool of worker threads whose
jobs have deadlines and can be cancelled.

Storage can hang (a stuck NFS read, an unreachable store). A hung job must
never hold up later ones, and nothing it touches may be reused while it can
still write:

* every job has a deadline; the scheduler thread asks :meth:`L3Job.overdue`
  and gives up on it (``cancel``) rather than waiting;
* a cancelled job never writes shared memory again: it writes only through
  :meth:`L3Job.publish`, which checks the cancel flag under the job's lock
  (held for one page's memcpy, never across I/O), so once ``cancel``
  returns, the host rows it was given may be reused at once;
* a thread stuck in an overdue job is replaced by a spare thread, so the
  pool keeps ``threads`` threads serving the queue; at most ``threads +
  spare`` threads exist, and when every one of them is stuck new jobs wait
  in the queue until their own deadline passes (a miss, never a hang).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

from sglang_cp_hicache.validation import check_int

__all__ = ["L3Cancelled", "L3Job", "L3Workers"]

#: The longest deadline a job gets (a year): far inside ``threading.TIMEOUT_MAX``.
_LONGEST_WAIT_S = 365 * 86400.0

logger = logging.getLogger(__name__)


class L3Cancelled(Exception):
    """Raised inside a job by :meth:`L3Job.publish` once the job is cancelled."""


class L3Job:
    """One unit of L3 I/O: runs ``fn(job, *args)`` on a worker thread."""

    def __init__(self, fn: Callable[..., Any], args: tuple, deadline: float, what: str) -> None:
        self.fn = fn
        self.args = args
        self.deadline = deadline  # time.monotonic() seconds
        self.what = what
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._cancelled = False
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self.started = False

    # ---- the scheduler's side ---------------------------------------------------------
    def done(self) -> bool:
        return self._done.is_set()

    def overdue(self, now: Optional[float] = None) -> bool:
        """Past its deadline and not done."""
        return not self.done() and (time.monotonic() if now is None else now) > self.deadline

    def cancel(self) -> None:
        """From now on the job publishes nothing (waits for at most one
        publish in progress: one page's memcpy)."""
        with self._lock:
            self._cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def result(self) -> Any:
        """The job's return value; raises what the job raised (done jobs only)."""
        if not self.done():
            raise RuntimeError(f"L3 job {self.what} is not done")
        if self._error is not None:
            raise self._error
        return self._result

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._done.wait(timeout)

    # ---- the worker's side ------------------------------------------------------------
    def publish(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (a write into memory the scheduler owns) unless the job
        is cancelled; raises :class:`L3Cancelled` if it is."""
        with self._lock:
            if self._cancelled:
                raise L3Cancelled(self.what)
            fn()

    def _run(self) -> None:
        self.started = True
        try:
            if self._cancelled:
                raise L3Cancelled(self.what)
            self._result = self.fn(self, *self.args)
        except BaseException as exc:  # reported by result(), never lost in a thread
            self._error = exc
        finally:
            self._done.set()


class L3Workers:
    """``threads`` worker threads (plus up to ``spare`` replacing stuck ones)
    running :class:`L3Job` s in submission order."""

    def __init__(self, name: str, threads: int, spare: Optional[int] = None) -> None:
        check_int("threads", threads, 1)
        self.spare = threads if spare is None else spare
        check_int("spare", self.spare, 0)
        self.name = name
        self.threads = threads
        self._cond = threading.Condition()
        self._queue: deque[L3Job] = deque()
        self._running: set[L3Job] = set()
        self._alive = 0
        self._serial = 0
        self._closed = False
        self._warned_full = False

    def submit(self, fn: Callable[..., Any], *args: Any, timeout_s: float, what: str = "L3 I/O") -> L3Job:
        """Queue ``fn(job, *args)``; it must be done within ``timeout_s``
        seconds from now or its caller gives up on it."""
        if not 0 < timeout_s < float("inf"):
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
        # A wait past threading.TIMEOUT_MAX raises OverflowError: no deadline goes beyond it.
        job = L3Job(fn, args, time.monotonic() + min(timeout_s, _LONGEST_WAIT_S), what)
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self.name}: the L3 workers are shut down")
            self._queue.append(job)
            self._grow_locked()
            self._cond.notify()
        return job

    def stuck(self) -> int:
        """Threads running a job past its deadline."""
        now = time.monotonic()
        with self._cond:
            return sum(1 for j in self._running if j.overdue(now))

    def _target_locked(self) -> int:
        now = time.monotonic()
        stuck = sum(1 for j in self._running if j.overdue(now))
        return min(self.threads + stuck, self.threads + self.spare)

    def _grow_locked(self) -> None:
        target = self._target_locked()
        while self._alive < target:
            self._alive += 1
            self._serial += 1
            threading.Thread(
                target=self._loop, name=f"{self.name}-{self._serial}", daemon=True
            ).start()
        if self._alive >= self.threads + self.spare and self._all_stuck_locked() and not self._warned_full:
            self._warned_full = True
            logger.error(
                "%s: all %d L3 I/O threads are stuck past their deadline; new L3 operations miss "
                "until one returns (storage unreachable?)", self.name, self._alive,
            )

    def _all_stuck_locked(self) -> bool:
        now = time.monotonic()
        return len(self._running) >= self._alive and all(j.overdue(now) for j in self._running)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    if self._alive > self._target_locked():
                        self._alive -= 1  # a replacement no longer needed
                        return
                    self._cond.wait(1.0)
                if not self._queue:
                    self._alive -= 1
                    return
                job = self._queue.popleft()
                self._running.add(job)
                self._grow_locked()  # this thread may be the one that gets stuck
            try:
                job._run()
            finally:
                with self._cond:
                    self._running.discard(job)
                    self._warned_full = False

    def wait(self, jobs: list[Optional[L3Job]], timeout: Optional[float] = None) -> bool:
        """Block until every job is done or past its deadline (its caller
        then gives up on it: never longer than the deadline); False if
        ``timeout`` ran out first."""
        end = None if timeout is None else time.monotonic() + timeout
        for job in jobs:
            if job is None:
                continue
            until = job.deadline + 0.01 if end is None else min(job.deadline + 0.01, end)
            job.wait(max(0.0, until - time.monotonic()))
            if not job.done() and not job.overdue():
                return False
        return True

    def shutdown(self) -> None:
        """Stop taking jobs; idle threads exit (a stuck one exits when its job returns)."""
        with self._cond:
            self._closed = True
            queued, self._queue = list(self._queue), deque()
            self._cond.notify_all()
        for job in queued:  # never started: done at once, as cancelled
            job.cancel()
            job._run()
