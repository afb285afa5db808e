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
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Optional

REQUESTS = 40
DEVICE_PAGES = 16
HOST_PAGES = 24


def _setup() -> None:
    from tests.sglang_0523.scenarios import _setup as setup

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
    driver = stack.controller.cp_l3
    # the scheduler's storage calls reach the driver (before any test patch)
    surface = {name: getattr(getattr(stack.cache, name), "__self__", None) is driver for name in driver._REPLACED}
    written: list[str] = []
    put = driver.tier.store.put

    def recorded_put(keys: Any, blobs: Any) -> list[bool]:
        results = put(keys, blobs)
        written.extend(k for k, ok in zip(keys, results) if ok)
        return results

    driver.tier.store.put = recorded_put
    store_pages, store_calls = driver.tier.store_pages, []

    def recorded_store(hashes: list, owners: list, slots: list) -> int:
        start = len(written)
        try:
            return store_pages(hashes, owners, slots)
        finally:
            store_calls.append((list(hashes), list(owners), written[start:]))

    driver.tier.store_pages = recorded_store
    if patch is not None:
        patch(driver, rank)
    records = [engine.serve(i, r.tokens) for i, r in enumerate(_requests())]
    totals = engine.totals()
    out = {
        "counters": asdict(driver.counters),
        "written_keys": written,
        "store_calls": store_calls,
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
            def failing_fetch(*args: Any, **kwargs: Any) -> Any:
                raise OSError("injected: fetch failed on rank 1")

            driver.tier.fetch_pages = failing_fetch
        else:
            put, calls = driver.tier.store.put, [0]

            def failing_put(keys: Any, blobs: Any) -> list[bool]:
                calls[0] += 1
                if calls[0] % 2:
                    raise OSError("injected: put raised on rank 1")
                return [False] * len(keys)

            driver.tier.store.put = failing_put
            del put

    return patch


def _abort_every_third_lookup(driver: Any, rank: int) -> None:
    """The scheduler aborts every third request right after its lookup was
    issued (``finish(handle, ABORT)``, alike on every rank)."""
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome

    cache, prefetch, calls = driver.cache, driver.cache.prefetch_from_storage, [0]

    def aborting(request: Any, *args: Any, **kwargs: Any) -> Any:
        out = prefetch(request, *args, **kwargs)
        calls[0] += 1
        if calls[0] % 3 == 0 and any(p.handle == request for p in driver.pending):
            driver.aborted_lookups = getattr(driver, "aborted_lookups", 0) + 1
            cache.finish(request, CacheRequestOutcome.ABORT)
        return out

    cache.prefetch_from_storage = aborting


def _other_model(rank: int, group: Any, l3_dir: str) -> dict[str, Any]:
    """A CP 2 reader whose namespace names another model."""
    from sglang_cp_hicache.sglang_0523 import strategy

    open_l3 = strategy.open_l3

    def other(location: Any, group_: Any, *, model_id: Any, layer_start: int) -> Any:
        return open_l3(location, group_, model_id="another/model", layer_start=layer_start)

    def no_writes(driver: Any, rank_: int) -> None:
        # Nothing of its own in L3: anything restored would be the other model's.
        driver.tier.store_pages = lambda hashes, owners, slots: 0

    strategy.open_l3 = other
    try:
        return _run(2, rank, group, l3_dir, no_writes)
    finally:
        strategy.open_l3 = open_l3


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
        for name, source in (("r4", "d4"), ("r3", "d3"), ("bad", "d4"), ("fetch", "d4"), ("other", "d4")):
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
        out["unusable"] = _unusable(rank, group2, str(base / "a-file"))
    dist.barrier()
    if rank == 0:
        out["files"] = {name: sorted(p.name for p in (base / name).rglob("*.bin")) for name in ("d4", "d3")}
    return out
