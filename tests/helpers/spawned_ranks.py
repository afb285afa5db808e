"""Rank processes started fresh (``spawn``), for the tests that kill one:
each runs ``target(rank, world, *args)``; the test waits a bounded time for
all of them and fails on a hang, never waits forever."""

from __future__ import annotations

import multiprocessing
import time
from typing import Any, Callable

__all__ = ["run_spawned_ranks"]


def run_spawned_ranks(target: Callable[..., Any], world: int, *args: Any, bound_s: float) -> list[Any]:
    """Start ``world`` spawned processes running ``target(rank, world, *args)``
    and join them within ``bound_s`` seconds in all; any still running then is
    killed and reaped, and the call fails naming them (a hang). Returns the
    processes, in rank order, for their exit codes."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world, *args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + bound_s
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.1))
    alive = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not alive, f"rank processes still running (a hang): {alive}"
    return procs
