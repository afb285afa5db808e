"""One CPU slot per pytest-xdist worker, shared by the test command's parts.

``make test`` runs its three parts -- the 0.5.18 suite, the interpreted
re-run, the 0.5.23 suite: three pytest sessions in two virtual environments
-- at the same time, each on its own xdist workers. Alone, each part ends
with a tail: its last long test runs on one worker while the other cores
idle, and each part's start-up (collection) waits for the one before. Run
together, every test first takes one of ``PYTEST_XDIST_WORKER_COUNT`` slots
(lock files in the directory ``CP_HICACHE_TEST_SLOTS`` names), so no more
tests run at once than one part alone ran -- the same load every
timing-sensitive test was written for -- while one part's tail and
start-up are filled with the others' tests.

A worker keeps its slot across consecutive tests of one ``xdist_group``
(a shared fixture's tests): the processes of a shared fixture never sit
idle waiting for a slot between two of its tests. Without the variable
(any part run alone, a plain ``pytest``) nothing is gated.
"""

from __future__ import annotations

import fcntl
import os
import time
from typing import Optional

import pytest

__all__ = ["ENV", "SlotGate", "group_of"]

#: The directory of the slot lock files, set by ``make test`` for its parts.
ENV = "CP_HICACHE_TEST_SLOTS"
#: How long a worker sleeps between two looks for a free slot (a look is
#: one non-blocking ``flock`` per slot: no measurable CPU).
POLL_S = 0.01


def group_of(item: Optional[pytest.Item]) -> Optional[str]:
    """``item``'s ``xdist_group`` name, None for none (or no item)."""
    if item is None:
        return None
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return None
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", ""))


class SlotGate:
    """This worker's hold on one of ``count`` slots in ``directory``."""

    def __init__(self, directory: str, count: int) -> None:
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self.directory = directory
        self.count = count
        self._fd: Optional[int] = None
        self.waited_s = 0.0  # time this worker spent waiting for a slot

    @classmethod
    def for_worker(cls, config: pytest.Config) -> Optional["SlotGate"]:
        """The gate of an xdist worker under ``make test``, else None. The
        variable is taken out of this process's environment: a pytest a
        test starts (pytester, the GPU check's suite) inherits the
        environment, and must not wait for a slot its own test holds."""
        workerinput = getattr(config, "workerinput", None)
        if workerinput is None:
            return None  # the controller: its workers must still inherit the variable
        directory = os.environ.pop(ENV, None)
        if not directory:
            return None
        return cls(directory, int(workerinput["workercount"]))

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Block until this worker holds a slot (at once if it holds one)."""
        if self._fd is not None:
            return
        start = time.monotonic()
        first = os.getpid() % self.count  # workers start their look at different slots
        while True:
            for i in range(self.count):
                path = os.path.join(self.directory, f"slot-{(first + i) % self.count}")
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self._fd = fd
                self.waited_s += time.monotonic() - start
                return
            time.sleep(POLL_S)

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the descriptor drops the flock

    def around(self, item: pytest.Item, nextitem: Optional[pytest.Item]):
        """Hold a slot for ``item`` (setup, call, teardown); keep it if
        ``nextitem`` belongs to the same group. A test marked ``waits``
        (its time goes to waiting out a timeout or a dead peer, not to a
        CPU) runs without one unless its worker already holds one: it adds
        little load, and a slot held through its sleep would idle a core.
        A generator for a ``pytest_runtest_protocol`` hook wrapper."""
        if not self.held and item.get_closest_marker("waits") is not None:
            yield
            return
        self.acquire()
        try:
            yield
        finally:
            group = group_of(item)
            if group is None or group != group_of(nextitem):
                self.release()
