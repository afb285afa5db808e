"""The body of each release's real-scheduler scenario module, parametrized by release.

Each module-scoped rank group runs every scenario in turn (distinct token
bases, so no two share a prefix), then shuts down through the input socket.
Results a later test re-reads are kept per rank group in ``OUTCOMES``.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

from sglang_cp_hicache.testing import sched_scenarios as sc
from sglang_cp_hicache.testing.sched_config import SchedConfig
from sglang_cp_hicache.testing.sched_harness import SchedulerHarness

from tests.helpers import sched_checks as chk

OUTCOMES: dict[tuple[str, int, bool, bool], dict[str, Any]] = {}


def key(config: SchedConfig) -> tuple[str, int, bool, bool]:
    return (config.version, config.cp_size, config.overlap, config.pd_prefill)


def run_chunked(h: SchedulerHarness) -> None:
    chk.check_chunked_shared_prefix(sc.chunked_shared_prefix(h, 1_000_000), h.config.chunked_prefill_size)


def run_abort_mid_chunk(h: SchedulerHarness) -> None:
    o = sc.abort_mid_chunk(h, 2_000_000)
    chk.check_aborted(o, "d1-2000000")


def _churned(h: SchedulerHarness) -> sc.ChurnedPrefixes:
    o = OUTCOMES.setdefault(key(h.config), {})
    if "churned" not in o:
        o["churned"] = sc.cache_then_churn(h, 3_000_000)  # type: ignore[assignment]
    return o["churned"]  # type: ignore[return-value]


def _once(h: SchedulerHarness, name: str, run: Any) -> sc.Outcome:
    o = OUTCOMES.setdefault(key(h.config), {})
    if name not in o:
        o[name] = run(h, _churned(h))
    return o[name]


def run_host_hit(h: SchedulerHarness) -> sc.Outcome:
    return _once(h, "host_hit", lambda h, p: sc.host_hit_after_churn(h, 4_000_000, p))


def run_concurrent(h: SchedulerHarness) -> sc.Outcome:
    return _once(h, "concurrent", lambda h, p: sc.concurrent_load_backs(h, 5_000_000, p))


def run_abort_after_load_back(h: SchedulerHarness) -> sc.Outcome:
    return _once(h, "abort_lb", lambda h, p: sc.abort_after_load_back(h, 6_000_000, p))


def check_concurrent(o: sc.Outcome) -> None:
    rids = sorted(o.outputs)
    chk.check_loaded_back(o, rids)
    together = max(sum(1 for e in b.entries if e.rid in rids) for b in o.batches)
    assert together >= 2, f"no batch ran two of the load-back requests together: {o.batches}"


def snapshot_counters(h: SchedulerHarness) -> Any:
    return h.wait_idle()[0].counters


PD_RIDS = {"pd-delay": chk.DELAYED_ROOM, "pd-fail-bootstrap": chk.FAIL_BOOTSTRAP_ROOM,
           "pd-fail-transfer": chk.FAIL_TRANSFER_ROOM}


def run_pd(h: SchedulerHarness) -> sc.Outcome:
    o = OUTCOMES.setdefault(key(h.config), {})
    if "pd" not in o:
        o["pd"] = sc.pd_scripted(h, 7_000_000, PD_RIDS)
    return o["pd"]


def check_pd_delayed(h: SchedulerHarness, o: sc.Outcome) -> None:
    """The delayed sender's request completes; where SGLang kept optimistic
    prefill on, it was forwarded while its sender still bootstrapped."""
    assert o.outputs["pd-delay"].finish_type == "length", o.outputs
    assert o.entries("pd-delay"), "the delayed request never ran"
    optimistic = any("pd-delay" in b.bootstrapping for b in o.batches)
    if all(r.optimistic_prefill_attempts > 0 for r in h.ready):
        assert optimistic, f"optimistic prefill is on but the request waited for its bootstrap: {o.batches}"
    else:
        assert not optimistic, o.batches


def check_pd_failures(o: sc.Outcome) -> None:
    assert o.outputs["pd-fail-bootstrap"].finish_type == "abort", o.outputs
    assert o.outputs["pd-fail-transfer"].finish_type == "abort", o.outputs
    assert o.entries("pd-fail-transfer"), "the request whose transfer fails never ran its prefill"


def scenario_tests(configs: list[SchedConfig], ids: list[str]) -> dict[str, Callable]:
    """The module fixture ``h`` (one rank group per config) and the scenarios
    both releases run, by name (``globals().update``: pytest collects them in
    a release's module, before its own tests and its shutdown test)."""
    closed: list = []

    @pytest.fixture(scope="module", params=configs, ids=ids)
    def h(request):
        yield from chk.run_harness(request.param, closed)

    def test_chunked_prefill_second_request_rides_the_first_ones_chunks(h):
        run_chunked(h)

    def test_abort_mid_chunk(h):
        run_abort_mid_chunk(h)

    def test_host_hit_after_eviction_churn_is_loaded_back(h):
        o = run_host_hit(h)
        chk.check_loaded_back(o, list(o.outputs))

    def test_concurrent_load_backs_in_one_batch(h):
        check_concurrent(run_concurrent(h))

    def test_abort_after_load_back(h):
        o = run_abort_after_load_back(h)
        chk.check_aborted(o, sorted(o.outputs)[0])
        assert o.load_backs and o.declined_tokens() == 0, o.load_backs

    return {"h": h, **{f.__name__: f for f in (
        test_chunked_prefill_second_request_rides_the_first_ones_chunks, test_abort_mid_chunk,
        test_host_hit_after_eviction_churn_is_loaded_back, test_concurrent_load_backs_in_one_batch,
        test_abort_after_load_back)}}
