"""Scenarios run through SGLang's real scheduler (both releases, any CP size).

Each takes a live :class:`~.sched_harness.SchedulerHarness` and a token base
(distinct per scenario, so scenarios sharing one rank group never share a
prefix), drives requests / aborts through the input socket, waits until
every rank ran SGLang's own idle leak checks, and returns what happened.
Content is checked by the forward stand-in on every batch: a scenario that
returns saw no mismatch. The tests assert on the outcome.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from sglang_cp_hicache.testing.sched_forward import BatchEntry, BatchReport
from sglang_cp_hicache.testing.sched_harness import Output, SchedulerHarness
from sglang_cp_hicache.testing.sched_rank import LoadBack, RankResult

__all__ = [
    "Outcome", "abort_after_load_back", "abort_mid_chunk", "chunked_shared_prefix", "concurrent_load_backs",
    "host_hit_after_churn", "pd_scripted", "retraction_under_pressure",
]


@dataclass
class Outcome:
    batches: list[BatchReport]  # the batches this scenario ran
    idle: list[RankResult]  # each rank's snapshot once idle afterwards (its idle leak checks passed)
    outputs: dict[str, Output]
    load_backs: list[LoadBack] = field(default_factory=list)  # rank 0's, during this scenario
    notes: dict[str, int] = field(default_factory=dict)

    def entries(self, rid: str) -> list[tuple[int, BatchEntry]]:
        """(batch index within the scenario, entry) of every batch that ran ``rid``."""
        return [(i, e) for i, b in enumerate(self.batches) for e in b.entries if e.rid == rid]

    def declined_tokens(self) -> int:
        return sum(lb.host_hit_tokens for lb in self.load_backs if lb.loaded_tokens < lb.host_hit_tokens)


class _Scenario:
    """Marks where a scenario starts in the run's batches and load-backs."""

    def __init__(self, h: SchedulerHarness) -> None:
        self.h = h
        self.first_batch = len(h.batches)
        idle = h.snapshots()
        self.first_load_back = len(idle[0].load_backs) if idle else 0

    def outcome(self, rids: list[str], **notes: int) -> Outcome:
        self.h.wait_finished(rids)
        idle = self.h.wait_idle()
        self.h.on_batch = None
        return Outcome(self.h.batches[self.first_batch:], idle, {r: self.h.outputs[r] for r in rids},
                       idle[0].load_backs[self.first_load_back:], dict(notes))


def _ids(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


def usable_tokens(h: SchedulerHarness) -> int:
    """Logical device tokens this run can cache (free + evictable while idle)."""
    snap = h.wait_idle()[0]
    return snap.free_device_tokens + snap.evictable_tokens


def chunked_shared_prefix(h: SchedulerHarness, base: int) -> Outcome:
    """A 300-token request chunked at the run's chunk size; a second request
    sharing its first 192 tokens arrives while the first is on its first chunk."""
    first = _ids(base, 300)
    second = first[:192] + _ids(base + 50_000, 100)
    s = _Scenario(h)

    def on_batch(report: BatchReport, harness: SchedulerHarness) -> None:
        if report.chunked_rid == f"a1-{base}" and not harness.outputs.get(f"a2-{base}") and not s.sent:
            s.sent = True
            harness.submit(harness.request(f"a2-{base}", second))

    s.sent = False  # type: ignore[attr-defined]
    h.on_batch = on_batch
    h.submit(h.request(f"a1-{base}", first))
    return s.outcome([f"a1-{base}", f"a2-{base}"])


def _fill_device(h: SchedulerHarness, rid: str, base: int, keep_pages: int = 3) -> None:
    """One long request that leaves ``keep_pages`` pages: everything cached before it is evicted to host."""
    page = h.config.shape.page_size
    h.submit(h.request(rid, _ids(base, usable_tokens(h) - keep_pages * page), max_new_tokens=1))
    h.wait_finished([rid])
    h.wait_idle()


def host_hit_after_churn(h: SchedulerHarness, base: int) -> Outcome:
    """A 256-token prefix is cached, then evicted to host by a request that
    fills the device with evictable pages; the prefix + 64 tokens comes back."""
    prefix = _ids(base, 256)
    h.submit(h.request(f"c1-{base}", prefix, max_new_tokens=1))
    h.wait_finished([f"c1-{base}"])
    h.wait_idle()
    _fill_device(h, f"c-fill-{base}", base + 100_000)
    s = _Scenario(h)
    h.submit(h.request(f"c2-{base}", prefix + _ids(base + 50_000, 64), max_new_tokens=1))
    return s.outcome([f"c2-{base}"], prefix_tokens=len(prefix))


def concurrent_load_backs(h: SchedulerHarness, base: int, k: int = 4, tail: int = 32) -> Outcome:
    """``k`` two-page prefixes are cached, then evicted to host; ``k``
    requests hitting them arrive together (one batch: k * tail tokens fit the chunk)."""
    page = h.config.shape.page_size
    prefixes = [_ids(base + i * 1000, 2 * page) for i in range(k)]
    h.submit(*[h.request(f"b{i}-{base}", p, max_new_tokens=1) for i, p in enumerate(prefixes)])
    h.wait_finished([f"b{i}-{base}" for i in range(k)])
    h.wait_idle()
    _fill_device(h, f"b-fill-{base}", base + 100_000)
    s = _Scenario(h)
    rids = [f"bq{i}-{base}" for i in range(k)]
    h.submit(*[h.request(r, p + _ids(base + 50_000 + i * 1000, tail), max_new_tokens=1)
               for i, (r, p) in enumerate(zip(rids, prefixes))])
    return s.outcome(rids, prefix_tokens=2 * page)


def abort_mid_chunk(h: SchedulerHarness, base: int) -> Outcome:
    """A 600-token request is aborted while it is the chunked request (after its second chunk)."""
    rid = f"d1-{base}"
    s = _Scenario(h)

    def on_batch(report: BatchReport, harness: SchedulerHarness) -> None:
        mine = [e for e in report.entries if e.rid == rid]
        if mine and mine[0].prefix_len > 0 and report.chunked_rid == rid and not s.sent:
            s.sent = True
            harness.abort(rid)

    s.sent = False  # type: ignore[attr-defined]
    h.on_batch = on_batch
    h.submit(h.request(rid, _ids(base, 600), max_new_tokens=4))
    return s.outcome([rid])


def abort_after_load_back(h: SchedulerHarness, base: int) -> Outcome:
    """A host hit is loaded back for a request whose tail needs more chunks;
    the abort comes right after the batch that started from the loaded prefix."""
    prefix = _ids(base, 256)
    h.submit(h.request(f"e1-{base}", prefix, max_new_tokens=1))
    h.wait_finished([f"e1-{base}"])
    h.wait_idle()
    _fill_device(h, f"e-fill-{base}", base + 100_000)
    rid = f"e2-{base}"
    s = _Scenario(h)

    def on_batch(report: BatchReport, harness: SchedulerHarness) -> None:
        if any(e.rid == rid for e in report.entries) and not s.sent:
            s.sent = True
            harness.abort(rid)

    s.sent = False  # type: ignore[attr-defined]
    h.on_batch = on_batch
    h.submit(h.request(rid, prefix + _ids(base + 50_000, 400), max_new_tokens=2))
    return s.outcome([rid], prefix_tokens=len(prefix))


def pd_scripted(h: SchedulerHarness, base: int, rooms: dict[str, int]) -> Outcome:
    """PD prefill requests whose fake senders follow the run's scripts (rooms named per rid)."""
    s = _Scenario(h)
    for i, (rid, room) in enumerate(rooms.items()):
        h.submit(h.request(rid, _ids(base + i * 1000, 200), max_new_tokens=1, bootstrap_room=room))
    return s.outcome(list(rooms))


def retraction_under_pressure(h: SchedulerHarness, base: int, n: int = 4, prompt: Optional[int] = None,
                              new_tokens: int = 160) -> Outcome:
    """Decode of ``n`` requests that outgrow the device: the scheduler retracts some."""
    page = h.config.shape.page_size
    total = usable_tokens(h)
    prompt = prompt if prompt is not None else (total // n) - new_tokens // 2 - page
    s = _Scenario(h)
    rids = [f"h{i}-{base}" for i in range(n)]
    h.submit(*[h.request(r, _ids(base + i * 10_000, prompt), max_new_tokens=new_tokens) for i, r in enumerate(rids)])
    return s.outcome(rids, prompt=prompt)
