"""The one L3 prefetch protocol, on a stand-in tier and port: words, MINs,
deadlines, aborts, joins, abandon and reset (the releases' real stacks are
in tests/sglang_0518 and tests/sglang_0523)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest

from sglang_cp_hicache.l3.host_tier import L3Counters
from sglang_cp_hicache.l3.location import L3Timeouts
from sglang_cp_hicache.l3.prefetch import NOT_READY, ChainPlan, CpL3PrefetchAborted, L3Prefetcher, Stage
from sglang_cp_hicache.l3.workers import L3Workers
from sglang_cp_hicache.placement import CpPlacement

P = 64


class StandInTier:
    """What the protocol reads of a HostL3Tier; I/O can be held per call."""

    def __init__(self, rank: int = 0, present: int = 99, usable: int = 99) -> None:
        self.placement = CpPlacement(P, 2, rank)
        self.page_size = P
        self.counters = L3Counters()
        self.present, self.usable = present, usable
        self.hold = threading.Event()  # every call waits for it
        self.hold.set()
        self.read_hold = threading.Event()  # page reads also wait for this one
        self.read_hold.set()
        self.host: dict[int, str] = {}  # host slot -> page written into it

    def query_pages(self, hashes, owners, parent=None) -> int:
        self.hold.wait(30)
        return min(self.present, len(hashes))

    def chain_keys(self, hashes, parent=None):
        return [f"kv-{h}" for h in hashes], [f"idx-{h}" for h in hashes]

    def read_page(self, kv_key, idx_key, slot, publish) -> bool:
        self.hold.wait(30)
        self.read_hold.wait(30)
        index = int(kv_key[-1])  # hashes end with their chain index
        if index >= self.usable:
            return False
        publish(lambda: self.host.__setitem__(slot, kv_key.removeprefix("kv-")))
        return True


@dataclass
class Room:
    own_slots: Optional[list[int]]


@dataclass
class StandInPort:
    rooms: list[tuple[str, int]] = field(default_factory=list)  # (chain, pages) taken
    settled: list[tuple[str, int]] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    reported: list[tuple[Any, int]] = field(default_factory=list)
    hangs: bool = True
    room: bool = True

    def still_hangs(self, plan: ChainPlan) -> bool:
        return self.hangs

    def take_room(self, plan: ChainPlan, pages: int) -> Optional[Room]:
        if not self.room:
            return None
        self.rooms.append((plan.key, pages))
        return Room([100 + i for i, o in enumerate(plan.owners[:pages]) if o == 0])

    def settle(self, plan: ChainPlan, pages: int, room: Any) -> int:
        self.settled.append((plan.key, pages))
        return pages * P

    def release_anchor(self, plan: ChainPlan) -> None:
        self.released.append(plan.key)

    def report(self, plan: ChainPlan, asker: Any, tokens: int) -> None:
        self.reported.append((asker, tokens))


def plan(key: str = "c", pages: int = 4, anchor: Any = "root") -> ChainPlan:
    return ChainPlan(anchor, key, (ord(key[0]),), [f"{key}{i}" for i in range(pages)], [i % 2 for i in range(pages)])


#: Deadlines: generous for every test but the deadline's own (a loaded
#: two-core machine can hold a thread for seconds).
ROOMY = L3Timeouts(base_s=30.0, per_ki_token_s=0.0, max_s=30.0)
SHORT = L3Timeouts(base_s=0.3, per_ki_token_s=0.0, max_s=0.3)


@pytest.fixture
def proto():
    tier, port = StandInTier(), StandInPort()
    workers = L3Workers("t", 2)
    p = L3Prefetcher(tier, port, workers, ROOMY)
    yield p
    tier.hold.set()
    tier.read_hold.set()
    workers.shutdown()


def ready_words(p: L3Prefetcher) -> list[int]:
    assert p.wait_io(timeout=5)
    return p.words()


def test_a_hit_takes_two_mins_and_reports_to_the_asker(proto):
    proto.start(plan(), rid="r")
    assert proto.is_waiting("r")
    assert ready_words(proto) == [4]
    proto.commit([3])  # a peer has only 3 pages
    assert [l.stage for l in proto.pending] == [Stage.FETCH] and proto.port.rooms == [("c", 3)]
    assert ready_words(proto) == [3]
    proto.commit([3])
    assert proto.port.settled == [("c", 3)] and proto.port.released == ["c"]
    assert proto.port.reported == [("r", 3 * P)] and not proto.is_waiting("r") and not proto.pending
    assert proto.tier.host == {100: "c0", 102: "c2"}  # this rank's pages 0 and 2 (owners alternate)
    c = proto.counters
    assert (c.prefetches, c.restored_nodes, c.restored_tokens, c.restored_pages) == (1, 1, 3 * P, 2)


def test_a_miss_takes_no_room(proto):
    proto.tier.present = 0
    proto.start(plan(), rid="r")
    proto.commit(ready_words(proto))
    assert proto.port.rooms == [] and proto.port.settled == [] and proto.port.released == ["c"]
    assert not proto.is_waiting("r") and proto.port.reported == []


def test_running_io_answers_not_ready_and_the_min_keeps_every_rank_waiting(proto):
    proto.tier.hold.clear()
    proto.start(plan(), rid="r")
    assert proto.words() == [NOT_READY]
    proto.commit([NOT_READY])
    assert len(proto.pending) == 1 and proto.is_waiting("r")
    proto.tier.hold.set()
    assert ready_words(proto) == [4]


@pytest.mark.parametrize("stage", ["query", "fetch"])
def test_io_past_its_deadline_answers_a_miss_and_is_cancelled(proto, stage):
    proto.timeouts = SHORT
    if stage == "fetch":
        proto.start(plan(), rid="r")
        words = ready_words(proto)
        # reads hang before the fetch is committed: cleared after the commit, a
        # page job the I/O threads had already started could finish and publish
        proto.tier.read_hold.clear()
        proto.commit(words)
    else:
        proto.tier.hold.clear()  # the store hangs from now on
        proto.start(plan(), rid="r")
    start = time.monotonic()
    assert proto.wait_io(timeout=5)  # returns at the deadline, not when the I/O does
    assert time.monotonic() - start < 15  # the deadline (0.3 s) plus what a loaded machine adds
    assert proto.words() == [0]
    jobs = proto.pending[0].jobs
    proto.commit([0])
    assert not proto.pending and not proto.is_waiting("r") and proto.counters.timeouts == 1
    proto.tier.hold.set()
    proto.tier.read_hold.set()
    assert all(job.wait(5) for job in jobs)
    assert proto.tier.host == {}  # the cancelled fetch wrote nothing


@pytest.mark.parametrize("io_running", [False, True])
def test_an_aborted_lookup_answers_zero_at_once_whatever_its_io(proto, io_running):
    proto.start(plan(), rid="r")
    proto.commit(ready_words(proto))  # now fetching
    if io_running:
        proto.tier.hold.clear()
        proto.pending[0].jobs = [proto.workers.submit(proto._page_job, "kv-c0", "idx-c0", 100, timeout_s=30)]
        proto.pending[0].word = None
    proto.abort("r")
    assert proto.words() == [0]
    proto.commit([0])
    assert proto.port.settled == [("c", 0)] and proto.port.reported == [] and not proto.pending


def test_a_request_for_the_same_chain_waits_on_the_pending_lookup(proto):
    proto.start(plan(), rid="a")
    assert proto.join("root", (ord("c"),), "b")
    assert not proto.join("root", (ord("d"),), "c") and not proto.join("other", (ord("c"),), "c")
    assert proto.hangs_at("root", (ord("c"),)) and not proto.hangs_at("root", (ord("d"),))
    assert proto.counters.joined_requests == 1
    proto.abort("a")  # one waiter left: the lookup goes on
    proto.commit(ready_words(proto))
    proto.commit(ready_words(proto))
    assert not proto.is_waiting("b") and proto.port.reported == []  # the asker left: no storage hit reported
    assert proto.port.settled == [("c", 4)]


def test_no_room_or_a_chain_that_cannot_hang_restores_nothing(proto):
    proto.port.room = False
    proto.start(plan(), rid="r")
    proto.commit(ready_words(proto))
    assert not proto.pending and proto.port.settled == [] and proto.port.released == ["c"]
    proto.port.room, proto.port.hangs = True, False
    proto.start(plan("d"), rid="s")
    proto.commit(ready_words(proto))
    assert not proto.pending and proto.port.rooms == []


def test_a_failed_min_gives_back_everything_and_inserts_nothing(proto):
    proto.start(plan("c"), rid="a")
    proto.commit(ready_words(proto))  # c fetching
    proto.start(plan("d"), rid="b")  # d querying
    error = proto.abandon(RuntimeError("peer gone"))
    assert isinstance(error, CpL3PrefetchAborted) and "2 L3 lookup(s) pending" in str(error)
    assert proto.port.settled == [("c", 0)] and sorted(proto.port.released) == ["c", "d"]
    assert not proto.pending and not proto.waiting and proto.port.reported == []


def test_reset_cancels_and_forgets(proto):
    proto.tier.hold.clear()
    proto.start(plan(), rid="r")
    proto.reset()
    assert not proto.pending and not proto.waiting


def test_agreed_values_must_match_the_lookups(proto):
    proto.start(plan(), rid="r")
    with pytest.raises(RuntimeError, match="2 agreed values for 1 pending"):
        proto.commit([1, 1])
    proto.start(plan("d"), rid="s")
    with pytest.raises(RuntimeError, match="agreed 9 pages for a query of 4"):
        proto.commit([9])
