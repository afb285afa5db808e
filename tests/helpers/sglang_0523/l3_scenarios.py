"""L3 scenarios on SGLang 0.5.23's sharded stack, run in 4 rank processes
(:func:`l3_suite`): CP 4 writes, CP 3 (ranks 0-2) writes, then CP 2 (ranks
0-1) reads copies of both directories, damaged copies and faulty ranks.

Every run drives the simulator's rank engine, which makes the scheduler's
storage calls (``prefetch_from_storage``, ``check_hicache_events``,
``check_prefetch_progress``, ``pop_prefetch_loaded_span``) and verifies every
restored page this rank owns against the content its tokens must have (KV
row and indexer row).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

REQUESTS = 40
DEVICE_PAGES = 16
HOST_PAGES = 24


def _setup() -> None:
    from tests.helpers.sglang_0523.scenarios import _setup as setup

    setup()


def _stack(world: int, rank: int, group: Any, l3_dir: str) -> Any:
    from sglang_cp_hicache import settings
    from sglang_cp_hicache.testing.stack_0523 import ShardedStackConfig, build_sharded_rank_stack

    os.environ[settings.L3_DIR.name] = l3_dir
    config = ShardedStackConfig(cp_size=world, device_pages=DEVICE_PAGES, host_pages=HOST_PAGES, copy_path="library")
    return build_sharded_rank_stack(config, rank, cp_group=group)


def _requests() -> list:
    from sglang_cp_hicache.sim.workload import synthetic_chat

    # The smallest deployment (CP 2) bounds the request length.
    return synthetic_chat(REQUESTS, seed=7, max_tokens=(2 * DEVICE_PAGES - 1) * 64)


def _run(world: int, rank: int, group: Any, l3_dir: str, patch: Optional[Callable[[Any, int], None]] = None,
         ) -> dict[str, Any]:
    """The workload on one rank of a CP ``world`` stack with L3 in ``l3_dir``."""
    from sglang_cp_hicache.sim.engine_0523 import ShardedSimRankEngine

    stack = _stack(world, rank, group, l3_dir)
    engine = ShardedSimRankEngine(stack, content_seed=1)
    driver = stack.cp.l3
    # the scheduler's storage calls reach the driver (before any test patch)
    surface = {name: getattr(getattr(stack.cache, name), "__self__", None) is driver for name in driver._REPLACED}
    written: list[str] = []
    io_threads: set[str] = set()
    lock = threading.Lock()
    write_from = driver.tier.store.write_from

    def recorded_write(key: str, views: Any) -> bool:  # on the L3 write threads
        io_threads.add(threading.current_thread().name)
        done = write_from(key, views)
        if done:
            with lock:
                written.append(key)
        return done

    driver.tier.store.write_from = recorded_write
    write, write_calls = driver.l3.writer.write, []

    def recorded_node_write(hashes: list, owners: list, slots: list, parent: Any = None) -> None:  # scheduler thread
        write_calls.append((list(hashes), list(owners), parent))
        return write(hashes, owners, slots, parent)

    driver.l3.writer.write = recorded_node_write
    for method in ("exists", "open_object"):  # writes are recorded above
        real = getattr(driver.tier.store, method)

        def recorded(keys: Any, *args: Any, _real: Any = real) -> Any:
            io_threads.add(threading.current_thread().name)
            return _real(keys, *args)

        setattr(driver.tier.store, method, recorded)
    if patch is not None:
        patch(driver, rank)
    records = [engine.serve(i, r.tokens) for i, r in enumerate(_requests())]
    totals = engine.totals()  # waits for the last writes
    out = {
        "counters": driver.counters.as_dict(),
        "written_keys": written,
        "write_calls": write_calls,
        "io_threads": sorted(io_threads),
        "scheduler_thread": threading.current_thread().name,
        "corrupted_pages": sum(r.corrupted_pages for r in records),
        "l3_pages_verified": sum(r.l3_pages_verified for r in records),
        "restored_pages_verified": sum(r.restored_pages_verified for r in records),
        "l3_hit_tokens": totals.l3_hit_tokens,
        "digest": totals.tree_digest,
        "invariant_violations": totals.invariant_violations,
        "acks": list(engine.acks.as_tuple()),
        "records": [(r.device_hit_tokens, r.host_hit_tokens, r.loaded_tokens) for r in records],
        "surface": surface,
        "namespaces": driver.tier.describe(),
        "aborted_lookups": getattr(driver, "aborted_lookups", 0),
    }
    stack.close()
    return out


def _damage(directory: Path) -> dict[str, str]:
    """Delete one object, truncate one, flip one payload bit of one (KV and
    indexer objects alike), spread over the directory."""
    objects = sorted(directory.rglob("*.bin"))
    picks = {"deleted": objects[len(objects) // 5], "truncated": objects[len(objects) // 2],
             "flipped": objects[(4 * len(objects)) // 5]}
    picks["deleted"].unlink()
    data = picks["truncated"].read_bytes()
    picks["truncated"].write_bytes(data[: len(data) - 7])
    data = bytearray(picks["flipped"].read_bytes())
    data[len(data) - 3] ^= 0x10
    picks["flipped"].write_bytes(bytes(data))
    return {kind: path.name for kind, path in picks.items()}


def _raise_on_rank_1(what: str) -> Callable[[Any, int], None]:
    def patch(driver: Any, rank: int) -> None:
        if rank != 1:
            return
        if what == "fetch":
            def failing_read(*args: Any, **kwargs: Any) -> Any:
                raise OSError("injected: fetch failed on rank 1")

            driver.tier.read_page = failing_read
        else:
            calls = [0]

            def failing_write(key: str, views: Any) -> bool:
                calls[0] += 1
                if calls[0] % 2:
                    raise OSError("injected: put raised on rank 1")
                return False

            driver.tier.store.write_from = failing_write

    return patch


def _abort_every_third_lookup(driver: Any, rank: int) -> None:
    """The scheduler aborts every third request right after its lookup was
    issued (``finish(handle, ABORT)``, alike on every rank)."""
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome

    cache, prefetch, calls = driver.cache, driver.cache.prefetch_from_storage, [0]

    def aborting(request: Any, *args: Any, **kwargs: Any) -> Any:
        out = prefetch(request, *args, **kwargs)
        calls[0] += 1
        if calls[0] % 3 == 0 and driver.prefetcher.is_waiting(request):
            driver.aborted_lookups = getattr(driver, "aborted_lookups", 0) + 1
            cache.finish(request, CacheRequestOutcome.ABORT)
        return out

    cache.prefetch_from_storage = aborting


def _other_model(rank: int, group: Any, l3_dir: str) -> dict[str, Any]:
    """A CP 2 reader whose namespace names another model."""
    from sglang_cp_hicache.l3.identity import ModelIdentity
    from sglang_cp_hicache.sglang_0523 import strategy

    open_l3 = strategy.open_l3

    def other(location: Any, source: str, bind: Any, *, server_args: Any) -> Any:
        return open_l3(location, source, bind, identity=ModelIdentity("name:another/model"))

    def no_writes(driver: Any, rank_: int) -> None:
        # Nothing of its own in L3: anything restored would be the other model's.
        driver.l3.writer.write = lambda hashes, owners, slots, parent=None: None

    strategy.open_l3 = other
    try:
        return _run(2, rank, group, l3_dir, no_writes)
    finally:
        strategy.open_l3 = open_l3


#: The lookup deadline of the stuck-read run (seconds).
STUCK_DEADLINE_S = 1.0


def _stuck_read_on_rank_1(method: str) -> Callable[[Any, int], None]:
    """Rank 1's first store ``method`` call (``exists``: a query; ``get``: a
    fetch) never returns while the run lasts; every lookup's start and settle
    time and every step's time are recorded in ``driver.timing``."""

    def patch(driver: Any, rank: int) -> None:
        from sglang_cp_hicache.l3.location import L3Timeouts

        driver.prefetcher.timeouts = L3Timeouts(STUCK_DEADLINE_S, 0.0, STUCK_DEADLINE_S)
        timing = driver.timing = {"lookups": [], "steps": [], "release": threading.Event()}
        prefetcher, cache = driver.prefetcher, driver.cache
        start, commit, events = prefetcher.start, prefetcher.commit, cache.check_hicache_events
        began: dict[int, float] = {}

        def timed_start(plan: Any, rid: Any = None) -> None:
            start(plan, rid)
            began[id(prefetcher.pending[-1].plan)] = time.monotonic()

        def timed_commit(agreed: list) -> None:
            before = {id(lookup.plan) for lookup in prefetcher.pending}
            commit(agreed)
            after = {id(lookup.plan) for lookup in prefetcher.pending}
            for gone in before - after:
                timing["lookups"].append(time.monotonic() - began.pop(gone))

        def timed_events() -> None:
            t0 = time.monotonic()
            events()
            timing["steps"].append(time.monotonic() - t0)

        prefetcher.start, prefetcher.commit, cache.check_hicache_events = timed_start, timed_commit, timed_events
        if rank != 1:
            return
        store = driver.tier.store
        real, calls = getattr(store, method), [0]

        def hangs(keys: Any, *args: Any) -> Any:  # exists(keys) or open_object(key, size)
            calls[0] += 1
            if calls[0] == 1:
                timing["release"].wait()  # until the run is over
            return real(keys, *args)

        setattr(store, method, hangs)

    return patch


def _stuck(rank: int, group: Any, l3_dir: str, method: str) -> dict[str, Any]:
    holder: dict[str, Any] = {}

    def patch(driver: Any, rank_: int) -> None:
        _stuck_read_on_rank_1(method)(driver, rank_)
        holder["driver"] = driver

    try:
        out = _run(2, rank, group, l3_dir, patch)
    finally:
        if "driver" in holder:
            holder["driver"].timing["release"].set()
    timing = holder["driver"].timing
    out["timing"] = {"lookups": timing["lookups"], "steps": timing["steps"]}
    return out


def _joined(rank: int, group: Any, l3_dir: str, k: int = 4) -> dict[str, Any]:
    """K requests with one prefix arrive before a step: one lookup, one
    fetch; the first request reports the storage hit, the others find the
    pages in the host tier; every restored page is verified on the device."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sglang_cp_hicache.sim.engine_0523 import ShardedSimRankEngine

    stack = _stack(2, rank, group, l3_dir)
    engine = ShardedSimRankEngine(stack, content_seed=1)
    driver, cache = stack.cp.l3, stack.cache
    fetches = [0]
    start_fetch = driver.prefetcher._start_fetch

    def counted(*args: Any) -> bool:
        started = start_fetch(*args)
        fetches[0] += int(started)
        return started

    driver.prefetcher._start_fetch = counted
    tokens = list(_requests()[0].tokens)
    handles = [CacheRequestHandle(f"joined-{i}", 0) for i in range(k)]
    for handle in handles:  # the scheduler's _prefetch_kvcache, alike on every rank
        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
        matched = int(match.device_prefix_len) + int(match.host_hit_length)
        anchor = match.last_host_node
        cache.prefetch_from_storage(handle, anchor, tokens[matched: len(tokens) - 1],
                                    cache.get_last_hash_value(anchor), None, matched_prefix_tokens=tokens[:matched])
    steps = 0
    while not all(cache.check_prefetch_progress(h) for h in handles):
        assert driver.wait_io(timeout=30)
        engine._check_events()
        steps += 1
        assert steps < 5, "the joined lookup did not settle"
    spans = [list(cache.pop_prefetch_loaded_span(h)) for h in handles]
    records = [engine.serve(i, tokens) for i in range(k)]
    out = {
        "counters": driver.counters.as_dict(), "fetches": fetches[0], "steps": steps, "spans": spans,
        "corrupted_pages": sum(r.corrupted_pages for r in records),
        "host_hit_tokens": [r.host_hit_tokens for r in records],
        "restored_pages_verified": sum(r.restored_pages_verified for r in records),
        "violations": engine.invariant_violations(),
    }
    stack.close()
    return out


def _unusable(rank: int, group: Any, path: str) -> str:
    try:
        _stack(2, rank, group, path).close()
    except ValueError as exc:
        return str(exc)
    return "built"


def l3_suite(rank: int, world: int, *, l3_root: str) -> dict[str, Any]:
    _setup()
    import torch.distributed as dist

    assert world == 4
    base = Path(l3_root)
    group3, group2 = dist.new_group([0, 1, 2]), dist.new_group([0, 1])
    out: dict[str, Any] = {"cp4_write": _run(4, rank, dist.group.WORLD, str(base / "d4"))}
    dist.barrier()
    if rank < 3:
        out["cp3_write"] = _run(3, rank, group3, str(base / "d3"))
    dist.barrier()
    if rank == 0:
        for name, source in (("r4", "d4"), ("r3", "d3"), ("bad", "d4"), ("fetch", "d4"), ("other", "d4"),
                             ("stuck_q", "d4"), ("stuck_f", "d4"), ("joined", "d4")):
            shutil.copytree(base / source, base / name)
        out["damaged"] = _damage(base / "bad")
        (base / "a-file").write_text("not a directory")
    dist.barrier()
    if rank < 2:
        out["cp4_to_cp2"] = _run(2, rank, group2, str(base / "r4"))
        out["cp3_to_cp2"] = _run(2, rank, group2, str(base / "r3"))
        out["damaged_read"] = _run(2, rank, group2, str(base / "bad"), _abort_every_third_lookup)
        out["fetch_raises"] = _run(2, rank, group2, str(base / "fetch"), _raise_on_rank_1("fetch"))
        out["put_fails"] = _run(2, rank, group2, str(base / "puts"), _raise_on_rank_1("put"))
        out["after_put_fails"] = _run(2, rank, group2, str(base / "puts"))
        out["other_model"] = _other_model(rank, group2, str(base / "other"))
        out["stuck_query"] = _stuck(rank, group2, str(base / "stuck_q"), "exists")
        out["stuck_fetch"] = _stuck(rank, group2, str(base / "stuck_f"), "open_object")
        out["joined"] = _joined(rank, group2, str(base / "joined"))
        out["unusable"] = _unusable(rank, group2, str(base / "a-file"))
    dist.barrier()
    if rank == 0:
        out["files"] = {name: sorted(p.name for p in (base / name).rglob("*.bin")) for name in ("d4", "d3")}
    return out
