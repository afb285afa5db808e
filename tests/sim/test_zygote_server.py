"""The shared zygote (``testing/zygote_server.py``): one server forks batch after
batch, each batch's processes see only their own descriptors, exit statuses
come back per batch, and one server serves one preload and environment."""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import signal
import time

import pytest

from sglang_cp_hicache.testing import zygote_server
from sglang_cp_hicache.testing.zygote import ForkJob
from sglang_cp_hicache.testing.zygote_server import ZygoteServer, shared_zygote

CTX = mp.get_context("spawn")


def _count_preload(path: str) -> None:
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")


def _echo(conn, word: str, server_pid: int) -> None:
    """Say who we are, then do what the parent says: exit, fail, or wait for EOF."""
    conn.send((word, os.getppid(), server_pid))
    what = conn.recv()
    if what == "fail":
        raise RuntimeError("told to fail")
    if what == "wait":
        try:
            conn.recv()
        except EOFError:
            pass


def _batch(server: ZygoteServer, preload, words: list[str]):
    """Fork one ``_echo`` per word; the parent's pipe ends and the batch."""
    mine, jobs = [], []
    for key, word in enumerate(words):
        parent, child = CTX.Pipe()
        mine.append(parent)
        jobs.append(ForkJob(key=key, args=(child, word), owned=(child,)))
    batch = server.fork(preload, _echo, jobs)
    for job in jobs:
        job.args[0].close()
    return mine, batch


@pytest.fixture(scope="module")
def preloads(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("zygote-server") / "preloads")


@pytest.fixture(scope="module")
def server(preloads):
    """One server for this module's tests (each start imports the package, torch with it)."""
    started = ZygoteServer(CTX, launcher_pid=os.getpid(), name="test-zygote-server")
    yield started
    started.close()


def test_one_server_forks_batch_after_batch_and_each_reports_its_own_exits(server, preloads):
    preload = functools.partial(_count_preload, preloads)
    first, a = _batch(server, preload, ["a0", "a1"])
    assert [c.recv() for c in first] == [("a0", server.pid, server.pid), ("a1", server.pid, server.pid)]
    first[0].send("exit")
    first[1].send("wait")
    a.join(timeout=1.0)  # a1 waits for its pipe's EOF: past the timeout the join kills it
    assert a.codes == {0: 0, 1: -signal.SIGKILL}

    second, b = _batch(server, preload, ["b0", "b1", "b2"])
    assert [c.recv()[0] for c in second] == ["b0", "b1", "b2"]
    second[0].send("fail")
    second[1].send("exit")
    second[2].send("wait")
    procs = [b.process(k) for k in range(3)]
    procs[2].terminate()
    b.join(timeout=30)
    assert b.codes == {0: 1, 1: 0, 2: -signal.SIGTERM}
    assert not procs[2].is_alive() and procs[2].exitcode == -signal.SIGTERM
    assert server.idle
    with open(preloads) as f:
        assert f.read().split() == [str(server.pid)]  # the preload ran once, in the server


def test_a_batch_pipe_reports_eof_while_another_batch_still_runs(server, preloads):
    """Each forked process closes every descriptor that is not its own: a
    pipe whose one writer exited reads EOF, and a batch's status ends, even
    while a process of another batch (forked later, holding nothing of the
    first) is alive."""
    preload = functools.partial(_count_preload, preloads)
    first, a = _batch(server, preload, ["a0"])
    second, b = _batch(server, preload, ["b0"])
    assert first[0].recv()[0] == "a0" and second[0].recv()[0] == "b0"
    second[0].send("wait")
    first[0].send("exit")
    assert first[0].poll(30)
    with pytest.raises(EOFError):
        first[0].recv()
    a.join(timeout=30)
    assert a.codes == {0: 0} and b.codes == {} and not server.idle
    deadline = time.monotonic() + 10
    while not a.ended and time.monotonic() < deadline:
        a.poll(0.1)
    assert a.ended  # b0 holds no copy of a's status pipe: it ends
    second[0].close()  # b0 reads EOF and exits
    b.join(timeout=30)
    assert b.codes == {0: 0} and server.idle


def test_duplicate_keys_are_refused_and_nothing_is_forked(server, preloads):
    preload = functools.partial(_count_preload, preloads)
    before = server.batches
    parent, child = CTX.Pipe()
    jobs = [ForkJob(key=0, args=(child, "x"), owned=(child,)), ForkJob(key=0, args=(child, "y"), owned=(child,))]
    with pytest.raises(ValueError, match="jobs must have distinct keys"):
        server.fork(preload, _echo, jobs)
    assert server.batches == before and server.idle
    child.close()
    with pytest.raises(EOFError):  # no process holds the child's end
        parent.recv()


class _FakeServer:
    """Stands in for a started server: the registry's choices, not a process."""

    def __init__(self, ctx, *, launcher_pid: int, name: str) -> None:
        self.alive, self.idle, self.closed = True, True, False

    def close(self) -> None:
        self.closed = True


def test_one_server_per_preload_and_environment_the_oldest_idle_stopped(monkeypatch, tmp_path):
    monkeypatch.setattr(zygote_server, "ZygoteServer", _FakeServer)
    monkeypatch.setattr(zygote_server, "_SERVERS", {})
    one = functools.partial(_count_preload, str(tmp_path / "one"))
    other = functools.partial(_count_preload, str(tmp_path / "other"))
    first = shared_zygote(CTX, one)
    assert shared_zygote(CTX, one) is first
    second = shared_zygote(CTX, other)
    assert second is not first
    monkeypatch.setenv("SGLANG_CP_HICACHE_TEST_ZYGOTE", "1")
    third = shared_zygote(CTX, one)
    assert third not in (first, second)
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test")  # changes every test: not a new server
    assert shared_zygote(CTX, one) is third
    monkeypatch.delenv("SGLANG_CP_HICACHE_TEST_ZYGOTE")
    assert shared_zygote(CTX, one) is first
    first.idle = False  # a batch still runs on it: it stays, the oldest idle one goes
    monkeypatch.setenv("SGLANG_CP_HICACHE_TEST_ZYGOTE", "2")
    fourth = shared_zygote(CTX, one)
    assert (first.closed, second.closed, third.closed) == (False, True, False)
    assert len(zygote_server._SERVERS) == zygote_server.MAX_SERVERS
    third.alive = False  # a dead server is replaced
    monkeypatch.setenv("SGLANG_CP_HICACHE_TEST_ZYGOTE", "1")
    assert shared_zygote(CTX, one) not in (first, second, third, fourth)


class _Holder:
    """A log file handed to a process: its whole state is one descriptor."""

    def __init__(self, fd: int) -> None:
        self.fd = fd


def _write_to(holder: _Holder, text: str, server_pid: int) -> None:
    os.write(holder.fd, text.encode())


def test_a_descriptor_holder_reaches_the_process_as_its_own_descriptor(server, preloads, tmp_path):
    preload = functools.partial(_count_preload, preloads)
    with open(tmp_path / "log", "wb+") as log:
        holder = _Holder(log.fileno())
        batch = server.fork(preload, _write_to, [ForkJob(key=0, args=(holder, "written by the fork"), owned=(holder,))])
        batch.join(timeout=30)
        assert batch.codes == {0: 0}
        log.seek(0)
        assert log.read() == b"written by the fork"
