"""Retraction through SGLang 0.5.18's real Scheduler (CP 2, overlap loop).

A decode batch that runs short of memory retracts requests: their KV is
released without being inserted, their prefix nodes unlocked, and they are
prefilled again later from whatever the tree still holds. The run forces it
with SGLang's own switch (``SGLANG_TEST_RETRACT``: every few forwards,
memory short or not), so the path runs on every test, not only when a
random workload happens to fill the device. Every forward checks each
prefix row on its owner rank; SGLang's strict idle leak checks run after.
"""

from __future__ import annotations

import pytest

from sglang_cp_hicache.testing import sched_scenarios as sc
from sglang_cp_hicache.testing.sched_config import SchedConfig
from sglang_cp_hicache.testing.sched_harness import SchedulerHarness

from tests.helpers import sched_checks as chk

pytestmark = pytest.mark.slow(40)

CONFIG = SchedConfig("0.5.18", cp_size=2, overlap=True, forced_retract_interval=4)


def test_retracted_requests_prefill_again_from_their_cached_prefix_and_finish():
    with SchedulerHarness(CONFIG) as h:
        o = sc.retraction(h, 1_000_000)
        again = sc.retracted(o)
        assert again, f"no request was retracted: {o.batches}"
        for rid, entries in again.items():
            # the prompt was cached when its prefill ended; the retraction unlocked it, kept it in the tree
            assert entries[0].prefix_len >= o.notes["prompt"] // 64 * 64, (rid, entries)
        assert {out.finish_type for out in o.outputs.values()} == {"length"}, o.outputs
        assert all(r.idle_checks > 0 for r in o.idle)
        chk.check_closed(h.close(), h.config)


def test_a_retraction_run_needs_the_switch():
    with pytest.raises(ValueError, match="forced_retract_interval must be an int >= 0"):
        SchedConfig("0.5.18", forced_retract_interval=-1)
