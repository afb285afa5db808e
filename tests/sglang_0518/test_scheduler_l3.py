"""The library's L3 under SGLang 0.5.18's real Scheduler (CP 2): pages
written by their owners as SGLang's write-through backs them up, evicted
from device and host, then brought back by SGLang's own prefetch
(``wait_complete`` policy: the request waits in the queue for it), loaded
back and forwarded, each prefix row checked on its owner rank; and an abort
that lands while a prefetch is in flight. SGLang's strict idle leak checks
run after each scenario and at shutdown.
"""

from __future__ import annotations

import pytest

from sglang_cp_hicache.testing import sched_scenarios as sc
from sglang_cp_hicache.testing.sched_config import SchedConfig
from sglang_cp_hicache.testing.sched_harness import SchedulerHarness
from sglang_cp_hicache.testing.sched_worker import PoolShape

from tests.helpers import sched_checks as chk

pytestmark = pytest.mark.slow(60)

P = 64
BASE = 1_000_000
PREFIX = list(range(BASE, BASE + 4 * P))  # 2 pages a rank: every rank reads its own pages back
ABORTED = list(range(BASE + 50_000, BASE + 50_000 + 4 * P))
AGAIN = list(range(BASE + 90_000, BASE + 90_000 + 4 * P))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    config = SchedConfig("0.5.18", cp_size=2, l3_dir=str(tmp_path_factory.mktemp("l3")),
                         prefetch_policy="wait_complete", hicache_ratio=1.5, shape=PoolShape(device_pages=8))
    with SchedulerHarness(config) as h:
        sc.cache_then_evict_to_l3(h, BASE + 200_000, [PREFIX, ABORTED, AGAIN])
        evicted = h.wait_idle()
        yield h, evicted
        if not h._closed:
            h.close()


def _l3(o: sc.Outcome, before: list, key: str) -> list[int]:
    return [after.l3_counters[key] - b.l3_counters[key] for after, b in zip(o.idle, before)]


def test_an_l3_only_prefix_is_prefetched_loaded_back_and_forwarded_from(run):
    h, before = run
    assert all(r.counters["host_evicted_nodes"] > 0 for r in before), [r.counters for r in before]
    o = sc.l3_restore(h, BASE, PREFIX)
    rid = next(iter(o.outputs))
    assert o.outputs[rid].finish_type == "length"
    # every rank restored its own pages of the whole prefix, and agreed on the tokens
    assert _l3(o, before, "restored_tokens") == [len(PREFIX)] * 2
    assert sum(_l3(o, before, "restored_pages")) == len(PREFIX) // P
    assert _l3(o, before, "rejected_pages") == [0, 0]
    # the scheduler loaded the restored pages back and started from them (rows checked on their owners)
    chk.check_loaded_back(o, [rid])
    assert o.entries(rid)[0][1].prefix_len == len(PREFIX)


def test_an_abort_while_the_prefetch_is_in_flight_leaves_nothing_behind(run):
    h, _ = run
    before = h.wait_idle()
    o = sc.abort_mid_l3_prefetch(h, BASE + 10_000, ABORTED)
    rid = next(iter(o.outputs))
    assert o.outputs[rid].finish_type == "abort" and o.entries(rid) == [], (o.outputs, o.batches)
    # the L3 still serves another prefix (the ranks snapshot after a batch: the abort ran none)
    again = sc.l3_restore(h, BASE + 20_000, AGAIN)
    assert again.entries(next(iter(again.outputs)))[0][1].prefix_len == len(AGAIN)
    # the aborted request's lookup had started on every rank; it restored nothing, the next one all of its prefix
    assert _l3(again, before, "prefetches") == [2, 2]
    assert _l3(again, before, "restored_tokens") == [len(AGAIN)] * 2


def test_shutdown_after_l3_scenarios_leaves_every_rank_clean(run):
    h, _ = run
    chk.check_closed(h.close(), h.config)
