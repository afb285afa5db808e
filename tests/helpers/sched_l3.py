"""The library's L3 under SGLang's real Scheduler, shared by both releases'
tests (0.5.18: CP 2 on the normal loop; 0.5.23: CP 2 as a PD prefill server).

SGLang's file-backend flag (the library serves it under CP), its
``wait_complete`` prefetch policy (a request waits in the queue for its
lookup), 8 device pages a rank. Three prefixes are cached (their pages'
owners write them to L3 as they are backed up), then evicted from device
and host by three device fills, so only L3 holds them. SGLang's own prefetch
brings an L3-only prefix back through the library, and an abort lands while
a prefetch is in flight. Every forward checks each prefix row on its owner
rank; SGLang's strict idle leak checks run after each scenario and at
shutdown.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from sglang_cp_hicache.testing import sched_scenarios as sc
from sglang_cp_hicache.testing.sched_config import SchedConfig
from sglang_cp_hicache.testing.sched_harness import SchedulerHarness
from sglang_cp_hicache.testing.sched_worker import PoolShape

from tests.helpers import sched_checks as chk

P = 64
BASE = 1_000_000
PREFIX = list(range(BASE, BASE + 4 * P))  # 2 pages a rank: every rank reads its own pages back
ABORTED = list(range(BASE + 50_000, BASE + 50_000 + 4 * P))
AGAIN = list(range(BASE + 90_000, BASE + 90_000 + 4 * P))


def config(version: str, l3_dir: str) -> SchedConfig:
    return SchedConfig(version, cp_size=2, pd_prefill=version == "0.5.23", l3_dir=l3_dir,
                       prefetch_policy="wait_complete", hicache_ratio=1.5, shape=PoolShape(device_pages=8))


def start(config: SchedConfig) -> Iterator[tuple[SchedulerHarness, list]]:
    """A module fixture's body: the harness with the prefixes in L3 only, and each rank's snapshot then."""
    with SchedulerHarness(config) as h:
        sc.cache_then_evict_to_l3(h, BASE + 200_000, [PREFIX, ABORTED, AGAIN])
        cached = h.wait_idle()
        lost = [{k: r.l3_counters[k] for k in ("write_failures", "dropped_writes")} for r in cached]
        assert not any(v for r in lost for v in r.values()), (lost, _l3_lines(h))
        yield h, cached
        if not h._closed:
            h.close()


def _l3_lines(h: SchedulerHarness) -> dict[int, list[str]]:
    """Each rank's L3 log lines and tracebacks (why a write or a lookup failed)."""
    return {r: [ln for ln in h.rank_log(r).splitlines() if "L3" in ln or "Error" in ln or "Traceback" in ln][-40:]
            for r in range(h.config.cp_size)}


def _grew(o: sc.Outcome, before: list, key: str) -> list[int]:
    return [after.l3_counters[key] - b.l3_counters[key] for after, b in zip(o.idle, before)]


def check_restore(h: SchedulerHarness, before: list) -> None:
    """An L3-only prefix is prefetched, loaded back and forwarded from."""
    assert all(r.counters.get("host_evicted_nodes", 1) > 0 for r in before), [r.counters for r in before]
    o = sc.l3_restore(h, BASE, PREFIX)
    rid = next(iter(o.outputs))
    assert o.outputs[rid].finish_type == "length", o.outputs
    # every rank restored its own pages of the whole prefix, and agreed on the tokens
    assert _grew(o, before, "restored_tokens") == [len(PREFIX)] * 2, ([r.l3_counters for r in o.idle], _l3_lines(h))
    assert sum(_grew(o, before, "restored_pages")) == len(PREFIX) // P
    assert _grew(o, before, "rejected_pages") == [0, 0]
    # the scheduler loaded the restored pages back and started from them (rows checked on their owners)
    chk.check_loaded_back(o, [rid])
    assert o.entries(rid)[0][1].prefix_len == len(PREFIX)


def check_abort_mid_prefetch(h: SchedulerHarness) -> None:
    """An abort that lands while the request's L3 prefetch is in flight leaves nothing behind."""
    before = h.wait_idle()
    o = sc.abort_mid_l3_prefetch(h, BASE + 10_000, ABORTED)
    rid = next(iter(o.outputs))
    assert o.outputs[rid].finish_type == "abort" and o.entries(rid) == [], (o.outputs, o.batches)
    # the L3 still serves another prefix (the ranks snapshot after a batch: the abort ran none)
    again = sc.l3_restore(h, BASE + 20_000, AGAIN)
    assert again.entries(next(iter(again.outputs)))[0][1].prefix_len == len(AGAIN)
    # the aborted request's lookup had started on every rank; it restored nothing, the next one all of its prefix
    assert _grew(again, before, "prefetches") == [2, 2]
    assert _grew(again, before, "restored_tokens") == [len(AGAIN)] * 2


def l3_tests(version: str) -> dict[str, object]:
    """The module fixture ``run``, the three tests and the slow mark of
    ``version``'s test module, by name (``globals().update``: pytest collects
    them there)."""

    @pytest.fixture(scope="module")
    def run(tmp_path_factory):
        yield from start(config(version, str(tmp_path_factory.mktemp("l3"))))

    def test_an_l3_only_prefix_is_prefetched_loaded_back_and_forwarded_from(run):
        check_restore(*run)

    def test_an_abort_while_the_prefetch_is_in_flight_leaves_nothing_behind(run):
        check_abort_mid_prefetch(run[0])

    def test_shutdown_after_l3_scenarios_leaves_every_rank_clean(run):
        h, _ = run
        chk.check_closed(h.close(), h.config)

    return {"pytestmark": pytest.mark.slow(60), "run": run, **{f.__name__: f for f in (
        test_an_l3_only_prefix_is_prefetched_loaded_back_and_forwarded_from,
        test_an_abort_while_the_prefetch_is_in_flight_leaves_nothing_behind,
        test_shutdown_after_l3_scenarios_leaves_every_rank_clean)}}
