"""A fleet deployment on the scheduler engine: the ``simulate`` process
that drives SGLang's ``Scheduler`` serves the indices its coordinator
releases (:class:`~sglang_cp_hicache.sim.fleet.feed.ParentFeed`), in the order released, instead of
the workload's own order.

It submits each released request through the harness as soon as fewer than
``in_flight`` of its requests are unfinished (the same closed loop as a
lone run) and then says ``start I``: the router has handed the request to
the server, which is where the fleet's ordering rule applies. Waiting for
SGLang to take it into a batch would release the fleet's next request only
after that batch formed, so no batch could take two new requests and
SGLang's own batching would be gone. ``done`` follows once the request is
known finished (a batch gate reports it, or the ranks went idle), with its
hits per tier from its first forwarded batch.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from sglang_cp_hicache.sim.engine_scheduler import EngineOptions, LoopFactory, _ClosedLoop
from sglang_cp_hicache.sim.fleet.feed import ParentFeed
from sglang_cp_hicache.sim.packed import PackedRequests

if TYPE_CHECKING:
    from sglang_cp_hicache.testing.sched_forward import BatchEntry, BatchReport
    from sglang_cp_hicache.testing.sched_harness import SchedulerHarness

__all__ = ["FedLoop", "fed_loop"]

#: How long an idle deployment waits for its next request: the coordinator may serve the others for
#: hours (it ends every deployment's feed at the end, and a deployment dies with it).
_FEED_WAIT_S = 7 * 24 * 3600.0


class FedLoop(_ClosedLoop):
    """The closed loop over the requests ``feed`` releases."""

    def __init__(self, h: "SchedulerHarness", requests: PackedRequests, opts: EngineOptions, feed: ParentFeed,
                 page_size: int) -> None:
        super().__init__(h, requests, opts, show=False)
        self.feed, self.page_size = feed, page_size
        self.queue: deque[int] = deque()  # released, not yet submitted
        self.submitted: list[int] = []
        self.first: dict[str, "BatchEntry"] = {}  # each request's entry in its first forwarded batch

    def served_rids(self) -> list[str]:
        return [self.rids[i] for i in self.submitted]

    def _take_feed(self) -> None:
        for i in self.feed.read():
            if not 0 <= i < len(self.requests):
                raise RuntimeError(f"the fleet released request {i}, beyond this workload's {len(self.requests)}")
            self.queue.append(i)
        if self.feed.ended:  # at its end the pipe may read as closed: stop watching it
            self.h.watched.pop(self.feed.fileno(), None)
        self.top_up()

    def top_up(self) -> None:
        self._prune()
        taken = []
        while self.queue and len(self.open) < self.opts.window:
            taken.append(self.queue.popleft())
        self.h.submit(*(self.h.request(self.rids[i], list(self.requests[i]), max_new_tokens=self.opts.max_new_tokens)
                        for i in taken))
        self.open += taken
        self.submitted += taken
        for i in taken:  # pushed: the coordinator may release the next request
            self.feed.started(i)

    def _prune(self) -> None:
        still = []
        for i in self.open:
            rid = self.rids[i]
            if rid not in self.finished:
                still.append(i)
                continue
            entry = self.first.get(rid)
            prefix, host, l3 = (entry.prefix_len, entry.host_tokens, entry.l3_tokens) if entry else (0, 0, 0)
            # HOST counts the L3 tail too (the coordinator splits it off); every hit page was checked on its owner
            self.feed.done(i, prefix - host, host, l3, prefix // self.page_size)
        self.done += len(self.open) - len(still)
        self.open = still

    def on_batch(self, report: "BatchReport", h: "SchedulerHarness") -> None:
        for entry in report.entries:
            self.first.setdefault(entry.rid, entry)
        super().on_batch(report, h)

    def run(self) -> None:
        h = self.h
        h.on_batch = self.on_batch
        h.watched[self.feed.fileno()] = self._take_feed
        self.feed.ready()
        self._take_feed()
        while self.open or self.queue or not self.feed.ended:
            if not self.open:
                h.wait_for(lambda: bool(self.open or self.queue) or self.feed.ended, _FEED_WAIT_S,
                           "the fleet's next request")
                continue
            self.serve_open()
        h.on_batch = None
        h.watched.clear()
        h.wait_finished(self.served_rids())


def fed_loop(fleet_feed: str, page_size: int) -> "LoopFactory":
    """The loop factory :func:`~sglang_cp_hicache.sim.engine_scheduler.replay_through_scheduler`
    takes for a fleet deployment fed through ``fleet_feed``."""
    def make(h: "SchedulerHarness", requests: PackedRequests, opts: EngineOptions, show: bool) -> FedLoop:
        return FedLoop(h, requests, opts, ParentFeed(fleet_feed), page_size)
    return make
