"""The body of each release's real-scheduler scenario module, parametrized by release.

Each module-scoped rank group runs every scenario in turn (distinct token
bases, so no two share a prefix), then shuts down through the input socket.
Results a later test re-reads are kept per rank group in ``OUTCOMES``.
"""

from __future__ import annotations

from typing import Any

from sglang_cp_hicache.testing import sched_scenarios as sc
from sglang_cp_hicache.testing.sched_config import SchedConfig
from sglang_cp_hicache.testing.sched_harness import SchedulerHarness

from tests.helpers import sched_checks as chk

OUTCOMES: dict[tuple[str, int, bool, bool], dict[str, sc.Outcome]] = {}


def key(config: SchedConfig) -> tuple[str, int, bool, bool]:
    return (config.version, config.cp_size, config.overlap, config.pd_prefill)


def run_chunked(h: SchedulerHarness) -> None:
    chk.check_chunked_shared_prefix(sc.chunked_shared_prefix(h, 1_000_000), h.config.chunked_prefill_size)


def run_abort_mid_chunk(h: SchedulerHarness) -> None:
    o = sc.abort_mid_chunk(h, 2_000_000)
    chk.check_aborted(o, "d1-2000000")


def run_host_hit(h: SchedulerHarness) -> sc.Outcome:
    o = OUTCOMES.setdefault(key(h.config), {})
    if "host_hit" not in o:
        o["host_hit"] = sc.host_hit_after_churn(h, 3_000_000)
    return o["host_hit"]


def run_concurrent(h: SchedulerHarness) -> sc.Outcome:
    o = OUTCOMES.setdefault(key(h.config), {})
    if "concurrent" not in o:
        o["concurrent"] = sc.concurrent_load_backs(h, 4_000_000)
    return o["concurrent"]


def run_abort_after_load_back(h: SchedulerHarness) -> sc.Outcome:
    o = OUTCOMES.setdefault(key(h.config), {})
    if "abort_lb" not in o:
        o["abort_lb"] = sc.abort_after_load_back(h, 5_000_000)
    return o["abort_lb"]


def check_concurrent(o: sc.Outcome) -> None:
    rids = sorted(o.outputs)
    chk.check_loaded_back(o, rids)
    together = max(sum(1 for e in b.entries if e.rid in rids) for b in o.batches)
    assert together >= 2, f"no batch ran two of the load-back requests together: {o.batches}"


def snapshot_counters(h: SchedulerHarness) -> Any:
    return h.wait_idle()[0].counters
