"""Run one function on N rank processes over a gloo group; collect their results.

SGLang 0.5.23's runtime context is process-global, so each CP rank of the
sharded stack needs its own process. :func:`run_ranks` starts ``world``
processes (forked by this process's shared zygote for the environment they
need, which imported SGLang once: a clean interpreter with this process's
environment and sys.path, reused by every later call), joins a gloo
group through a FileStore in ``workdir`` and calls
``fn(rank, world, **kwargs)`` in every one. It returns the per-rank results in
rank order, or raises :class:`RankError` with every failing rank's traceback;
a rank still running past ``timeout_s`` is terminated and reported.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import multiprocessing
import os
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterator

from sglang_cp_hicache.testing.lifetime import die_with_launcher
from sglang_cp_hicache.sim.worker import preload_release
from sglang_cp_hicache.testing.zygote import ForkJob
from sglang_cp_hicache.testing.zygote_server import shared_zygote

__all__ = ["RankError", "run_ranks"]


class RankError(RuntimeError):
    pass


def _child(fn: Callable[..., Any], rank: int, world: int, store: str, kwargs: dict, out: Connection) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # the ranks share the machine's cores
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
        result = fn(rank, world, **kwargs)
        dist.destroy_process_group()
        out.send((True, result))
    except BaseException:  # report anything to the parent
        out.send((False, traceback.format_exc()))


def _forked_child(
    fn: Callable[..., Any], rank: int, world: int, store: str, kwargs: dict, out: Connection, zygote_pid: int
) -> None:
    """:func:`_child` in a process the zygote forked: it lives as long as the zygote."""
    die_with_launcher(zygote_pid)
    _child(fn, rank, world, store, kwargs, out)
    out.close()


#: What every rank process imports first, once in the zygote.
PRELOAD = functools.partial(preload_release, "0.5.23")


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    before = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    workdir: str,
    *,
    timeout_s: float = 240.0,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """``fn(rank, world, **kwargs)`` on ``world`` processes; results in rank order.

    ``env``: extra environment variables the children start with (set before
    they import anything, e.g. ``TRITON_INTERPRET``).
    """
    ctx = multiprocessing.get_context("spawn")
    store = os.path.join(workdir, f"gloo-store-{world}")
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]  # (the parent's reader, the rank's writer)
    jobs = [ForkJob(key=r, args=(fn, r, world, store, kwargs, pipes[r][1]), owned=(pipes[r][1],))
            for r in range(world)]
    try:
        with _environ(env or {}):
            zygote = shared_zygote(ctx, PRELOAD)
        batch = zygote.fork(PRELOAD, _forked_child, jobs)
    finally:
        for _, writer in pipes:
            writer.close()  # each rank holds the only write end of its pipe
    procs = [batch.process(r) for r in range(world)]
    pending = {reader: r for r, (reader, _) in enumerate(pipes)}
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    try:
        while pending:
            ready = wait(list(pending), timeout=timeout_s)
            if not ready:
                raise RankError(f"ranks {sorted(pending.values())} gave no result within {timeout_s} s; "
                                f"failures: {failures}")
            for reader in ready:
                rank = pending.pop(reader)
                try:
                    ok, payload = reader.recv()
                except EOFError:
                    ok, payload = False, "the rank process exited without a result"
                (results if ok else failures)[rank] = payload
            if failures:
                break  # peers blocked in a collective would wait for the gloo timeout
    finally:
        for proc in procs:
            proc.join(timeout=5 if not failures else 0.5)
            if proc.is_alive():
                proc.terminate()
                proc.join()
        batch.join(timeout=5)
        for reader, _ in pipes:
            reader.close()
    if failures:
        raise RankError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())))
    return [results[r] for r in range(world)]
