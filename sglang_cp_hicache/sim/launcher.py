"""Start simulator processes, watch them, collect their reports.

The processes are forked by one spawned zygote that imported what a rank
needs once (:mod:`.zygote`): a clean interpreter with the launcher's
environment, as ``spawn`` gives each rank, without paying SGLang's import in
every process. It is the launcher process's shared one
(:mod:`.zygote_server`), so a second run of the same process forks from it
too.

The CP ranks join one gloo group on a free localhost port, bounded by the
start-up and collective timeouts. Each process has its own pipe to the
launcher (it holds the only write end, so the pipe reports end-of-file when it
exits) and an unnamed log file (:mod:`.ranklog`); it ends by itself if the
launcher disappears (:mod:`.lifetime`). The launcher never blocks on a child:
it waits on the pipes and the process sentinels together. When one process
fails (a :class:`RankFailure` arrives, or it exits non-zero), the others get
``grace_s`` seconds to exit by themselves (they normally do at once: gloo
reports the lost peer), then they are terminated, then killed.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Optional

from sglang_cp_hicache.sim.config import FailureInjection, RankSpec, SimConfig
from sglang_cp_hicache.sim.packed import PackedRequests
from sglang_cp_hicache.sim.progress import ProgressBar, StartupProgress
from sglang_cp_hicache.sim.ranklog import RankLog, save_logs
from sglang_cp_hicache.sim.records import Progress, RankFailure, RankReport, StartupEvent
from sglang_cp_hicache.sim.worker import forked_rank_main, preload_release
from sglang_cp_hicache.testing.zygote import ForkedProcess, ForkJob
from sglang_cp_hicache.testing.zygote_server import ForkBatch, shared_zygote

__all__ = ["LaunchResult", "free_port", "launch"]

_POLL_S = 0.1
#: After the last process exited: how long its pipe may take to report
#: end-of-file (a descriptor leaked to a grandchild would keep it open).
_DRAIN_S = 2.0
#: After the launcher stopped the processes: how long it waits for them to go.
_STOP_WAIT_S = 8.0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LaunchResult:
    label: str
    reports: list[RankReport] = field(default_factory=list)
    failures: list[RankFailure] = field(default_factory=list)  # in the order they happened (``at``)
    exit_codes: dict[int, Optional[int]] = field(default_factory=dict)
    killed: list[int] = field(default_factory=list)  # ranks the launcher had to end
    log_dir: str = ""  # the kept logs of a failed run ("" when the run passed)
    wall_seconds: float = 0.0
    startup_seconds: Optional[float] = None  # spawn to the last stack built (None: never got there)
    # time.monotonic() when the launcher saw each process exit (the ranks'
    # RankFailure.at uses the same clock)
    exit_seen_at: dict[int, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures and all(code == 0 for code in self.exit_codes.values())


def log_name(rank: int) -> str:
    """``rank3`` for CP ranks, ``noncp`` / ``noncp1`` ... for the non-CP baseline."""
    if rank >= 0:
        return f"rank{rank}"
    return "noncp" if rank == -1 else f"noncp{-1 - rank}"


def launch(
    config: SimConfig,
    requests: PackedRequests,
    *,
    cp_mode: bool,
    failure: Optional[FailureInjection] = None,
    show_progress: bool = True,
) -> LaunchResult:
    """Run the CP ranks (``cp_mode``) or the non-CP baseline to completion.

    Non-CP processes have negative ranks: -1 (the only one with
    ``non_cp_group="single"``), -2, ... (the other TP ranks with ``"tp"``).

    Call it from a thread that outlives the run (the main thread in the CLI):
    the ranks' parent-death signal fires when the thread that started them
    exits.
    """
    ctx = mp.get_context("spawn")
    ranks = list(range(config.cp_size)) if cp_mode else [-1 - i for i in range(config.non_cp_ranks)]
    port = free_port() if len(ranks) > 1 else 0
    label = f"CP{config.cp_size}" if cp_mode else "non-CP"
    result = LaunchResult(label=label)
    procs: dict[int, ForkedProcess] = {}
    channels: dict[int, Connection] = {}
    logs: dict[int, RankLog] = {}
    startup = StartupProgress(label, len(ranks), show=show_progress)
    bar = ProgressBar(label, len(requests)) if show_progress else None
    start = time.perf_counter()
    zygote: Optional[ForkBatch] = None
    try:
        jobs, writers = [], []
        for rank in ranks:
            logs[rank] = RankLog(log_name(rank))
            spec = RankSpec(
                config=config, rank=rank, cp_mode=cp_mode, master_port=port, requests=requests,
                log=logs[rank].for_child(), launcher_pid=os.getpid(),
                progress=show_progress and rank in (0, -1), failure=failure,
            )
            channels[rank], writer = ctx.Pipe(duplex=False)
            writers.append(writer)
            jobs.append(ForkJob(key=rank, args=(spec, writer), owned=(writer, spec.log)))
        try:
            # This process's shared zygote: a second run (--compare-non-cp,
            # --compare-upstream) forks from the one that imported SGLang already.
            preload = functools.partial(preload_release, config.sglang_version)
            zygote = shared_zygote(ctx, preload).fork(preload, forked_rank_main, jobs)
        finally:
            for writer in writers:
                writer.close()  # each process holds the only write end of its pipe: EOF when it exits
        procs.update({rank: zygote.process(rank) for rank in ranks})
        _watch(config, procs, channels, result, startup, bar)
    except BaseException:  # Ctrl-C, SIGTERM (see cli), or a launcher bug: never leave ranks behind
        _stop(procs, [r for r, p in procs.items() if p.is_alive()])
        if zygote is not None:
            zygote.join(timeout=2.0)
        for log in logs.values():
            log.close()
        raise
    finally:
        if bar is not None:
            bar.close()
        for channel in channels.values():
            channel.close()
    _collect(result, procs, [logs[r] for r in ranks], start)
    zygote.join(timeout=5.0)
    result.startup_seconds = startup.done_at
    return result


def _collect(
    result: LaunchResult, procs: dict[int, ForkedProcess], logs: list[RankLog], start: float
) -> None:
    """Exit codes, failures in the order they happened, reports by rank,
    the run's wall time; the logs are kept only when the run failed."""
    for rank, proc in procs.items():
        proc.join(timeout=5.0)
        result.exit_codes[rank] = proc.exitcode
    result.failures.sort(key=lambda f: f.at)
    result.reports.sort(key=lambda r: r.rank)
    result.wall_seconds = time.perf_counter() - start
    if not result.ok or len(result.reports) != len(logs):
        result.log_dir = save_logs(logs)
    for log in logs:
        log.close()


def _watch(
    config: SimConfig,
    procs: dict[int, ForkedProcess],
    channels: dict[int, Connection],
    result: LaunchResult,
    startup: StartupProgress,
    bar: Optional[ProgressBar],
) -> None:
    """Read every pipe and watch every process until all are done."""
    open_channels = dict(channels)
    running = dict(procs)
    first_failure_at: Optional[float] = None
    drain_deadline: Optional[float] = None
    stop_deadline: Optional[float] = None

    def handle(msg: object) -> None:
        nonlocal first_failure_at
        if isinstance(msg, Progress):
            if bar is not None:
                bar.update(msg.done)
        elif isinstance(msg, StartupEvent):
            startup.update(msg.rank, msg.phase)
            if startup.done_at is not None and bar is not None:
                bar.begin()  # the replay's clock starts when every stack is built
        elif isinstance(msg, RankReport):
            result.reports.append(msg)
        elif isinstance(msg, RankFailure):
            result.failures.append(msg)
            if first_failure_at is None:
                first_failure_at = time.monotonic()

    while open_channels or running:
        # the processes share one sentinel (the zygote's status pipe): wait on it once
        sentinels = {id(p.sentinel): p.sentinel for p in running.values()}
        waitables = list(open_channels.values()) + list(sentinels.values())
        ready = set(wait(waitables, timeout=_POLL_S))
        for rank, channel in list(open_channels.items()):
            if channel not in ready:
                continue
            try:
                msg = channel.recv()
            except Exception:  # EOF (it exited), a cut-off or unreadable message: nothing more comes
                del open_channels[rank]
                continue
            handle(msg)
        now = time.monotonic()
        for rank, proc in list(running.items()):
            if proc.exitcode is not None:
                del running[rank]
                result.exit_seen_at[rank] = now
                if proc.exitcode != 0 and first_failure_at is None:
                    first_failure_at = now
        if not running:
            drain_deadline = drain_deadline if drain_deadline is not None else now + _DRAIN_S
            if now > drain_deadline:
                break
        if stop_deadline is not None:
            if now > stop_deadline:
                break  # unkillable (e.g. stuck in the kernel): report what we have
        elif first_failure_at is not None and running and now - first_failure_at > config.grace_s:
            alive = sorted(running)
            _stop(procs, alive)
            result.killed = alive
            stop_deadline = time.monotonic() + _STOP_WAIT_S


def _stop(procs: dict[int, ForkedProcess], ranks: list[int]) -> None:
    for rank in ranks:
        procs[rank].terminate()
        try:  # a stopped process (SIGSTOP) acts on the SIGTERM only once continued
            os.kill(procs[rank].pid, signal.SIGCONT)
        except (OSError, TypeError):
            pass
    deadline = time.perf_counter() + 3.0
    for rank in ranks:
        procs[rank].join(timeout=max(deadline - time.perf_counter(), 0.1))
    for rank in ranks:
        if procs[rank].is_alive():
            procs[rank].kill()
            procs[rank].join(timeout=2.0)
