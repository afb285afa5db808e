"""Start a run's processes by forking one process that imported what they need.

Every simulator rank imports torch and SGLang and parses SGLang's source for
the hook check before it does anything: 5-10 CPU-seconds a process, paid
once per rank. The launcher instead forks its processes from a *zygote*
(:mod:`.zygote_server`: a clean interpreter, exactly as ``spawn`` starts a
rank: the launcher's environment, working directory and ``sys.path``), which
runs a preload once and then forks every process of the run from that state.
The launched processes are the zygote's children, so:

* the zygote reaps them and sends each pid, then each exit status, over one
  pipe; :class:`ForkedProcess` gives the launcher the part of
  ``multiprocessing.Process`` it uses (``pid``, ``sentinel``, ``exitcode``,
  ``join``, ``terminate``, ``kill``, ``is_alive``);
* lifetime is a chain: the zygote dies with the launcher and each process
  dies with the zygote (the target arms that guard with the zygote's pid);
* each forked process closes every other process's descriptors (a pipe must
  report end-of-file when its one writer exits) and reseeds ``random``.

The zygote forks from a single Python thread plus the launcher watchdog, and
the preload must not start threads or thread pools (no torch ops): a fork
copies only the calling thread, and a lock another thread held would stay
held in the child forever.

Why not the standard library's ``forkserver`` with ``set_forkserver_preload``
(the obvious replacement): it preloads module *names* only, so neither the
torchvision stand-in that must be installed before SGLang imports nor the
hook check's parse of SGLang's source (a function call) can run there; it
silently skips a module that fails to import, so a broken preload would go
unnoticed and every rank would pay the full import again; and its server is
one per launching process, its preload fixed when it first starts, for the
life of that process, whatever a later run needs. ``fork`` alone would copy
the launcher itself, with its threads and whatever it imported.

This module holds what the zygote and its launcher share: the job, the
handle of a forked process, closing descriptors, exiting at once.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Optional, Protocol

__all__ = ["ForkJob", "ForkedProcess", "ProcessStatus"]

#: Exit status recorded for a process whose status never came (the zygote
#: itself was killed before it could report it).
EXIT_STATUS_LOST = -int(signal.SIGKILL)


@dataclass
class ForkJob:
    """One process to fork: ``target(*args, zygote_pid)`` runs in it.

    ``owned`` holds the descriptors (objects with ``fileno()`` or ``fd``)
    that belong to this process alone: every other forked process closes
    them, and the zygote closes them once every process is forked.
    """

    key: int
    args: tuple
    owned: tuple = ()


def _close(objs: tuple) -> None:
    """Close each object's descriptor: through its own ``close()`` where it
    has one (a ``Connection`` would otherwise close the number again when
    collected, by then perhaps another file), else the bare ``fd``."""
    for obj in objs:
        try:
            if hasattr(obj, "close"):
                obj.close()
            elif isinstance(getattr(obj, "fd", None), int):
                os.close(obj.fd)
        except OSError:
            pass


def _exit_now(code: int) -> None:
    """Flush what this process printed, then exit at once (``os._exit``)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(code)


class ProcessStatus(Protocol):
    """Where a :class:`ForkedProcess` reads its state: the status of its batch."""

    pids: dict[int, int]
    codes: dict[int, int]

    @property
    def sentinel(self) -> Connection: ...

    def poll(self, timeout: float = 0.0) -> None: ...

    def signal(self, key: int, signum: int) -> None: ...


class ForkedProcess:
    """The part of ``multiprocessing.Process`` the launcher uses, for a forked process."""

    def __init__(self, zygote: ProcessStatus, key: int) -> None:
        self._zygote = zygote
        self.key = key

    @property
    def pid(self) -> Optional[int]:
        self._zygote.poll()
        return self._zygote.pids.get(self.key)

    @property
    def sentinel(self) -> Connection:
        return self._zygote.sentinel

    @property
    def exitcode(self) -> Optional[int]:
        self._zygote.poll()
        return self._zygote.codes.get(self.key)

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: Optional[float] = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.exitcode is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return
            self._zygote.poll(min(left, 1.0))

    def terminate(self) -> None:
        self._zygote.signal(self.key, signal.SIGTERM)

    def kill(self) -> None:
        self._zygote.signal(self.key, signal.SIGKILL)
