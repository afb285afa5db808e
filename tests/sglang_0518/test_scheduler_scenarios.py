"""SGLang 0.5.18's real Scheduler drives the CP HiCache (CP 2 normal loop, CP 3 overlap loop).

SGLang's own ``run_event_loop`` runs in CP rank processes on gloo with only
the model worker replaced (sglang_cp_hicache.testing.sched_harness); every
forward checks each prefix row attention would read on its owner rank, and
SGLang's strict idle leak checks run after every scenario.
"""

from __future__ import annotations

import pytest

from sglang_cp_hicache.testing import sched_scenarios as sc
from sglang_cp_hicache.testing.sched_config import SchedConfig

from tests.helpers import sched_checks as chk
from tests.helpers import sched_module as mod

pytestmark = pytest.mark.slow(90)

# Both run with the insert trap: a host read of a device index inside an insert fails the run.
CONFIGS = [SchedConfig("0.5.18", cp_size=2, trap_insert_reads=True),
           SchedConfig("0.5.18", cp_size=3, overlap=True, trap_insert_reads=True)]
globals().update(mod.scenario_tests(CONFIGS, ids=["cp2", "cp3-overlap"]))


def test_eviction_churn_leaves_the_host_hit_to_evictable_pages(h):
    """The precondition of the load-back tests: each scenario reached a host
    hit (the scheduler asked for its load-back) that the evictable device
    pages could cover. (Free pages alone need not be short: at CP 3 the
    decline happens with more free tokens than the hit, in the wrong owner lanes.)"""
    for o in (mod.run_host_hit(h), mod.run_concurrent(h), mod.run_abort_after_load_back(h)):
        hit = o.notes["prefix_tokens"] * len(o.outputs)
        assert {lb.rid for lb in o.load_backs} == set(o.outputs), (o.load_backs, o.outputs)
        asked: dict[str, int] = {}  # a declined request asks again at each admission attempt
        for lb in o.load_backs:
            asked[lb.rid] = max(asked.get(lb.rid, 0), lb.host_hit_tokens)
        assert sum(asked.values()) <= hit <= o.notes["evictable_before"], (hit, o.notes, o.load_backs)


def test_the_host_hit_request_ran_to_its_length(h):
    o = mod.run_host_hit(h)
    assert o.outputs[sorted(o.outputs)[0]].finish_type == "length"


def test_scheduler_inserts_read_no_device_indices(h):
    before = mod.snapshot_counters(h)
    o = sc.chunked_shared_prefix(h, 8_000_000)  # chunk checkpoints and finished inserts, through the scheduler
    after = o.idle[0].counters
    assert after["device_page_reads_avoided"] > before["device_page_reads_avoided"], (before, after)
    assert after["device_page_reads"] == before["device_page_reads"], (before, after)


def test_shutdown_through_the_input_socket_leaves_every_rank_idle_and_clean(h):
    chk.check_closed(h.close(), h.config)
