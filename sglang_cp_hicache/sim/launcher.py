"""Start simulator processes (spawn), watch them, collect their reports.

The CP ranks join one gloo group on a free localhost port, bounded by the
collective timeout. The launcher never blocks on a child: it polls the queue
and the exit codes. When one process fails (a :class:`RankFailure` arrives, or
it exits non-zero), the others get ``grace_s`` seconds to exit by themselves
(they normally do at once: gloo reports the lost peer), then they are
terminated, then killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

from sglang_cp_hicache.sim.config import FailureInjection, RankSpec, SimConfig
from sglang_cp_hicache.sim.progress import ProgressBar
from sglang_cp_hicache.sim.records import Progress, RankFailure, RankReport
from sglang_cp_hicache.sim.worker import rank_main

__all__ = ["LaunchResult", "free_port", "launch"]

_POLL_S = 0.1


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LaunchResult:
    label: str
    reports: list[RankReport] = field(default_factory=list)
    failures: list[RankFailure] = field(default_factory=list)  # in arrival order
    exit_codes: dict[int, Optional[int]] = field(default_factory=dict)
    killed: list[int] = field(default_factory=list)  # ranks the launcher had to end
    log_dir: str = ""
    wall_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures and all(code == 0 for code in self.exit_codes.values())


def launch(
    config: SimConfig,
    requests: tuple[tuple[int, ...], ...],
    *,
    cp_mode: bool,
    failure: Optional[FailureInjection] = None,
    show_progress: bool = True,
) -> LaunchResult:
    """Run the CP ranks (``cp_mode``) or the one non-CP process to completion."""
    ctx = mp.get_context("spawn")
    messages = ctx.Queue()
    log_dir = tempfile.mkdtemp(prefix="sglang-cp-hicache-sim-")
    port = free_port() if cp_mode else 0
    ranks = list(range(config.cp_size)) if cp_mode else [-1]
    label = f"CP{config.cp_size}" if cp_mode else "non-CP"
    result = LaunchResult(label=label, log_dir=log_dir)
    procs: dict[int, mp.process.BaseProcess] = {}
    for rank in ranks:
        name = f"rank{rank}" if rank >= 0 else "noncp"
        spec = RankSpec(
            config=config, rank=rank, cp_mode=cp_mode, master_port=port, requests=requests,
            log_path=os.path.join(log_dir, f"{name}.log"),
            progress=show_progress and rank in (0, -1), failure=failure,
        )
        proc = ctx.Process(target=rank_main, args=(spec, messages), name=f"sim-{name}", daemon=True)
        proc.start()
        procs[rank] = proc

    bar = ProgressBar(label, len(requests)) if show_progress else None
    start = time.perf_counter()
    first_failure_at: Optional[float] = None

    def handle(msg: object) -> None:
        nonlocal first_failure_at
        if isinstance(msg, Progress):
            if bar is not None:
                bar.update(msg.done)
        elif isinstance(msg, RankReport):
            result.reports.append(msg)
        elif isinstance(msg, RankFailure):
            result.failures.append(msg)
            if first_failure_at is None:
                first_failure_at = time.perf_counter()

    try:
        while True:
            try:
                handle(messages.get(timeout=_POLL_S))
                continue  # drain everything queued before looking at the processes
            except queue_module.Empty:
                pass
            for rank, proc in procs.items():
                if proc.exitcode not in (None, 0) and first_failure_at is None:
                    first_failure_at = time.perf_counter()
            alive = [r for r, p in procs.items() if p.is_alive()]
            if not alive:
                break
            if first_failure_at is not None and time.perf_counter() - first_failure_at > config.grace_s:
                _stop(procs, alive)
                result.killed = alive
                break
    except BaseException:  # Ctrl-C, SIGTERM (see cli), or a launcher bug: never leave ranks behind
        _stop(procs, [r for r, p in procs.items() if p.is_alive()])
        raise
    finally:
        if bar is not None:
            bar.close()
    # whatever was still in flight when the last process exited
    deadline = time.perf_counter() + 2.0
    while time.perf_counter() < deadline:
        try:
            handle(messages.get(timeout=0.2))
        except (queue_module.Empty, EOFError, OSError):
            break
    for rank, proc in procs.items():
        proc.join(timeout=5.0)
        result.exit_codes[rank] = proc.exitcode
    result.reports.sort(key=lambda r: r.rank)
    result.wall_seconds = time.perf_counter() - start
    messages.close()
    messages.cancel_join_thread()
    if result.ok:
        shutil.rmtree(log_dir, ignore_errors=True)
        result.log_dir = ""
    return result


def _stop(procs: dict[int, mp.process.BaseProcess], ranks: list[int]) -> None:
    for rank in ranks:
        procs[rank].terminate()
    deadline = time.perf_counter() + 3.0
    for rank in ranks:
        procs[rank].join(timeout=max(deadline - time.perf_counter(), 0.1))
    for rank in ranks:
        if procs[rank].is_alive():
            procs[rank].kill()
            procs[rank].join(timeout=2.0)
