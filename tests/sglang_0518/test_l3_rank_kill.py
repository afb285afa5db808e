"""A CP rank SIGKILLed in the middle of an L3 prefetch, real processes on gloo.

CP 4 writes a directory (threaded ranks, this process). Then CP 2 reads it
in two spawned processes: both run the query's MIN (every rank has fetched
and copied its own pages into its host pool), rank 1 SIGKILLs itself, and
rank 0 runs the fetch's MIN. Rank 0 must end within a bounded time with
:class:`CpL3PrefetchAborted` and one error log line, nothing inserted, its
host slots, ledger charge and the anchor's protection given back. The
directory then holds only whole, valid objects, and a fresh CP 2 group reads
it back bit-exact.
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest

from sglang_cp_hicache import settings

from tests.helpers.spawned_ranks import run_spawned_ranks

P = 64
PAGES = 5
TOKENS = list(range(1000, 1000 + PAGES * P))
VICTIM = 1
GROUP_TIMEOUT_S = 10  # gloo's bound if the peer's death went unnoticed
BOUND_S = 15  # the survivor must have given up by then
STARTUP_BOUND_S = 120  # both processes started, ran and exited


def _rank_main(rank: int, world: int, init_file: str, l3_dir: str, out_dir: str) -> None:
    """One CP rank process: prefetch, the query's MIN, then (victim) die or
    (survivor) the fetch's MIN; the survivor writes what it saw to JSON."""
    import logging

    began = time.monotonic()
    logging.basicConfig(filename=f"{out_dir}/rank{rank}.log", level=logging.INFO)
    os.environ[settings.L3_DIR.name] = l3_dir
    from sglang_cp_hicache.testing.torchvision_standin import ensure_sglang_importable

    ensure_sglang_importable()
    import torch.distributed as dist
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sglang_cp_hicache.testing.stack_0518 import CpStackConfig, build_cp_rank_stack

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    stack = build_cp_rank_stack(CpStackConfig(cp_size=world, device_pages=8, host_pages=10), rank,
                                cp_group=dist.group.WORLD)
    cache = stack.cache
    report = {"startup_s": time.monotonic() - began, "looked_up": cache.l3_prefetch(RadixKey(TOKENS))}
    cache.l3_wait_io(timeout=10)
    cache.check_hicache_events()  # the query's MIN: every rank starts fetching its own pages
    report["after_query"] = [p.stage.value for p in cache.cp_l3.prefetcher.pending]
    report["host_used_after_query"] = cache.host_slot_ledger.used
    Path(f"{out_dir}/query{rank}.done").touch()
    if rank == VICTIM:
        while not all(Path(f"{out_dir}/query{r}.done").exists() for r in range(world)):
            time.sleep(0.01)  # every peer is past the query's MIN
        os.kill(os.getpid(), signal.SIGKILL)
    cache.l3_wait_io(timeout=10)  # its pages are in its host pool
    start = time.monotonic()
    try:
        cache.check_hicache_events()  # the fetch's MIN, with a dead peer
        report["outcome"], report["error"] = "none", ""
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report["outcome"], report["error"] = type(exc).__name__, str(exc)
    report["seconds"] = time.monotonic() - start
    host = cache.cache_controller.mem_pool_host
    report.update(
        pending=len(cache.cp_l3.prefetcher.pending),
        children=len(cache.root_node.children),
        host_free=host.available_size() == host.size,
        ledger=cache.host_slot_ledger.used,
        root_host_refs=cache.root_node.host_ref_counter,
        restored=cache.cp_l3.counters.restored_pages,
    )
    Path(f"{out_dir}/rank{rank}.json").write_text(json.dumps(report))
    os._exit(0)  # the group is broken: no teardown that would wait on the dead peer


@pytest.mark.slow(12)
def test_a_rank_killed_between_the_query_and_the_fetch(tmp_path, monkeypatch):
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sglang_cp_hicache.l3.envelope import Rejection, unpack
    from sglang_cp_hicache.testing.stack_0518 import CpStackConfig
    from tests.helpers.cp_cluster import CpCluster

    directory = tmp_path / "l3"
    monkeypatch.setenv(settings.L3_DIR.name, str(directory))
    writer = CpCluster(CpStackConfig(cp_size=4, device_pages=8, host_pages=10), threaded=True, timeout_s=30)
    try:
        writer.insert(TOKENS)
        writer.step()
        assert all(writer.each(lambda s: s.cache.l3_wait_io(timeout=10)))
        assert sum(c.cp_l3.counters.written_pages for c in writer.caches) == PAGES
    finally:
        writer.close()
    before = {f: f.read_bytes() for f in directory.rglob("*.bin")}
    assert len(before) == 2 * PAGES

    out = tmp_path / "out"
    out.mkdir()
    # Start-up (a fresh interpreter importing SGLang) dominates and depends on
    # the machine's load; the bound under test is the survivor's (BOUND_S).
    procs = run_spawned_ranks(
        _rank_main, 2, str(tmp_path / "init"), str(directory), str(out), bound_s=STARTUP_BOUND_S
    )
    assert procs[VICTIM].exitcode == -signal.SIGKILL
    assert procs[0].exitcode == 0

    report = json.loads((out / "rank0.json").read_text())
    assert report["looked_up"] == PAGES and report["after_query"] == ["fetch"]
    assert sum(report["host_used_after_query"]) == PAGES * P  # the fetch held host room
    assert report["outcome"] == "CpL3PrefetchAborted" and "none was inserted" in report["error"]
    assert report["seconds"] < BOUND_S
    assert report["pending"] == 0 and report["children"] == 0 and report["restored"] == 0
    assert report["host_free"] and report["ledger"] == [0, 0] and report["root_host_refs"] == 0
    log = (out / "rank0.log").read_text()
    assert "cp-hicache L3: the step all-reduce failed on cp_rank 0 with 1 L3 lookup(s) pending" in log

    # The directory: exactly the objects CP 4 wrote, each whole and valid.
    after = {f: f.read_bytes() for f in directory.rglob("*.bin")}
    assert after == before and not list(directory.rglob("*.tmp*"))
    reader = CpCluster(CpStackConfig(cp_size=2, device_pages=8, host_pages=10), threaded=True, timeout_s=30)
    try:
        tier = reader.caches[0].cp_l3.tier
        for f, blob in after.items():
            ns = tier.kv_ns if f"_{tier.kv_ns.digest()}_" in f.stem else tier.indexer_ns
            assert not isinstance(unpack(f.stem, ns, blob), Rejection), f
        assert len(set(reader.each(lambda s: s.cache.l3_prefetch(RadixKey(TOKENS))))) == 1
        for _ in range(2):  # the query's MIN, the fetch's: each once every rank's reads are done
            assert all(reader.each(lambda s: s.cache.l3_wait_io(timeout=10)))
            reader.step()
        reader.load_back(TOKENS)
        assert [int(t.numel()) for t in reader.device_locs(TOKENS)] == [PAGES * P] * 2
        assert reader.check(TOKENS) == {}
    finally:
        reader.close()
