"""SGLang's real ``Scheduler`` in N CP rank processes; this process plays the
tokenizer manager and the detokenizer.

The ranks are forked from a zygote that imported SGLang once and join one
gloo group. The zygote is this process's shared one
(:func:`~sglang_cp_hicache.testing.zygote_server.shared_zygote`): every harness
a process starts forks its ranks from it, so only the first pays the import. Requests, aborts and the final ``ShutdownReq`` go through the REAL
input socket (``scheduler_input_ipc_name``, bound here as SGLang's tokenizer
manager binds it); outputs come back through the REAL output sockets (the
tokenizer and detokenizer names, bound here). Each rank runs SGLang's own
``run_event_loop``.

Timing: before every forward each rank reports its batch over its pipe and
waits. Once every rank reported the same batch (a mismatch fails the run:
CP ranks must run identical batches), the scenario's ``on_batch`` callback
may push requests or aborts through the input socket, then every rank is
let go. Whatever was pushed is seen at the loop's next ``recv_requests``, so
"abort while r is the chunked request" is exact, not a race.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import zmq

from sglang_cp_hicache.testing.zygote import ForkJob
from sglang_cp_hicache.testing.zygote_server import ForkBatch, shared_zygote
from sglang_cp_hicache.testing.sched_config import IpcNames, SchedConfig
from sglang_cp_hicache.testing.sched_forward import BatchReport
from sglang_cp_hicache.testing.sched_intake import Expect
from sglang_cp_hicache.testing.sched_rank import RankError, RankReady, RankResult, RankSpec, forked_rank_main, preload
from sglang_cp_hicache.testing.sched_requests import abort_req, generate_req, io_struct, shutdown_req

__all__ = ["HarnessError", "Output", "RunResult", "SchedulerHarness"]

_STARTUP_S = 240.0
_LOG_TAIL = 6000


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the ranks' gloo rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HarnessError(RuntimeError):
    """A rank failed (its error and log tail attached) or the run stalled."""


@dataclass
class Output:
    rid: str
    finish_type: Optional[str] = None  # "length", "abort", ... (None: not finished)
    output_ids: list[int] = field(default_factory=list)


@dataclass
class RunResult:
    ranks: list[RankResult]
    batches: list[BatchReport]
    outputs: dict[str, Output]
    ready: list[RankReady]
    wall_s: float

    def load_back_declined_tokens(self) -> int:
        """Host-hit tokens the scheduler asked to load back that rank 0's cache declined."""
        return sum(lb.host_hit_tokens for lb in self.ranks[0].load_backs if lb.loaded_tokens == 0)


OnBatch = Callable[[BatchReport, "SchedulerHarness"], None]


class SchedulerHarness:
    """``with SchedulerHarness(config) as h: h.submit(...); h.wait_finished(...)``;
    :meth:`close` shuts the ranks down through the input socket and returns the :class:`RunResult`."""

    def __init__(self, config: SchedConfig, on_batch: Optional[OnBatch] = None) -> None:
        self.config = config
        self.on_batch = on_batch
        self.batches: list[BatchReport] = []
        self.outputs: dict[str, Output] = {}
        self._start = time.perf_counter()
        self._dir = tempfile.mkdtemp(prefix="sglang-cp-hicache-sched-")
        self._ctx = zmq.Context()
        self._pending: dict[int, dict[int, BatchReport]] = {}
        self._ready: dict[int, RankReady] = {}
        self._results: dict[int, RankResult] = {}
        self._idle: dict[int, RankResult] = {}
        self._next_room = 1000
        self._sent = 0  # messages pushed on the input socket
        self._zygote: Optional[ForkBatch] = None
        self._closed = False
        # fd -> callback: more inputs the pump serves while it waits (a fleet's request feed)
        self.watched: dict[int, Callable[[], None]] = {}
        try:
            self._ipc = self._bind_sockets()
            self._launch()
            self._pump_until(lambda: len(self._ready) == config.cp_size, _STARTUP_S, "start-up")
            # SGLang's import (seconds) counts as start-up, not as the first request's submit; not earlier:
            # beside the zygote's own import of SGLang both take several times as long
            io_struct()
            want = config.copy_path == "library"  # upstream's copy path keeps SGLang's own stack
            off = [r.rank for r in self._ready.values() if r.library != want]
            if config.cp_size > 1 and off:
                state = "not active" if want else "active under copy_path 'upstream'"
                self._fail(f"the library's CP cache is {state} on ranks {off}: {self._ready}")
        except BaseException:
            self._kill()
            raise

    # ---- set-up -------------------------------------------------------------
    def _bind_sockets(self) -> IpcNames:
        def name(tag: str) -> str:
            return f"ipc://{os.path.join(self._dir, tag)}"

        ipc = IpcNames(tokenizer_ipc_name=name("tokenizer"), scheduler_input_ipc_name=name("input"),
                       detokenizer_ipc_name=name("detokenizer"), nccl_port=free_port(), rpc_ipc_name=name("rpc"),
                       metrics_ipc_name=name("metrics"))
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.bind(ipc.scheduler_input_ipc_name)
        self._pulls = []
        for address in (ipc.tokenizer_ipc_name, ipc.detokenizer_ipc_name):
            sock = self._ctx.socket(zmq.PULL)
            sock.bind(address)
            self._pulls.append(sock)
        return ipc

    def _launch(self) -> None:
        ctx = mp.get_context("spawn")
        jobs, children = [], []
        self._channels: dict[int, Any] = {}
        for rank in range(self.config.cp_size):
            mine, theirs = ctx.Pipe(duplex=True)
            self._channels[rank] = mine
            children.append(theirs)
            spec = RankSpec(self.config, rank, self._ipc, os.path.join(self._dir, f"rank{rank}.log"))
            jobs.append(ForkJob(key=rank, args=(spec, theirs), owned=(theirs,)))
        try:
            load = functools.partial(preload, self.config.version)
            self._zygote = shared_zygote(ctx, load).fork(load, forked_rank_main, jobs)
        finally:
            for child in children:
                child.close()

    # ---- the tokenizer manager's side -----------------------------------------
    def send(self, obj: Any) -> None:
        """Push ``obj`` on the input socket, telling rank 0 first how many it must take in all."""
        self._sent += 1
        self._channels[0].send(Expect(self._sent))
        io_struct().sock_send(self._push, obj)

    def request(self, rid: str, input_ids: Sequence[int], *, max_new_tokens: int = 2,
                bootstrap_room: Optional[int] = None) -> Any:
        """A request for this run; under PD prefill it gets a fresh bootstrap room unless one is named."""
        if self.config.pd_prefill and bootstrap_room is None:
            self._next_room += 1
            bootstrap_room = self._next_room
        return generate_req(rid, input_ids, max_new_tokens=max_new_tokens, bootstrap_room=bootstrap_room)

    def submit(self, *reqs: Any) -> None:
        for req in reqs:
            self.send(req)

    def abort(self, rid: str) -> None:
        self.send(abort_req(rid))

    def finished(self, rid: str) -> bool:
        out = self.outputs.get(rid)
        return out is not None and out.finish_type is not None

    def wait_finished(self, rids: Iterable[str], timeout_s: Optional[float] = None) -> None:
        rids = list(rids)
        self._pump_until(lambda: all(self.finished(r) for r in rids), timeout_s or self.config.batch_timeout_s,
                         f"requests {rids} to finish")

    def wait_for(self, done: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Serve the ranks (and :attr:`watched`) until ``done()``; :class:`HarnessError` after ``timeout_s``."""
        self._pump_until(done, timeout_s, what)

    @property
    def ready(self) -> list[RankReady]:
        return [self._ready[r] for r in sorted(self._ready)]

    def snapshots(self) -> list[RankResult]:
        """Each rank's latest idle snapshot ([] before every rank sent one)."""
        if len(self._idle) < self.config.cp_size:
            return []
        return [self._idle[r] for r in sorted(self._idle)]

    def wait_idle(self, timeout_s: Optional[float] = None) -> list[RankResult]:
        """Wait until every rank ran SGLang's idle checks (passing) after the
        last batch; each rank's snapshot then."""
        self._pump_until(self.idle, timeout_s or self.config.batch_timeout_s, "every rank to go idle")
        return [self._idle[r] for r in sorted(self._idle)]

    def idle(self) -> bool:
        """Every rank ran SGLang's idle checks (passing) after the last batch
        and after processing every message pushed so far."""
        return len(self._idle) == self.config.cp_size and all(
            r.stats.batches == len(self.batches) and r.processed == self._sent for r in self._idle.values())

    def close(self) -> RunResult:
        """ShutdownReq through the input socket; every rank's result."""
        if self._closed:
            raise RuntimeError("the harness is closed already")
        try:
            self.send(shutdown_req())
            self._pump_until(lambda: len(self._results) == self.config.cp_size, self.config.batch_timeout_s,
                             "every rank's result after the ShutdownReq")
            if self._zygote is not None:
                self._zygote.join(timeout=10.0)
        finally:
            self._closed = True
            self._kill()
        return RunResult([self._results[r] for r in sorted(self._results)], self.batches, self.outputs,
                         [self._ready[r] for r in sorted(self._ready)], time.perf_counter() - self._start)

    def __enter__(self) -> "SchedulerHarness":
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._closed:
            self._closed = True
            self._kill()

    # ---- the pump -------------------------------------------------------------
    def _pump_until(self, done: Callable[[], bool], timeout_s: float, what: str) -> None:
        poller = zmq.Poller()
        for sock in self._pulls:
            poller.register(sock, zmq.POLLIN)
        for channel in self._channels.values():
            poller.register(channel.fileno(), zmq.POLLIN)
        zygote_fd = self._zygote.sentinel.fileno() if self._zygote is not None else None
        if zygote_fd is not None:
            poller.register(zygote_fd, zmq.POLLIN)
        for fd in self.watched:
            poller.register(fd, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                self._dump_stacks()
                last = self.batches[-1] if self.batches else None
                self._fail(f"timed out after {timeout_s:.0f}s waiting for {what} ({len(self.batches)} batches, "
                           f"the last {last}; idle snapshots {self.snapshots()})")
            events = dict(poller.poll(200))
            for sock in self._pulls:
                if sock in events:
                    self._take_outputs(sock)
            for rank, channel in self._channels.items():
                if channel.fileno() in events:
                    self._take_message(rank, channel)
            if zygote_fd is not None and zygote_fd in events:
                self._check_exits()
            for fd, callback in list(self.watched.items()):
                if fd in events:
                    callback()

    def _take_outputs(self, sock: Any) -> None:
        while True:
            try:
                obj = io_struct().sock_recv(sock, zmq.NOBLOCK)
            except zmq.Again:
                return
            if type(obj).__name__ == "AbortReq" and getattr(obj, "rid", None):
                # what the scheduler sends back for a request it dropped before any output
                self.outputs.setdefault(str(obj.rid), Output(str(obj.rid))).finish_type = "abort"
                continue
            rids = getattr(obj, "rids", None)
            if not rids:
                continue
            reasons = getattr(obj, "finished_reasons", None) or [None] * len(rids)
            ids = getattr(obj, "output_ids", None) or getattr(obj, "decode_ids", None) or [None] * len(rids)
            for i, rid in enumerate(rids):
                out = self.outputs.setdefault(str(rid), Output(str(rid)))
                if ids[i] is not None:
                    out.output_ids = [int(t) for t in ids[i]]
                if reasons[i] is not None:
                    out.finish_type = str(reasons[i].get("type") if isinstance(reasons[i], dict) else reasons[i])

    def _take_message(self, rank: int, channel: Any) -> None:
        try:
            msg = channel.recv()
        except (EOFError, OSError):
            self._check_exits(force=True, rank=rank)
            return
        if isinstance(msg, BatchReport):
            self._gate(msg)
        elif isinstance(msg, RankReady):
            self._ready[rank] = msg
        elif isinstance(msg, RankResult) and msg.final:
            self._results[rank] = msg
        elif isinstance(msg, RankResult):
            self._idle[rank] = msg
        elif isinstance(msg, RankError):
            self._fail(f"rank {msg.rank} failed: {msg.error}\n{msg.traceback}")

    def _gate(self, report: BatchReport) -> None:
        step = self._pending.setdefault(report.step, {})
        step[report.rank] = report
        if len(step) < self.config.cp_size:
            return
        del self._pending[report.step]
        first = step[0]
        for other in step.values():
            if not first.same_batch(other):
                self._fail(f"CP ranks disagree on batch {report.step}: rank 0 {first}, rank {other.rank} {other}")
        self.batches.append(first)
        if self.on_batch is not None:
            self.on_batch(first, self)
        for channel in self._channels.values():
            channel.send("go")

    def _dump_stacks(self) -> None:
        """Every rank writes its threads' stacks to its log (SIGUSR1), so a stall's tail shows where each waits."""
        if self._zygote is None:
            return
        for rank in range(self.config.cp_size):
            self._zygote.signal(rank, signal.SIGUSR1)
        time.sleep(1.0)

    def _check_exits(self, force: bool = False, rank: Optional[int] = None) -> None:
        if self._zygote is None:
            return
        self._zygote.poll()
        for key, code in self._zygote.codes.items():
            if code != 0 and key not in self._results:
                self._fail(f"rank {key} exited with status {code}")
            if code == 0 and key not in self._results and len(self._results) < self.config.cp_size:
                self._fail(f"rank {key} exited before its result")
        if force and rank is not None and rank not in self._results:
            self._fail(f"rank {rank}'s pipe closed before its result")

    def rank_log(self, rank: int) -> str:
        """What rank ``rank`` logged so far ("" once the run's directory is gone)."""
        try:
            with open(os.path.join(self._dir, f"rank{rank}.log"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def _fail(self, message: str) -> None:
        tails = [f"--- rank {rank} log tail ---\n{self.rank_log(rank)[-_LOG_TAIL:]}"
                 for rank in range(self.config.cp_size)]
        self._closed = True
        self._kill()
        raise HarnessError(f"sglang-cp-hicache scheduler harness: {message}\n" + "\n".join(tails))

    def _kill(self) -> None:
        if self._zygote is not None:
            for rank in range(self.config.cp_size):
                self._zygote.signal(rank, signal.SIGKILL)
            self._zygote.join(timeout=5.0)
            self._zygote = None
        for channel in getattr(self, "_channels", {}).values():
            channel.close()
        self._channels = {}
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)
