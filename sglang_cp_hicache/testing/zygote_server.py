"""One long-lived zygote per launching process, forking batch after batch.

A zygote spawned afresh for each run would pay the preload (torch, SGLang,
the hook check's parse of SGLang's source: 10-13 CPU-seconds) every run. A
test process starts many runs (every rank group of the real-scheduler
harness, every rank pool and every ``run_ranks`` call), and a simulator run
with a comparison two, each with the same preload, so :func:`shared_zygote`
keeps one :class:`ZygoteServer` per launching process and environment: it
runs each distinct preload once, then forks every later batch from that
state. :meth:`ZygoteServer.fork` gives a :class:`ForkBatch` (``process``,
``sentinel``, ``poll``, ``signal``, ``join``, ``pids``, ``codes``).

The server is spawned (a clean interpreter with the launcher's environment,
working directory and ``sys.path``), dies with the launcher, and its
processes die with it. Each batch's pipes reach it as descriptors passed
over the control socket (``SCM_RIGHTS``): a job's arguments may hold
``multiprocessing`` ``Connection`` objects, objects whose whole state is one
descriptor ``fd`` (a log file), and picklable values. A
process a batch forks closes every descriptor that is not its own: the other
jobs' ends, the control socket, every batch's status pipe, so each pipe still
reports end-of-file when its one writer exits. The server forks from one
Python thread plus the launcher watchdog and never runs torch ops.
"""

from __future__ import annotations

import atexit
import gc
import io
import itertools
import os
import pickle
import random
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import reduction
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Optional

from sglang_cp_hicache.testing.lifetime import die_with_launcher
from sglang_cp_hicache.testing.zygote import EXIT_STATUS_LOST, ForkedProcess, ForkJob, _close, _exit_now

__all__ = ["ForkBatch", "ZygoteServer", "shared_zygote"]

#: How many servers (one per environment and preload) one process keeps; the
#: oldest idle one beyond that is stopped (each holds torch and SGLang in memory).
MAX_SERVERS = 3


# ---- descriptors in a pickled job list ------------------------------------------
class _FdPickler(pickle.Pickler):
    """Pickles ``Connection`` objects as indices into a descriptor list sent alongside."""

    def __init__(self, buf: io.BytesIO) -> None:
        super().__init__(buf, protocol=pickle.HIGHEST_PROTOCOL)
        self.fds: list[int] = []
        self._index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, Connection):
            return ("conn", self._fd_index(obj, obj.fileno()), obj.readable, obj.writable)
        if _is_fd_holder(obj):
            return ("holder", self._fd_index(obj, obj.fd), type(obj))
        return None

    def _fd_index(self, obj: Any, fd: int) -> int:
        index = self._index.get(id(obj))
        if index is None:
            index = self._index[id(obj)] = len(self.fds)
            self.fds.append(fd)
        return index


def _is_fd_holder(obj: Any) -> bool:
    """An object whose whole state is one descriptor, ``fd`` (a log file handed to a process)."""
    state = getattr(obj, "__dict__", None)
    return isinstance(state, dict) and list(state) == ["fd"] and isinstance(state["fd"], int) \
        and not isinstance(state["fd"], bool)


class _FdUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, fds: list[int]) -> None:
        super().__init__(io.BytesIO(data))
        self._fds = fds
        self._objs: dict[int, Any] = {}  # descriptor index -> the object rebuilt around it

    def persistent_load(self, pid: Any) -> Any:
        got = self._objs.get(pid[1])
        if got is not None:
            return got
        if pid[0] == "conn":
            _, index, readable, writable = pid
            got = Connection(self._fds[index], readable=readable, writable=writable)
        else:
            _, index, cls = pid
            got = cls.__new__(cls)
            got.fd = self._fds[index]
        self._objs[pid[1]] = got
        return got

    @property
    def unused_fds(self) -> list[int]:
        return [fd for i, fd in enumerate(self._fds) if i not in self._objs]


def _dumps(obj: Any) -> tuple[bytes, list[int]]:
    buf = io.BytesIO()
    pickler = _FdPickler(buf)
    pickler.dump(obj)
    return buf.getvalue(), pickler.fds


def _send(control: Connection, message: tuple, fds: list[int]) -> None:
    """One framed message, then its descriptors in one SCM_RIGHTS message."""
    control.send_bytes(pickle.dumps((message, len(fds)), protocol=pickle.HIGHEST_PROTOCOL))
    if fds:
        with socket.fromfd(control.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            reduction.sendfds(sock, fds)


def _recv(control: Connection) -> tuple[tuple, list[int]]:
    message, nfds = pickle.loads(control.recv_bytes())
    fds: list[int] = []
    if nfds:
        with socket.fromfd(control.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            fds = list(reduction.recvfds(sock, nfds))
    return message, fds


# ---- the server process -----------------------------------------------------------
@dataclass
class _Live:
    """A batch the server forked: its status pipe and the processes not reaped yet."""

    status: Connection
    by_pid: dict[int, int] = field(default_factory=dict)  # pid -> job key


def _server_main(control: Connection, launcher_pid: int) -> None:
    die_with_launcher(launcher_pid)
    preloaded: set[bytes] = set()
    batches: dict[int, _Live] = {}
    pidfds: dict[int, tuple[int, int]] = {}  # pidfd -> (batch id, pid)
    me = os.getpid()
    while True:
        ready = wait([control, *pidfds])
        for fd in [r for r in ready if isinstance(r, int)]:
            batch_id, pid = pidfds.pop(fd)
            os.close(fd)
            _, wait_status = os.waitpid(pid, 0)
            live = batches[batch_id]
            key = live.by_pid.pop(pid)
            _report(live.status, ("exit", key, os.waitstatus_to_exitcode(wait_status)))
            if not live.by_pid:
                live.status.close()  # end-of-file: the batch is over
                del batches[batch_id]
        if control not in ready:
            continue
        try:
            message, fds = _recv(control)
        except (EOFError, OSError):
            _exit_now(0)  # the launcher is gone or done; the processes die with this one
        if message[0] == "stop":
            _exit_now(0)
        if message[0] == "signal":
            _, batch_id, key, signum = message
            live = batches.get(batch_id)
            for pid, k in list(live.by_pid.items()) if live else []:
                if k == key:
                    _kill(pid, signum)
            continue
        _, batch_id, preload_blob, payload = message
        if preload_blob not in preloaded:
            preloaded.add(preload_blob)
            try:
                pickle.loads(preload_blob)()
            except BaseException:  # noqa: BLE001 - each process meets the same error itself and reports it
                pass
            gc.collect()
            gc.freeze()  # what the preloads imported lives as long as every process
        unpickler = _FdUnpickler(payload, fds)
        target, jobs, status = unpickler.load()
        _close(tuple(Connection(fd) for fd in unpickler.unused_fds))
        live = batches[batch_id] = _Live(status)
        for job in jobs:
            pid = os.fork()
            if pid == 0:
                others = [c for c in (control, *(b.status for b in batches.values()))]
                _run_forked(job, jobs, others, list(pidfds), target, me)
            live.by_pid[pid] = job.key
            pidfds[os.pidfd_open(pid)] = (batch_id, pid)
            _report(status, ("pid", job.key, pid))
        for job in jobs:
            _close(job.owned)
        if not jobs:
            status.close()
            del batches[batch_id]


def _report(status: Connection, message: tuple) -> None:
    try:
        status.send(message)
    except OSError:
        pass  # the launcher closed the batch: nobody reads it


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:
        pass


def _run_forked(job: ForkJob, jobs: list[ForkJob], others: list[Connection], pidfds: list[int],
                target: Callable[..., None], server_pid: int) -> None:
    """In a forked process: drop every descriptor that is not this job's, run, never return."""
    code = 1
    try:
        for other in jobs:
            if other is not job:
                _close(other.owned)
        _close(tuple(others))
        for fd in pidfds:
            try:
                os.close(fd)
            except OSError:
                pass
        random.seed()
        target(*job.args, server_pid)
        code = 0
    finally:
        _exit_now(code)


# ---- the launcher's side --------------------------------------------------------
class ForkBatch:
    """The processes of one :meth:`ZygoteServer.fork`: a ``Zygote``'s interface for them."""

    def __init__(self, server: "ZygoteServer", batch_id: int, keys: list[int], status: Connection) -> None:
        self._server = server
        self._id = batch_id
        self._keys = keys
        self._status = status
        self.pids: dict[int, int] = {}
        self.codes: dict[int, int] = {}
        self._eof = False

    def process(self, key: int) -> ForkedProcess:
        if key not in self._keys:
            raise ValueError(f"key must be one of {self._keys}, got {key!r}")
        return ForkedProcess(self, key)

    @property
    def ended(self) -> bool:
        """Whether the batch's status reached its end (every process reaped, or the server gone)."""
        return self._eof

    @property
    def sentinel(self) -> Connection:
        """Ready when a status arrives or the batch (or the server) is over."""
        return self._status

    def poll(self, timeout: float = 0.0) -> None:
        while not self._eof and self._status.poll(timeout):
            timeout = 0.0
            try:
                kind, key, value = self._status.recv()
            except (EOFError, OSError):
                self._lost()
                return
            (self.pids if kind == "pid" else self.codes)[key] = value
        if len(self.codes) == len(self._keys):
            self._server._open.discard(self._id)

    def _lost(self) -> None:
        """End of the batch's status: a process with no status left is gone with the server."""
        self._eof = True
        for key in self._keys:
            self.codes.setdefault(key, EXIT_STATUS_LOST)
        self._server._open.discard(self._id)  # the pipe stays open: callers still wait on the sentinel

    def signal(self, key: int, signum: int) -> None:
        """Send ``signum`` to a process; one not forked yet gets it once forked."""
        self.poll()
        if key in self.codes:
            return
        pid = self.pids.get(key)
        if pid is not None:
            _kill(pid, signum)
        else:
            self._server._signal(self._id, key, signum)

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait until every process of the batch exited; past ``timeout``, kill what is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._eof and len(self.codes) < len(self._keys):
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                for key in self._keys:
                    self.signal(key, signal.SIGKILL)
                end = time.monotonic() + 2.0
                while not self._eof and len(self.codes) < len(self._keys) and time.monotonic() < end:
                    self.poll(0.1)
                return
            self.poll(min(left, 1.0))


class ZygoteServer:
    """A spawned process that runs each preload once and forks batches on request."""

    def __init__(self, ctx: Any, *, launcher_pid: int, name: str = "zygote-server") -> None:
        self._ctx = ctx
        self._control, theirs = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=_server_main, args=(theirs, launcher_pid), name=name, daemon=True)
        try:
            self._proc.start()
        finally:
            theirs.close()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._open: set[int] = set()  # batches with a process not known to have exited
        self.batches = 0

    @property
    def idle(self) -> bool:
        return not self._open

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid

    def fork(self, preload: Callable[[], None], target: Callable[..., None], jobs: list[ForkJob]) -> ForkBatch:
        """Fork ``target(*job.args, server_pid)`` for every job once ``preload`` ran in the server.

        The caller still owns its copies of the jobs' ``owned`` ends and closes them."""
        keys = [job.key for job in jobs]
        if len(set(keys)) != len(keys):
            raise ValueError(f"jobs must have distinct keys, got {keys}")
        reader, writer = self._ctx.Pipe(duplex=False)
        try:
            payload, fds = _dumps((target, jobs, writer))
            batch_id = next(self._ids)
            with self._lock:
                _send(self._control, ("fork", batch_id, pickle.dumps(preload), payload), fds)
        except BaseException:
            reader.close()
            raise
        finally:
            writer.close()  # the server holds the only write end: EOF once the batch is over
        self.batches += 1
        if jobs:
            self._open.add(batch_id)
        return ForkBatch(self, batch_id, keys, reader)

    def _signal(self, batch_id: int, key: int, signum: int) -> None:
        try:
            with self._lock:
                _send(self._control, ("signal", batch_id, key, signum), [])
        except OSError:
            pass

    def close(self) -> None:
        """Stop the server; processes it still runs die with it. One still
        starting reads the request only once started: it is killed instead."""
        try:
            with self._lock:
                _send(self._control, ("stop",), [])
        except OSError:
            pass
        self._proc.join(timeout=1.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5.0)
        self._control.close()


_SERVERS: dict[tuple, ZygoteServer] = {}
# Variables that change from test to test without changing what a preload imports.
_VOLATILE_ENV = ("PYTEST_CURRENT_TEST",)


def _server_key(preload: Callable[[], None]) -> tuple:
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k not in _VOLATILE_ENV))
    return (os.getpid(), pickle.dumps(preload), os.getcwd(), tuple(sys.path), env)


def shared_zygote(ctx: Any, preload: Callable[[], None]) -> ZygoteServer:
    """This process's server for ``preload`` in the current environment
    (the server is a clean interpreter started with it; batches with another
    preload or environment get their own, so none sees what another's
    preload imported or patched), started on first use; a dead one is
    replaced. Beyond :data:`MAX_SERVERS`, the oldest idle one is stopped."""
    key = _server_key(preload)
    server = _SERVERS.get(key)
    if server is not None and server.alive:
        return server
    for stale in [k for k, s in _SERVERS.items() if k[0] != os.getpid() or not s.alive]:
        del _SERVERS[stale]  # a forked copy of this registry, or a server that died
    for old in [k for k, s in _SERVERS.items() if s.idle][: max(0, len(_SERVERS) + 1 - MAX_SERVERS)]:
        _SERVERS.pop(old).close()
    server = _SERVERS[key] = ZygoteServer(ctx, launcher_pid=os.getpid(), name="shared-zygote")
    return server


@atexit.register
def _stop_all() -> None:
    for key in list(_SERVERS):
        server = _SERVERS.pop(key)
        if key[0] == os.getpid():
            server.close()
