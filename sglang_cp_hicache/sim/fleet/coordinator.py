"""Run a fleet: start each deployment, release the requests, collect.

Each deployment is one ``simulate`` process started by its release's
Python (:mod:`.spec`) that serves the request indices fed to it
(:mod:`.feed`): on the loop engine its ranks read them and serve them one
at a time; on the scheduler engine the process driving SGLang's scheduler
reads them and submits each while fewer than ``in_flight`` of its requests
are unfinished, and SGLang's scheduler batches them.

The coordinator releases the trace's requests one at a time, in trace
order: request i goes to the deployment the router picks (:mod:`.router`),
and request i+1 is released only once that deployment has *started*
request i (loop engine: its rank 0 began serving it; scheduler engine: it
was submitted to SGLang, whose queue orders it within the deployment). So
no deployment starts a request before every earlier request, wherever it
was routed, has started, while requests on different deployments run at
the same time (a deployment that cannot take request i yet, still serving
request i-1 or with its window full, makes request i wait; the others keep
serving theirs). A deployment that dies loses the requests it had not
finished; later requests are routed among the live ones.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from sglang_cp_hicache.sim.fleet.feed import FeedWriter, make_feed_dir, parse_done, wait_readable
from sglang_cp_hicache.sim.fleet.router import Router
from sglang_cp_hicache.sim.fleet.spec import DeploymentSpec
from sglang_cp_hicache.sim.fleet.store_size import StoreSample
from sglang_cp_hicache.testing.lifetime import end_process

__all__ = ["Deployment", "FleetRun", "run_fleet"]

_POLL_S = 0.05
#: Store-size samples over the replay (plus one at the end).
SAMPLES = 8


@dataclass
class Deployment:
    """One deployment while the fleet runs."""

    spec: DeploymentSpec
    name: str
    command: list[str]
    l3_dir: Optional[str]
    json_path: str
    log_path: str
    env: dict[str, str]
    readers: int  # processes reading its feed: every rank (loop engine) or the scheduler's driver (1)
    feed_dir: str = ""
    proc: Optional[subprocess.Popen] = None
    writer: Optional[FeedWriter] = None
    ready: bool = False
    sent: list[int] = field(default_factory=list)  # request indices released to it, in order
    done: dict[int, float] = field(default_factory=dict)  # index -> when it finished (perf_counter)
    hits: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # index -> (device, host, l3) tokens
    verified: int = 0  # owned pages checked, every rank, finished requests
    corrupted: int = 0
    started: dict[int, float] = field(default_factory=dict)  # index -> when it started (perf_counter)
    exit_code: Optional[int] = None
    died_at_request: Optional[int] = None  # the next request to release when it was seen dead

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class FleetRun:
    """What the coordinator saw."""

    deployments: list[Deployment]
    store_samples: list[StoreSample]
    startup_seconds: float
    replay_seconds: float
    wall_seconds: float
    unrouted: list[int]  # requests released when no deployment was alive
    replay_t0: float  # perf_counter() when the first request was released


def _start(dep: Deployment, work: str, position: int) -> None:
    dep.feed_dir = os.path.join(work, f"feed-{position}")
    os.mkdir(dep.feed_dir)
    make_feed_dir(dep.feed_dir, dep.readers)
    dep.writer = FeedWriter(dep.feed_dir, dep.readers)
    with open(dep.log_path, "wb") as log:
        dep.proc = subprocess.Popen([*dep.command, "--fleet-feed", dep.feed_dir], stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, env=dep.env)


def _pump(deps: list[Deployment], router: Router, timeout: float) -> None:
    """Read every event available within ``timeout`` seconds."""
    readers = [d.writer.events for d in deps if d.writer is not None]
    for reader in wait_readable(readers, timeout):
        dep = next(d for d in deps if d.writer is not None and d.writer.events is reader)
        for words in reader.read():
            if words[0] == "ready":
                dep.ready = True
            elif words[0] == "start":
                dep.started[int(words[1])] = time.perf_counter()
            done = parse_done(words)
            if done is None:
                continue
            dep.verified += done.verified
            dep.corrupted += done.corrupted
            if done.rank == 0:
                dep.done[done.index] = time.perf_counter()
                dep.hits[done.index] = (done.device, done.host, done.l3)
                router.finished(deps.index(dep))


def _note_deaths(deps: list[Deployment], next_request: int) -> None:
    for dep in deps:
        if dep.proc is not None and dep.died_at_request is None and dep.proc.poll() is not None:
            dep.died_at_request = next_request


def _say(show: bool, text: str) -> None:
    if show:
        print(f"fleet: {text}", file=sys.stderr, flush=True)


def run_fleet(deps: list[Deployment], requests: Sequence[Sequence[int]], router: Router, *,
              startup_timeout_s: float, finish_timeout_s: float, show_progress: bool,
              measure: Callable[[int, float], StoreSample],
              on_started: Optional[Callable[[int], None]] = None, store_ends_with_clients: bool = False) -> FleetRun:
    """Start every deployment, release ``requests`` in order, end them, wait.
    ``measure(requests released, seconds)``: the store's size now;
    ``on_started(i)``: called once request i has started (a test's fault);
    ``store_ends_with_clients``: the store's objects leave with the
    deployments' clients (Mooncake segments): sample it last before they end."""
    t0 = time.perf_counter()
    samples: list[StoreSample] = []
    unrouted: list[int] = []
    with tempfile.TemporaryDirectory(prefix="sglang-cp-hicache-fleet-") as work:
        try:
            for position, dep in enumerate(deps):
                _start(dep, work, position)
            _say(show_progress, f"starting {len(deps)} deployments: " + ", ".join(d.name for d in deps))
            deadline = time.monotonic() + startup_timeout_s
            while not all(d.ready or not d.alive for d in deps) and time.monotonic() < deadline:
                _pump(deps, router, _POLL_S)
            startup = time.perf_counter() - t0
            _say(show_progress, f"{sum(d.ready for d in deps)}/{len(deps)} deployments ready after {startup:.1f} s")
            t1 = time.perf_counter()
            n = len(requests)
            sample_at = {max(0, (k * n) // SAMPLES - 1) for k in range(1, SAMPLES)}
            for i, tokens in enumerate(requests):
                _note_deaths(deps, i)
                alive = [k for k, d in enumerate(deps) if d.ready and d.alive]
                if not alive:
                    unrouted.append(i)
                    continue
                k = router.pick(tokens, alive)
                dep = deps[k]
                assert dep.writer is not None
                dep.writer.send(i)
                dep.sent.append(i)
                router.sent(k, tokens)
                while i not in dep.started and dep.alive:  # the next request waits for this one to start
                    _pump(deps, router, _POLL_S)
                if i in sample_at:
                    samples.append(measure(i + 1, time.perf_counter() - t1))
                if on_started is not None:
                    on_started(i)
                if show_progress and (i + 1) % max(1, n // 10) == 0:
                    _say(True, f"{i + 1}/{n} requests released after {time.perf_counter() - t1:.1f} s")
            if store_ends_with_clients:  # the last sample while the clients still hold their segments
                deadline = time.monotonic() + finish_timeout_s
                while any(d.alive and len(d.done) < len(d.sent) for d in deps) and time.monotonic() < deadline:
                    _pump(deps, router, _POLL_S)
                samples.append(measure(len(requests), time.perf_counter() - t1))
            for dep in deps:
                if dep.writer is not None:
                    dep.writer.end()
            deadline = time.monotonic() + finish_timeout_s
            while any(d.alive for d in deps) and time.monotonic() < deadline:
                _pump(deps, router, _POLL_S)
            _pump(deps, router, 0.0)
            replay = time.perf_counter() - t1
            _note_deaths(deps, len(requests))
            if not store_ends_with_clients:  # the last sample once every write has landed
                samples.append(measure(len(requests), replay))
        finally:
            for dep in deps:
                _stop(dep)
    return FleetRun(deps, samples, startup, replay, time.perf_counter() - t0, unrouted, t1)


def _stop(dep: Deployment) -> None:
    """End a deployment still running (its ranks die with it) and close its pipes."""
    if dep.proc is not None:
        dep.exit_code = end_process(dep.proc)
    if dep.writer is not None:
        dep.writer.close()
        dep.writer = None
