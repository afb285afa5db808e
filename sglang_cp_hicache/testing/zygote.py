"""Start a run's processes by forking one process that imported what they need.

Every simulator rank imports torch and SGLang and parses SGLang's source for
the hook check before it does anything: 5-10 CPU-seconds a process, paid
once per rank. The launcher instead spawns one *zygote* (a clean interpreter,
exactly as ``spawn`` starts a rank: the launcher's environment, working
directory and ``sys.path``), which runs a preload once and then forks every
process of the run from that state. The launched processes are the zygote's
children, so:

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
"""

from __future__ import annotations

import gc
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional

from sglang_cp_hicache.testing.lifetime import die_with_launcher

__all__ = ["ForkJob", "ForkedProcess", "Zygote"]

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


def _zygote_main(
    preload: Callable[[], None],
    target: Callable[..., None],
    jobs: list[ForkJob],
    status: Connection,
    launcher_pid: int,
) -> None:
    """The zygote: preload, fork every job, report pids and exit statuses."""
    die_with_launcher(launcher_pid)
    try:
        preload()
    except BaseException:  # noqa: BLE001 - each process meets the same error itself and reports it
        pass
    # What the preload imported lives as long as every rank: out of the
    # collector's reach (a full collection walks only what a rank allocates,
    # and never writes to the shared pages the fork left).
    gc.collect()
    gc.freeze()
    me = os.getpid()
    by_pid: dict[int, int] = {}
    for job in jobs:
        pid = os.fork()
        if pid == 0:
            _run_forked(job, jobs, status, target, me)
        by_pid[pid] = job.key
        status.send(("pid", job.key, pid))
    for job in jobs:
        _close(job.owned)
    while by_pid:
        try:
            pid, wait_status = os.wait()
        except ChildProcessError:
            break
        key = by_pid.pop(pid, None)
        if key is not None:
            status.send(("exit", key, os.waitstatus_to_exitcode(wait_status)))
    status.close()
    # Out without finalizing the interpreter: tearing down what the preload
    # imported (torch, SGLang) takes 2 CPU-seconds and frees nothing the
    # exit does not (and with the heap frozen, triton's nanobind bindings
    # would report it as leaked on the launcher's stderr).
    _exit_now(0)


def _exit_now(code: int) -> None:
    """Flush what this process printed, then exit at once (``os._exit``)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(code)


def _run_forked(job: ForkJob, jobs: list[ForkJob], status: Connection, target: Callable[..., None], zygote: int) -> None:
    """In a forked process: drop what belongs to others, run, never return."""
    code = 1
    try:
        for other in jobs:
            if other is not job:
                _close(other.owned)
        _close((status,))
        random.seed()
        target(*job.args, zygote)
        code = 0
    finally:
        _exit_now(code)


class Zygote:
    """One spawned zygote that forks ``jobs``; :meth:`process` gives each one's handle."""

    def __init__(
        self,
        ctx: Any,
        preload: Callable[[], None],
        target: Callable[..., None],
        jobs: list[ForkJob],
        *,
        launcher_pid: int,
        name: str = "zygote",
    ) -> None:
        keys = [job.key for job in jobs]
        if len(set(keys)) != len(keys):
            raise ValueError(f"jobs must have distinct keys, got {keys}")
        self._status, writer = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_zygote_main, args=(preload, target, jobs, writer, launcher_pid), name=name, daemon=True,
        )
        try:
            self._proc.start()
        finally:
            writer.close()  # the zygote holds the only write end: EOF once it exits
        self._keys = keys
        self.pids: dict[int, int] = {}
        self.codes: dict[int, int] = {}
        self._eof = False

    def process(self, key: int) -> "ForkedProcess":
        if key not in self._keys:
            raise ValueError(f"key must be one of {self._keys}, got {key!r}")
        return ForkedProcess(self, key)

    @property
    def sentinel(self) -> Connection:
        """Ready when a status arrives or the zygote is gone."""
        return self._status

    def poll(self, timeout: float = 0.0) -> None:
        """Take every status message that is there (waiting up to ``timeout`` for the first)."""
        while not self._eof and self._status.poll(timeout):
            timeout = 0.0
            try:
                kind, key, value = self._status.recv()
            except (EOFError, OSError):
                self._lost()
                return
            (self.pids if kind == "pid" else self.codes)[key] = value

    def _lost(self) -> None:
        """The zygote is gone: a process with no status left can only be gone too."""
        self._eof = True
        self._proc.join(timeout=5.0)
        lost = self._proc.exitcode if self._proc.exitcode not in (None, 0) else EXIT_STATUS_LOST
        for key in self._keys:
            self.codes.setdefault(key, lost)

    def signal(self, key: int, signum: int) -> None:
        """Send ``signum`` to a forked process, or to the zygote while it has not forked it yet."""
        self.poll()
        pid = self.pids.get(key)
        try:
            if pid is None:
                os.kill(self._proc.pid, signum)  # not forked yet: stop the zygote instead
            elif key not in self.codes:
                os.kill(pid, signum)
        except (OSError, TypeError):
            pass

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the zygote itself (after its processes)."""
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(2.0)


class ForkedProcess:
    """The part of ``multiprocessing.Process`` the launcher uses, for a forked process."""

    def __init__(self, zygote: Zygote, key: int) -> None:
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
