"""L3 file I/O off the scheduler thread: one worker thread per CP cache.

A prefetch's query (do this rank's objects exist?) and fetch (read, verify,
copy into this rank's host slots) run as jobs on the worker; until a job is
done the rank's word for that prefetch in the step's MIN all-reduce is
:data:`NOT_READY`, so the MIN is NOT_READY on every rank and every rank keeps
waiting alike; once every rank's job is done the MIN is the agreed prefix.
The scheduler thread only hashes, allocates host slots (before the fetch
job, so the slots are this prefetch's alone) and decides.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Iterable, Optional

logger = logging.getLogger(__name__)

__all__ = ["L3Io", "NOT_READY"]

#: A rank's word while its I/O for a prefetch is still running (every real
#: word is a page count, >= 0, so the MIN is NOT_READY while any rank waits).
NOT_READY = -1


class L3Io:
    """Runs L3 jobs on one worker thread (``threaded=False``: inline, for a
    caller that wants the I/O on its own thread)."""

    def __init__(self, cp_rank: int, *, threaded: bool = True) -> None:
        self.cp_rank = cp_rank
        self.threaded = threaded
        self._executor: Optional[ThreadPoolExecutor] = None

    def submit(self, fn: Callable[..., int], *args: Any) -> Future:
        if not self.threaded:
            done: Future = Future()
            try:
                done.set_result(fn(*args))
            except Exception as exc:  # reported by outcome(), as a thread's would be
                done.set_exception(exc)
            return done
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"cp-hicache-l3-rank{self.cp_rank}")
        return self._executor.submit(fn, *args)

    def outcome(self, job: Future, what: str) -> int:
        """A finished job's page count; one that raised counts 0 (logged):
        the group then hears of it as a prefix of 0."""
        try:
            return int(job.result())
        except Exception:
            logger.exception("cp-hicache L3: %s failed on cp_rank %d", what, self.cp_rank)
            return 0

    @staticmethod
    def wait(jobs: Iterable[Optional[Future]], timeout: Optional[float] = None) -> bool:
        """Block until every job is done; False if ``timeout`` ran out first."""
        pending = [j for j in jobs if j is not None]
        if not pending:
            return True
        _, not_done = wait(pending, timeout)
        return not not_done

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
