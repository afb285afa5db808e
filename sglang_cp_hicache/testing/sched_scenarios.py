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

from sglang_cp_hicache.testing.sched_forward import BatchEntry, BatchReport
from sglang_cp_hicache.testing.sched_harness import Output, SchedulerHarness
from sglang_cp_hicache.testing.sched_rank import LoadBack, RankResult

__all__ = [
    "ChurnedPrefixes", "Outcome", "abort_after_load_back", "abort_mid_l3_prefetch", "cache_then_evict_to_l3",
    "l3_restore", "cache_then_churn", "abort_mid_chunk", "chunked_shared_prefix", "concurrent_load_backs",
    "host_hit_after_churn", "pd_scripted", "retracted", "retraction",
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
        # what the device held when the scenario's own requests came
        self.free_before = idle[0].free_device_tokens if idle else -1
        self.evictable_before = idle[0].evictable_tokens if idle else -1

    def outcome(self, rids: list[str], **notes: int) -> Outcome:
        self.h.wait_finished(rids)
        idle = self.h.wait_idle()
        self.h.on_batch = None
        notes = dict(notes, free_before=self.free_before, evictable_before=self.evictable_before)
        return Outcome(self.h.batches[self.first_batch:], idle, {r: self.h.outputs[r] for r in rids},
                       idle[0].load_backs[self.first_load_back:], notes)


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


def cache_page(h: SchedulerHarness) -> int:
    """Tokens of one page the radix tree caches: 0.5.23's page-interleave
    pool caches whole logical pages of ``cp_size`` physical pages."""
    page = h.config.shape.page_size
    return page * h.config.cp_size if h.config.version == "0.5.23" else page


def _fill_device(h: SchedulerHarness, rid: str, base: int) -> None:
    """Evict everything cached so far to host but a fresh anchor request.

    The anchor (three cache pages) is cached last, so LRU keeps it; the
    filler needs every other device token. The anchor is the headroom: a
    request needing the whole pool is never admitted."""
    anchor = 3 * cache_page(h)
    h.submit(h.request(f"{rid}-anchor", _ids(base + 200_000, anchor), max_new_tokens=1))
    h.wait_finished([f"{rid}-anchor"])
    snap = h.wait_idle()[0]
    h.submit(h.request(rid, _ids(base, snap.free_device_tokens + snap.evictable_tokens - anchor), max_new_tokens=1))
    h.wait_finished([rid])
    # evictions free whole nodes and may overshoot: one more request takes up what is left free
    left = h.wait_idle()[0].free_device_tokens // cache_page(h) * cache_page(h) - cache_page(h)
    if left > 0:
        h.submit(h.request(f"{rid}-top", _ids(base + 300_000, left), max_new_tokens=1))
        h.wait_finished([f"{rid}-top"])
        h.wait_idle()


@dataclass(frozen=True)
class ChurnedPrefixes:
    """Prefixes cached, then evicted to host by one filler request (the
    device left full of evictable pages): the host-hit scenarios' start."""

    single: list[int]  # host_hit_after_churn
    many: list[list[int]]  # concurrent_load_backs
    aborted: list[int]  # abort_after_load_back


def cache_then_churn(h: SchedulerHarness, base: int, k: int = 4) -> ChurnedPrefixes:
    """Cache every host-hit scenario's prefixes, then evict them all to host at once."""
    page = cache_page(h)
    long = max(384, 2 * page)  # two cache pages, at least 384 tokens (more than a CP 3 rank group leaves free)
    prefixes = ChurnedPrefixes(_ids(base, long), [_ids(base + (i + 1) * 10_000, 2 * page) for i in range(k)],
                               _ids(base + 90_000, long))
    seeds = {f"seed{i}-{base}": p for i, p in enumerate([prefixes.single, *prefixes.many, prefixes.aborted])}
    h.submit(*[h.request(rid, p, max_new_tokens=1) for rid, p in seeds.items()])
    h.wait_finished(list(seeds))
    h.wait_idle()
    _fill_device(h, f"fill-{base}", base + 100_000)
    return prefixes


def host_hit_after_churn(h: SchedulerHarness, base: int, prefixes: ChurnedPrefixes) -> Outcome:
    """The churned single prefix + 64 new tokens comes back."""
    s = _Scenario(h)
    h.submit(h.request(f"c2-{base}", prefixes.single + _ids(base + 50_000, 64), max_new_tokens=1))
    return s.outcome([f"c2-{base}"], prefix_tokens=len(prefixes.single))


def concurrent_load_backs(h: SchedulerHarness, base: int, prefixes: ChurnedPrefixes, tail: int = 32) -> Outcome:
    """Requests hitting the churned prefixes arrive together (one batch: k * tail tokens fit the chunk)."""
    s = _Scenario(h)
    rids = [f"bq{i}-{base}" for i in range(len(prefixes.many))]
    h.submit(*[h.request(r, p + _ids(base + 50_000 + i * 1000, tail), max_new_tokens=1)
               for i, (r, p) in enumerate(zip(rids, prefixes.many))])
    return s.outcome(rids, prefix_tokens=len(prefixes.many[0]))


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


def abort_after_load_back(h: SchedulerHarness, base: int, prefixes: ChurnedPrefixes) -> Outcome:
    """A host hit is loaded back for a request whose tail needs more chunks;
    the abort comes right after the batch that started from the loaded prefix."""
    rid = f"e2-{base}"
    s = _Scenario(h)

    def on_batch(report: BatchReport, harness: SchedulerHarness) -> None:
        if any(e.rid == rid for e in report.entries) and not s.sent:
            s.sent = True
            harness.abort(rid)

    s.sent = False  # type: ignore[attr-defined]
    h.on_batch = on_batch
    h.submit(h.request(rid, prefixes.aborted + _ids(base + 50_000, 400), max_new_tokens=2))
    return s.outcome([rid], prefix_tokens=len(prefixes.aborted))


def pd_scripted(h: SchedulerHarness, base: int, rooms: dict[str, int]) -> Outcome:
    """PD prefill requests whose fake senders follow the run's scripts (rooms named per rid)."""
    s = _Scenario(h)
    for i, (rid, room) in enumerate(rooms.items()):
        h.submit(h.request(rid, _ids(base + i * 1000, 200), max_new_tokens=1, bootstrap_room=room))
    return s.outcome(list(rooms))


def retraction(h: SchedulerHarness, base: int, n: int = 4, shared: int = 128, tail: int = 100,
               new_tokens: int = 12) -> Outcome:
    """Decode of ``n`` requests sharing a ``shared``-token prefix, on a run
    started with ``forced_retract_interval``: SGLang retracts some of them
    mid-decode (their KV released uninserted, their prefix unlocked) and
    prefills them again."""
    if not h.config.forced_retract_interval:
        raise ValueError("retraction needs a harness started with forced_retract_interval > 0")
    prefix = _ids(base, shared)
    s = _Scenario(h)
    rids = [f"h{i}-{base}" for i in range(n)]
    h.submit(*[h.request(r, prefix + _ids(base + 10_000 * (i + 1), tail), max_new_tokens=new_tokens)
               for i, r in enumerate(rids)])
    return s.outcome(rids, prompt=shared + tail)


def retracted(o: Outcome) -> dict[str, list[BatchEntry]]:
    """Each request prefilled again after it had decoded: its extend entries after its first decode."""
    out: dict[str, list[BatchEntry]] = {}
    for rid in o.outputs:
        decoded = False
        for i, e in o.entries(rid):
            if o.batches[i].mode == "DECODE":
                decoded = True
            elif decoded:
                out.setdefault(rid, []).append(e)
    return out


def cache_then_evict_to_l3(h: SchedulerHarness, base: int, prefixes: list[list[int]], fills: int = 3) -> None:
    """Cache ``prefixes`` (each written to L3 by its pages' owners), then
    fill the device ``fills`` times with other content: the prefixes leave
    the device and then the host, and only L3 still holds them."""
    if h.config.l3_dir is None:
        raise ValueError("cache_then_evict_to_l3 needs a harness started with an l3_dir")
    seeds = {f"l3seed{i}-{base}": p for i, p in enumerate(prefixes)}
    h.submit(*[h.request(rid, p, max_new_tokens=1) for rid, p in seeds.items()])
    h.wait_finished(list(seeds))
    h.wait_idle()
    for k in range(fills):
        _fill_device(h, f"l3fill{k}-{base}", base + (k + 1) * 1_000_000)


def l3_restore(h: SchedulerHarness, base: int, prefix: list[int], tail: int = 64) -> Outcome:
    """A request extending an L3-only ``prefix``: SGLang's own prefetch (the
    run's prefetch policy) brings it back through the library's L3."""
    rid = f"g1-{base}"
    s = _Scenario(h)
    h.submit(h.request(rid, prefix + _ids(base + 500_000, tail), max_new_tokens=1))
    return s.outcome([rid], prefix_tokens=len(prefix))


def abort_mid_l3_prefetch(h: SchedulerHarness, base: int, prefix: list[int], tail: int = 64) -> Outcome:
    """A request extending an L3-only ``prefix`` and its abort, sent back to
    back: the scheduler takes both in one receive, so the abort lands while
    the request's L3 prefetch is in flight and the request is still queued."""
    rid = f"g2-{base}"
    s = _Scenario(h)
    h.submit(h.request(rid, prefix + _ids(base + 600_000, tail), max_new_tokens=1))
    h.abort(rid)
    return s.outcome([rid], prefix_tokens=len(prefix))
