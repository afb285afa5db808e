"""A pool of long-lived rank processes on one gloo group, driven call by call.

:func:`tests.helpers.sglang_0523.ranks.run_ranks` runs one function per rank to
completion. A stateful test needs the ranks to stay up between steps: a
:class:`RankPool` starts ``world`` processes once, forked by one spawned
zygote that imported SGLang once (SGLang's runtime context is process-global,
so each CP rank of the sharded stack needs its own process), each holding one object built from ``factory(rank, world)``, and
:meth:`RankPool.call` sends every rank the same method call and returns the
per-rank results in rank order. A rank that raises, or one that gives no
answer within ``timeout_s`` (a peer stuck in a collective), breaks the pool:
every process is ended and :class:`~tests.helpers.sglang_0523.ranks.RankError`
carries each failing rank's traceback.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import tempfile
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from sglang_cp_hicache.testing.lifetime import die_with_launcher
from sglang_cp_hicache.testing.zygote import ForkJob
from sglang_cp_hicache.testing.zygote_server import shared_zygote
from tests.helpers.sglang_0523.ranks import PRELOAD, RankError

__all__ = ["RankPool"]

_STOP = "__stop__"


def _serve(factory: Callable[[int, int], Any], rank: int, world: int, store: str, conn: Connection) -> None:
    """A rank process: join the group, build the handler, answer calls until told to stop."""
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # the ranks share the machine's cores
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
        handler = factory(rank, world)
        conn.send((True, None))
    except BaseException:
        conn.send((False, traceback.format_exc()))
        return
    while True:
        try:
            name, kwargs = conn.recv()
        except EOFError:  # the parent is gone
            return
        if name == _STOP:
            conn.send((True, None))
            return
        try:
            conn.send((True, getattr(handler, name)(**kwargs)))
        except BaseException:
            conn.send((False, traceback.format_exc()))


def _forked_serve(
    factory: Callable[[int, int], Any], rank: int, world: int, store: str, conn: Connection, zygote_pid: int
) -> None:
    """:func:`_serve` in a process the zygote forked: it lives as long as the zygote."""
    die_with_launcher(zygote_pid)
    _serve(factory, rank, world, store, conn)


class RankPool:
    """``world`` rank processes answering :meth:`call` in lockstep."""

    def __init__(self, factory: Callable[[int, int], Any], world: int, *, timeout_s: float = 120.0) -> None:
        self.world = world
        self.timeout_s = timeout_s
        self._dir = tempfile.TemporaryDirectory(prefix="cp-hicache-rank-pool-")
        store = os.path.join(self._dir.name, "gloo-store")
        ctx = multiprocessing.get_context("spawn")
        self._conns: list[Connection] = []
        jobs = []
        for rank in range(world):
            parent, child = ctx.Pipe()
            self._conns.append(parent)
            jobs.append(ForkJob(key=rank, args=(factory, rank, world, store, child), owned=(child,)))
        try:
            self._zygote = shared_zygote(ctx, PRELOAD).fork(PRELOAD, _forked_serve, jobs)
        finally:
            for job in jobs:
                job.args[-1].close()  # each rank holds the only other end of its pipe
        self._procs = [self._zygote.process(rank) for rank in range(world)]
        self._collect("start-up")

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def call(self, name: str, **kwargs: Any) -> list[Any]:
        """``handler.name(**kwargs)`` on every rank; the results in rank order."""
        if not self.alive:
            raise RankError(f"the rank pool is closed; cannot call {name}")
        for conn in self._conns:
            conn.send((name, kwargs))
        return self._collect(name)

    def _collect(self, what: str) -> list[Any]:
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        pending = dict(enumerate(self._conns))
        while pending:
            ready = wait(list(pending.values()), timeout=self.timeout_s)
            if not ready:
                failures.update({r: f"no answer to {what} within {self.timeout_s} s" for r in pending})
                break
            for rank, conn in list(pending.items()):
                if conn in ready:
                    del pending[rank]
                    try:
                        ok, payload = conn.recv()
                    except EOFError:
                        ok, payload = False, f"rank process exited during {what}"
                    (results if ok else failures)[rank] = payload
            if failures:
                break  # peers blocked in a collective would wait for the gloo timeout
        if failures:
            self.close()
            raise RankError("\n".join(f"--- rank {r} ({what}) ---\n{tb}" for r, tb in sorted(failures.items())))
        return [results[r] for r in range(self.world)]

    def close(self) -> None:
        """Stop every rank (politely if it still answers) and remove the store."""
        for conn, proc in zip(self._conns, self._procs):
            if proc.is_alive():
                try:
                    conn.send((_STOP, {}))
                except OSError:
                    pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join()
        for conn in self._conns:
            conn.close()
        if self._procs:
            self._zygote.join(timeout=5)
        self._procs, self._conns = [], []
        self._dir.cleanup()
