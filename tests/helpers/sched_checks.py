"""Scenario checks shared by both releases' real-scheduler tests.

Every scenario already failed the run if any rank read a prefix row that did
not hold its content (the forward stand-in) or if SGLang's own idle leak
checks raised (strict mode); these checks assert what the scheduler did.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from sglang_cp_hicache.testing import sched_scenarios as sc
from sglang_cp_hicache.testing.sched_config import PdScript, SchedConfig
from sglang_cp_hicache.testing.sched_harness import RunResult, SchedulerHarness

#: Rooms whose fake PD sender is scripted (every PD run carries them).
DELAYED_ROOM, FAIL_BOOTSTRAP_ROOM, FAIL_TRANSFER_ROOM = 900_001, 900_002, 900_003
PD_SCRIPTS = (PdScript(DELAYED_ROOM, bootstrap_polls=3), PdScript(FAIL_BOOTSTRAP_ROOM, fail="bootstrap"),
              PdScript(FAIL_TRANSFER_ROOM, bootstrap_polls=1, fail="transfer"))
PD_ARGS = (("optimistic_prefill_attempts", 2),)


def pd_config(version: str, cp_size: int, overlap: bool) -> SchedConfig:
    return SchedConfig(version, cp_size=cp_size, pd_prefill=True, overlap=overlap, pd_scripts=PD_SCRIPTS,
                       extra_server_args=PD_ARGS)


def run_harness(config: SchedConfig, closed: list[RunResult]) -> Iterator[SchedulerHarness]:
    """A module fixture's body: one rank group for every test of the module;
    its shutdown result goes to ``closed`` for the last test."""
    with SchedulerHarness(config) as h:
        yield h
        if not h._closed:
            closed.append(h.close())


def expected_loop(config: SchedConfig) -> str:
    kind = "overlap" if config.overlap else "normal"
    return f"event_loop_{kind}_disagg_prefill" if config.pd_prefill else f"event_loop_{kind}"


def check_chunked_shared_prefix(o: sc.Outcome, chunk: int) -> None:
    """The second request was scheduled on the first one's checkpointed chunk
    pages while the first one was still being prefilled."""
    first, second = sorted(o.outputs)  # a1-*, a2-*
    a1 = o.entries(first)
    a2 = o.entries(second)
    assert [e.extend_len for _, e in a1 if e.prefix_len < 300][:2] == [chunk, chunk], a1
    a1_last_extend = max(i for i, e in a1 if e.prefix_len + e.extend_len <= 300 and e.extend_len > 1)
    first_a2, e2 = a2[0]
    assert e2.prefix_len == 192, f"second request should reuse the first one's 192 shared tokens, ran {a2}"
    assert first_a2 <= a1_last_extend, f"second request ran only after the first one finished prefill: {o.batches}"
    assert {o.outputs[r].finish_type for r in o.outputs} == {"length"}, o.outputs


def check_loaded_back(o: sc.Outcome, rids: list[str]) -> None:
    """Every request's host hit was loaded back (none recomputed), and each
    request's first batch started at the whole cached prefix."""
    assert o.load_backs, "the scheduler asked for no load-back: the scenario never reached a host hit"
    assert o.declined_tokens() == 0, f"load-backs declined: {o.load_backs}"
    for rid in rids:
        first = o.entries(rid)[0][1]
        assert first.prefix_len == o.notes["prefix_tokens"], f"{rid} recomputed its prefix: {o.entries(rid)}"


def check_aborted(o: sc.Outcome, rid: str) -> None:
    assert o.outputs[rid].finish_type == "abort", o.outputs[rid]
    last = max(i for i, _ in o.entries(rid))
    # the abort arrives at the next recv_requests: at most the chunk already launched runs after it
    assert last <= 1 + min(i for i, _ in o.entries(rid)) + 1, o.batches


def check_closed(result: RunResult, config: SchedConfig) -> None:
    """The ShutdownReq ended SGLang's own loop on every rank, fully idle, its
    idle leak checks passing, having run the expected loop and checked content."""
    assert len(result.ranks) == config.cp_size
    # SGLang 0.5.18's PD prefill loops never check gracefully_exit (disaggregation/prefill.py)
    ignores_shutdown = config.version == "0.5.18" and config.pd_prefill
    for rank in result.ranks:
        assert rank.final and rank.idle_checks > 0, rank
        assert rank.loops == [expected_loop(config)], rank.loops
        assert rank.loop_ignored_shutdown == ignores_shutdown, rank
        assert rank.stats.written > 0 and rank.stats.verified > 0 and rank.stats.poisoned > 0, rank.stats
    assert all(r.stats.batches == len(result.batches) for r in result.ranks)


skip_unless = pytest.mark.skipif
