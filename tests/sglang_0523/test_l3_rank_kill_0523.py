"""A CP rank SIGKILLed in the middle of an L3 lookup on SGLang 0.5.23, real
processes on gloo.

Two spawned processes (CP 2): they write a chain to a directory, then a
fresh CP 2 stack on each serves the chain's first pages (a host-backed
anchor) and looks the rest up in L3. Both run the query's MIN (every rank
has fetched and copied its own pages into its host pool), rank 1 SIGKILLs
itself, and rank 0 runs the fetch's MIN on the ready-ack all-reduce. Rank 0
must end within a bounded time with :class:`CpL3LookupAborted` and one error
log line, nothing inserted, its host slots and the anchor's lock given back.
The directory then holds exactly the objects written, each whole and valid,
and a fresh CP 2 group reads the chain back bit-exact.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.spawned_ranks import run_spawned_ranks

P = 64
PAGES = 6
PREFIX_PAGES = 2
TOKENS = list(range(3000, 3000 + PAGES * P + 1))  # the last token is never matched
VICTIM = 1
GROUP_TIMEOUT_S = 10  # gloo's bound if the peer's death went unnoticed
BOUND_S = 15  # the survivor must have given up by then
STARTUP_BOUND_S = 150  # both processes started, ran and exited


def _digests(directory: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in directory.rglob("*.bin")}


def _write_chain(rank: int, l3_dir: str) -> None:
    """CP 2 serves the chain (write-through), the acks are consumed: each
    rank stores its own pages."""
    from sglang_cp_hicache.sim.engine_0523 import ShardedSimRankEngine
    import torch.distributed as dist

    from tests.helpers.sglang_0523 import l3_scenarios

    stack = l3_scenarios._stack(2, rank, dist.group.WORLD, l3_dir)
    engine = ShardedSimRankEngine(stack, content_seed=1)
    engine.serve(0, TOKENS)
    for _ in range(3):
        engine._check_events()
    # The writes run on the L3 I/O threads; closing drops what is still queued.
    assert stack.cp.l3.wait_io(timeout=30)
    stack.close()


def _lookup(engine: Any, tokens: list[int]) -> Any:
    """The scheduler's ``prefetch_from_storage`` for ``tokens`` (as the rank
    engine issues it); returns the request's handle."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache = engine.cache
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
    matched = int(match.device_prefix_len) + int(match.host_hit_length)
    handle = CacheRequestHandle("killed-lookup", 0)
    anchor = match.last_host_node
    cache.prefetch_from_storage(handle, anchor, tokens[matched : len(tokens) - 1], cache.get_last_hash_value(anchor),
                                None, matched_prefix_tokens=tokens[:matched])
    return handle


def _host_locks(engine: Any) -> int:
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    return sum(n.component(ComponentType.FULL).host_lock_ref for n in engine._nodes())


def _rank_main(rank: int, world: int, init_file: str, l3_dir: str, out_dir: str) -> None:
    """One CP rank: write, then look up, the query's MIN, then (victim) die
    or (survivor) the fetch's MIN; the survivor writes what it saw to JSON."""
    import logging

    logging.basicConfig(filename=f"{out_dir}/rank{rank}.log", level=logging.WARNING)
    from tests.helpers.sglang_0523 import l3_scenarios

    l3_scenarios._setup()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    from sglang_cp_hicache.sim.engine_0523 import ShardedSimRankEngine

    _write_chain(rank, l3_dir)
    dist.barrier()
    report: dict[str, Any] = {"written": _digests(Path(l3_dir))}
    stack = l3_scenarios._stack(2, rank, dist.group.WORLD, l3_dir)
    engine = ShardedSimRankEngine(stack, content_seed=1)
    engine.serve(0, TOKENS[: PREFIX_PAGES * P + 1])  # computed, written through: a host-backed anchor
    driver, host = stack.cp.l3, stack.cache.cache_controller.mem_pool_host
    report["host_available_before"] = int(host.available_size())
    report["violations_before"] = engine.invariant_violations()
    _lookup(engine, TOKENS)
    assert driver.wait_io(timeout=30)  # the query's I/O (an L3 thread) is done: its word is ready
    engine._check_events()  # the query's MIN: every rank fetches its own pages
    report["after_query"] = [p.stage.value for p in driver.pending]
    report["host_available_after_query"] = int(host.available_size())
    report["host_locks_after_query"] = _host_locks(engine)
    Path(f"{out_dir}/query{rank}.done").touch()
    if rank == VICTIM:
        while not all(Path(f"{out_dir}/query{r}.done").exists() for r in range(world)):
            time.sleep(0.01)  # every peer is past the query's MIN
        os.kill(os.getpid(), signal.SIGKILL)
    while not Path(f"{out_dir}/query{VICTIM}.done").exists():
        time.sleep(0.01)
    time.sleep(0.5)  # the victim is gone (or going)
    assert driver.wait_io(timeout=30)  # this rank's fetch is done: its word is ready
    nodes = len(engine._nodes())
    start = time.monotonic()
    try:
        engine._check_events()  # the fetch's MIN, with a dead peer
        report["outcome"], report["error"], report["cause"] = "none", "", ""
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report["outcome"], report["error"] = type(exc).__name__, str(exc)
        report["cause"] = type(exc.__cause__).__name__ if exc.__cause__ is not None else ""
    report["seconds"] = time.monotonic() - start
    slots = stack.cache.cache_controller.mem_pool_host.anchor_entry.host_pool._slots
    report.update(
        pending=len(driver.pending),
        nodes_before=nodes,
        nodes_after=len(engine._nodes()),
        host_available_after=int(host.available_size()),
        host_locks=_host_locks(engine),
        violations=[v for v in engine.invariant_violations() if not v.startswith("unconsumed acks")],
        restored_nodes=driver.counters.restored_nodes,
        prefetches=driver.counters.prefetches,
        slots_in_use=int(slots.size - slots.aggregate_free_size()),
    )
    Path(f"{out_dir}/rank{rank}.json").write_text(json.dumps(report))
    os._exit(0)  # the group is broken: no teardown that would wait on the dead peer


def _read_back(rank: int, world: int, *, l3_dir: str) -> dict[str, Any]:
    """A fresh CP 2 group: every object unpacks in its namespace, then the
    chain is served with L3 and each restored page verified bit-exact."""
    from tests.helpers.sglang_0523 import l3_scenarios

    l3_scenarios._setup()
    from sglang_cp_hicache.l3.envelope import Rejection, unpack
    import torch.distributed as dist

    from sglang_cp_hicache.sim.engine_0523 import ShardedSimRankEngine

    stack = l3_scenarios._stack(world, rank, dist.group.WORLD, l3_dir)
    tier = stack.cp.l3.tier
    rejected = []
    for f in sorted(Path(l3_dir).rglob("*.bin")):
        ns = tier.kv_ns if f"_{tier.kv_ns.digest()}_" in f.stem else tier.indexer_ns
        if isinstance(unpack(f.stem, ns, f.read_bytes()), Rejection):
            rejected.append(f.name)
    engine = ShardedSimRankEngine(stack, content_seed=1)
    record = engine.serve(0, TOKENS)
    out = {"rejected": rejected, "corrupted": record.corrupted_pages, "l3_verified": record.l3_pages_verified,
           "loaded": record.loaded_tokens, "restored_pages": stack.cp.l3.counters.restored_pages,
           "violations": engine.invariant_violations()}
    stack.close()
    return out


def _spawn_kill_run(tmp_path: Path) -> tuple[list[Any], Path]:
    out = tmp_path / "out"
    out.mkdir()
    procs = run_spawned_ranks(
        _rank_main, 2, str(tmp_path / "init"), str(tmp_path / "l3"), str(out), bound_s=STARTUP_BOUND_S
    )
    return procs, out


@pytest.mark.slow(45)
def test_a_rank_killed_between_the_query_and_the_fetch(tmp_path):
    from tests.helpers.sglang_0523.ranks import run_ranks

    procs, out = _spawn_kill_run(tmp_path)
    assert procs[VICTIM].exitcode == -signal.SIGKILL
    assert procs[0].exitcode == 0, (out / "rank0.log").read_text() if (out / "rank0.log").exists() else ""

    report = json.loads((out / "rank0.json").read_text())
    assert len(report["written"]) == 2 * PAGES  # KV + indexer object per page
    assert report["violations_before"] == []
    assert report["after_query"] == ["fetch"]
    assert report["host_available_after_query"] < report["host_available_before"]  # the fetch held host room
    assert report["outcome"] == "CpL3PrefetchAborted", report
    assert report["cause"] != "" and "none was inserted" in report["error"]
    assert report["seconds"] < BOUND_S
    assert report["pending"] == 0 and report["nodes_after"] == report["nodes_before"]
    assert report["host_available_after"] == report["host_available_before"]
    assert report["violations"] == []  # no node locked, host slots in use == held by tree nodes
    assert report["host_locks_after_query"] == 1 and report["host_locks"] == 0  # the anchor's lock
    assert report["prefetches"] == 1 and report["restored_nodes"] == 0
    log = (out / "rank0.log").read_text()
    lines = [ln for ln in log.splitlines() if "cp-hicache L3: the step all-reduce failed" in ln]
    assert len(lines) == 1, log
    expected = f"on cp_rank 0 with 1 L3 lookup(s) pending (fetch of {PAGES - PREFIX_PAGES} pages)"
    assert expected in lines[0] and lines[0].startswith("ERROR"), lines

    # The directory: exactly the objects written, each whole and valid, and
    # a fresh CP 2 group reads the chain back bit-exact.
    directory = tmp_path / "l3"
    assert _digests(directory) == report["written"] and not list(directory.rglob("*.tmp*"))
    runs = run_ranks(_read_back, 2, str(tmp_path), timeout_s=600, l3_dir=str(directory))
    for rank, run in enumerate(runs):
        assert run["rejected"] == [] and run["violations"] == [], (rank, run)
        assert run["corrupted"] == 0 and run["loaded"] == (PAGES * P) and run["l3_verified"] > 0, (rank, run)
    assert sum(r["restored_pages"] for r in runs) == PAGES


def test_the_fallback_min_failing_gives_back_every_pending_lookup(caplog):
    """The path without the ready-ack sync: its own MIN of the lookup words
    raises; every lookup's slots and anchor lock go back, nothing is inserted."""
    import logging
    from types import SimpleNamespace

    import torch

    from tests.helpers.sglang_0523 import l3_scenarios

    l3_scenarios._setup()
    from sglang_cp_hicache.l3.location import L3Location
    from sglang_cp_hicache.l3.prefetch import ChainPlan, L3Lookup, Stage
    from sglang_cp_hicache.l3.rank import RankL3
    from sglang_cp_hicache.placement import CpPlacement
    from sglang_cp_hicache.sglang_0523.l3_cache import CpL3LookupAborted, L3Driver
    from sglang_cp_hicache.sglang_0523.l3_port import ChainRelease, HostRoom0523, L3Port0523
    from sglang_cp_hicache.l3.host_tier import L3Counters

    freed, released, inserted = [], [], []

    def failing_min(tensor: Any, op: Any) -> None:
        raise RuntimeError("injected: Connection closed by peer")

    cache = SimpleNamespace(
        _all_reduce_attn_groups=failing_min,
        cache_controller=SimpleNamespace(mem_pool_host=SimpleNamespace(free=lambda s: freed.append(s.tolist()))),
        dec_host_lock_ref=lambda node_id, lock: released.append((node_id, lock)),
        tree_core=SimpleNamespace(insert_host=lambda *a: inserted.append(a)),
    )
    tier = SimpleNamespace(placement=CpPlacement(64, 2, 1), counters=L3Counters(), page_size=64)
    port = L3Port0523(cache, tier, None)
    driver = L3Driver(cache, RankL3(tier, port, L3Location("/unused", False, "test")), port)
    driver._upstream["check_hicache_events"] = lambda: None

    def plan(anchor: int) -> ChainPlan:
        return ChainPlan(anchor, None, (), ["a", "b"], [0, 1], ChainRelease(f"lock{anchor}", 0, 0, 0))

    driver.prefetcher.pending = [
        L3Lookup(Stage.FETCH, plan(7), 2, None, word=2, room=HostRoom0523(torch.arange(128), [64])),
        L3Lookup(Stage.QUERY, plan(9), 2, None, word=2),
    ]
    with caplog.at_level(logging.ERROR, logger="sglang_cp_hicache.l3.prefetch"):
        with pytest.raises(CpL3LookupAborted, match="2 L3 lookup.s. pending on cp_rank 1") as info:
            driver.check_hicache_events()
    assert isinstance(info.value.__cause__, RuntimeError) and "injected" in str(info.value.__cause__)
    assert freed == [list(range(128))] and released == [(7, "lock7"), (9, "lock9")] and inserted == []
    assert driver.pending == []
    lines = [r.getMessage() for r in caplog.records if "step all-reduce failed" in r.getMessage()]
    assert len(lines) == 1 and "on cp_rank 1 with 2 L3 lookup(s) pending (fetch of 2 pages, query of 2 pages)" in lines[0]
