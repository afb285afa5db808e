"""``simulate --engine scheduler``: the simulator's workloads replayed through
SGLang's real ``Scheduler`` (:mod:`sglang_cp_hicache.testing.sched_harness`).

Each CP rank runs SGLang's own ``run_event_loop`` (0.5.18: the normal or
overlap loop over the library's ``cp-hicache`` backend; 0.5.23 at CP > 1: the
PD-prefill loop, as its sharded allocator refuses decode) with only the
model worker replaced: the forward stand-in checks, before every forward,
every prefix row attention would read on the rank that owns its page, and
fails the run on the first mismatch. SGLang's ``PrefillAdder`` picks the
batches, its chunked prefill checkpoints the chunks, and its strict idle
leak checks run whenever the ranks go idle and once more at shutdown.

Arrivals are a closed loop in the workload's order (a trace's timestamps
give that order; their gaps are not replayed): at most ``in_flight``
requests are submitted and unfinished at any time. The window is topped up
before every batch the ranks run (through the real input socket; rank 0
takes every message pushed before the batch was let go at the loop's next
``recv_requests``, :mod:`~sglang_cp_hicache.testing.sched_intake`) from the
requests that batch's gate reports finished, and whenever the ranks go idle.
No timing decides a batch: two runs of one command give the same batches
and chunks (with ``--l3`` aside: its lookups run on background threads, and
a queued request waits for its own, so when it is admitted depends on them).
A request listed in ``aborts`` gets an ``AbortReq`` right after the first
batch that carries it is let go (mid chunk when it is being chunked).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.packed import PackedRequests

if TYPE_CHECKING:  # the harness imports torch and zmq: only a run that starts pays for them
    from sglang_cp_hicache.testing.sched_config import SchedConfig
    from sglang_cp_hicache.testing.sched_forward import BatchReport
    from sglang_cp_hicache.testing.sched_harness import RunResult, SchedulerHarness
    from sglang_cp_hicache.testing.sched_rank import RankResult

__all__ = ["ARRIVALS", "L3_PREFETCH_POLICY", "EngineOptions", "LoopFactory", "SchedulerReplay", "replay_through_scheduler", "sched_config"]

#: How arrivals are paced, as the summary states it.
ARRIVALS = ("closed loop in workload order: at most in_flight requests submitted and unfinished, topped up "
            "before every batch (from the requests its gate reports finished) and whenever the ranks go idle; "
            "trace timestamps give the order only")
#: SGLang's prefetch policy under --l3: a request waits in the queue until its L3 lookup ended, so what
#: L3 holds for it is restored before it is admitted (the harness's L3 tests use it too). SGLang's default,
#: best_effort, admits a request whenever it comes up, and a hit depends on how fast the reads were.
L3_PREFETCH_POLICY = "wait_complete"
#: The stand-in model's context (its config's max_position_embeddings); longer requests stretch it.
_MODEL_CONTEXT = 8192


@dataclass(frozen=True)
class EngineOptions:
    """What the scheduler engine adds to a :class:`SimConfig`."""

    max_running_requests: int = 8
    chunked_prefill_size: int = 1024
    in_flight: Optional[int] = None  # None: max_running_requests
    max_new_tokens: int = 1
    overlap: bool = False
    aborts: frozenset[int] = frozenset()  # indices of the requests to abort after their first batch
    batch_timeout_s: float = 600.0
    # Soak runs: every this many forwards a decode batch retracts requests (SGLang's own test switch); 0: off.
    # On 0.5.18 also the insert trap (a host read of a device index inside an insert fails the run).
    forced_retract_interval: int = 0
    trap_insert_reads: bool = False
    # --l3: the directory of SGLang's file storage backend, which the library serves under CP (None: no L3)
    l3_dir: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("max_running_requests", "chunked_prefill_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.in_flight is not None and self.in_flight < 1:
            raise ValueError(f"in_flight must be >= 1, got {self.in_flight}")

    @property
    def window(self) -> int:
        return self.in_flight if self.in_flight is not None else self.max_running_requests


def sched_config(config: SimConfig, opts: EngineOptions, longest_request: int) -> "SchedConfig":
    """The harness run of a simulator config: same pools per rank (device
    pages, host pages through the host-to-device ratio), layers, CP size and
    copy path; the PD-prefill loop on 0.5.23 at CP > 1; with ``opts.l3_dir``
    SGLang's file storage backend there and :data:`L3_PREFETCH_POLICY`."""
    from sglang_cp_hicache.testing.sched_config import SchedConfig
    from sglang_cp_hicache.testing.sched_worker import PoolShape

    if opts.chunked_prefill_size % config.page_size:
        raise ValueError(f"--chunked-prefill-size must be a multiple of the page size {config.page_size}, "
                         f"got {opts.chunked_prefill_size}")
    page = config.page_size
    # 0.5.23's sharded pool takes a context of whole logical pages (a page on every rank)
    unit = page * config.cp_size
    context = -(-(longest_request + opts.max_new_tokens + page) // unit) * unit
    shape = PoolShape(page_size=page, device_pages=config.device_pages, num_layers=config.num_layers,
                      max_running_requests=opts.max_running_requests,
                      max_context_len=max(context, -(-4096 // unit) * unit), chunk_tokens=opts.chunked_prefill_size)
    extra: list[tuple[str, object]] = [("random_seed", config.seed)]
    if context > _MODEL_CONTEXT:
        extra.append(("context_length", context))
    pd = config.sglang_version == "0.5.23" and config.cp_size > 1
    return SchedConfig(
        config.sglang_version, cp_size=config.cp_size, pd_prefill=pd, overlap=opts.overlap,
        chunked_prefill_size=opts.chunked_prefill_size, shape=shape,
        hicache_ratio=config.host_pages / config.device_pages, extra_server_args=tuple(extra),
        copy_path=config.copy_path, l3_dir=opts.l3_dir, prefetch_policy=L3_PREFETCH_POLICY,
        batch_timeout_s=opts.batch_timeout_s, forced_retract_interval=opts.forced_retract_interval,
        trap_insert_reads=opts.trap_insert_reads)


@dataclass
class SchedulerReplay:
    """What the real scheduler did with the workload."""

    run: "RunResult"
    idle: list["RankResult"]  # each rank's snapshot once idle after the last request (leak checks passed)
    rids: list[str]
    aborted_on_purpose: set[str] = field(default_factory=set)
    startup_seconds: float = 0.0
    replay_seconds: float = 0.0


class _ClosedLoop:
    """Submits the workload in order with at most ``window`` unfinished.

    What counts as finished is what the ranks have certainly done by the
    moment the parent acts: the requests a batch gate reports finished, and
    every request once all ranks are idle with every pushed message
    processed. Outputs arriving over the output sockets decide nothing, so
    two runs submit each request before the same batch."""

    def __init__(self, h: "SchedulerHarness", requests: PackedRequests, opts: EngineOptions, show: bool) -> None:
        self.h, self.requests, self.opts, self.show = h, requests, opts, show
        # one width: SGLang aborts every queued request whose rid starts with the aborted one's
        width = len(str(max(len(requests) - 1, 0)))
        self.rids = [f"q{i:0{width}d}" for i in range(len(requests))]
        self.next = 0
        self.open: list[int] = []  # submitted, not known finished, oldest first
        self.finished: set[str] = set()
        self.seen: set[str] = set()
        self.aborted: set[str] = set()
        self.done = 0
        self.shown = 0
        self.start = time.perf_counter()

    def served_rids(self) -> list[str]:
        """The requests this loop submitted (every one of the workload's)."""
        return self.rids

    def _prune(self) -> None:
        still = [i for i in self.open if self.rids[i] not in self.finished]
        self.done += len(self.open) - len(still)
        self.open = still

    def top_up(self) -> None:
        self._prune()
        batch = []
        while self.next < len(self.requests) and len(self.open) < self.opts.window:
            batch.append(self.h.request(self.rids[self.next], list(self.requests[self.next]),
                                        max_new_tokens=self.opts.max_new_tokens))
            self.open.append(self.next)
            self.next += 1
        self.h.submit(*batch)
        self._progress()

    def on_batch(self, report: "BatchReport", h: "SchedulerHarness") -> None:
        self.finished.update(report.finished)
        for entry in report.entries:
            if entry.rid in self.seen:
                continue
            self.seen.add(entry.rid)
            if int(entry.rid[1:]) in self.opts.aborts:
                self.aborted.add(entry.rid)
                h.abort(entry.rid)
        self.top_up()

    def serve_open(self) -> None:
        """Serve the ranks until their next batch, or until they are idle (then every submitted request is
        finished, and the window is topped up). The batch timeout bounds the wait for the next batch, not
        the whole replay: ranks kept busy by the top-ups may not go idle before the last request."""
        h, batches = self.h, len(self.h.batches)
        h.wait_for(lambda: h.idle() or len(h.batches) != batches, self.opts.batch_timeout_s,
                   "the next batch or every rank idle")
        if h.idle():  # idle with everything pushed processed: every submitted request is finished
            self.finished.update(self.rids[i] for i in self.open)
            self.top_up()

    def run(self) -> None:
        self.h.on_batch = self.on_batch
        self.top_up()
        while self.open:
            self.serve_open()
        self.h.on_batch = None
        self.h.wait_finished(self.rids)  # every request's output, before the summary reads them

    def _progress(self) -> None:
        if not self.show or self.done - self.shown < max(1, len(self.requests) // 20):
            return
        self.shown = self.done
        print(f"sglang-cp-hicache simulate: {self.done}/{len(self.requests)} requests, "
              f"{len(self.h.batches)} batches, {time.perf_counter() - self.start:.0f}s", file=sys.stderr, flush=True)


#: Makes the loop that submits a replay's requests: (harness, requests, options, show progress) -> loop.
LoopFactory = Callable[["SchedulerHarness", PackedRequests, EngineOptions, bool], _ClosedLoop]


def replay_through_scheduler(config: SimConfig, requests: PackedRequests, opts: EngineOptions,
                             show_progress: bool = False, make_loop: Optional[LoopFactory] = None) -> SchedulerReplay:
    """Replay ``requests`` through SGLang's real scheduler on ``config.cp_size``
    ranks, in the workload's order, or as ``make_loop``'s loop submits them (a
    fleet deployment: :mod:`sglang_cp_hicache.sim.engine_scheduler_fed`). Raises :class:`~sglang_cp_hicache.testing.sched_harness.HarnessError`
    when a rank fails (a prefix row mismatch, a leak, a stall)."""
    from sglang_cp_hicache.testing.sched_harness import SchedulerHarness

    longest = max((requests.request_len(i) for i in range(len(requests))), default=1)
    sc = sched_config(config, opts, longest)
    if sc.shape.max_context_len > _MODEL_CONTEXT:
        # the stand-in runs no model: its configured context only bounds request length
        os.environ["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
    start = time.perf_counter()
    with SchedulerHarness(sc) as h:
        up = time.perf_counter()
        loop = (make_loop or _ClosedLoop)(h, requests, opts, show_progress)
        loop.run()
        idle = h.wait_idle()
        replayed = time.perf_counter()
        run = h.close()
    return SchedulerReplay(run, idle, loop.served_rids(), loop.aborted, up - start, replayed - up)

