"""The library's L3 on SGLang 0.5.23's KV-sharded stack.

Multi-rank results come from :func:`tests.helpers.sglang_0523.l3_scenarios.l3_suite`
(4 rank processes: CP 4 and CP 3 write, CP 2 reads, faults); the resolution
hook and the scheduler-call surface are checked in this process against
SGLang's own code.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.helpers.sglang_0523 import l3_scenarios

SCHEDULER = "managers/scheduler.py"


@pytest.fixture(scope="module")
def l3_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from tests.helpers.sglang_0523.ranks import run_ranks

    workdir = tmp_path_factory.mktemp("l3-0523")
    return run_ranks(l3_scenarios.l3_suite, 4, str(workdir), timeout_s=1200, l3_root=str(workdir))


def _alike(runs: list[dict[str, Any]], where: str) -> None:
    """The ranks of one deployment took the same decisions and leaked nothing."""
    assert len({r["digest"] for r in runs}) == 1, where
    assert len({tuple(r["acks"]) for r in runs}) == 1, where
    assert len({tuple(map(tuple, r["records"])) for r in runs}) == 1, where
    for rank, run in enumerate(runs):
        assert run["invariant_violations"] == [], (where, rank)
        assert run["corrupted_pages"] == 0, (where, rank)
        c = run["counters"]
        assert (c["prefetches"], c["restored_nodes"], c["restored_tokens"]) == (
            runs[0]["counters"]["prefetches"], runs[0]["counters"]["restored_nodes"],
            runs[0]["counters"]["restored_tokens"]), (where, rank)


def _runs(l3_ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r[name] for r in l3_ranks if name in r]


def _alike_runs(l3_ranks: list[dict[str, Any]], name: str, where: str = "", world: int = 0) -> list[dict[str, Any]]:
    """The ranks' runs of scenario ``name`` (``world`` of them, when given),
    checked :func:`_alike` (reported as ``where``, else ``name``)."""
    runs = _runs(l3_ranks, name)
    if world:
        assert len(runs) == world
    _alike(runs, where or name)
    return runs


# ---- writes ------------------------------------------------------------------------


@pytest.mark.parametrize("name,world", [("cp4_write", 4), ("cp3_write", 3)])
def test_each_rank_writes_exactly_its_own_pages(l3_ranks, name, world):
    runs = _alike_runs(l3_ranks, name, world=world)
    parts = dict(part.split(":", 1) for part in runs[0]["namespaces"].split("|"))
    kv, idx = parts["kv"], parts["indexer"]
    calls = [r["write_calls"] for r in runs]
    assert len(calls[0]) > 0 and all(c == calls[0] for c in calls), name  # every node, the same owners, everywhere
    for rank, run in enumerate(runs):
        mine = {f"{h}_{d}_{(p or 'root')[:16]}" for hashes, owners, parent in calls[0]
                for h, o, p in zip(hashes, owners, [parent, *hashes[:-1]]) if o == rank for d in (kv, idx)}
        assert sorted(run["written_keys"]) == sorted(mine), (name, rank)  # exactly its own pages, KV + indexer
    for rank, run in enumerate(runs):
        assert len(run["written_keys"]) == 2 * run["counters"]["written_pages"] > 0, (name, rank)
        assert run["counters"]["write_failures"] == 0, (name, rank)
    keys = [set(r["written_keys"]) for r in runs]
    files = set(l3_ranks[0]["files"]["d4" if world == 4 else "d3"])
    assert files == {f"{k}.bin" for k in set().union(*keys)}
    # about 1/N of the pages per rank
    total = sum(r["counters"]["written_pages"] for r in runs)
    for r in runs:
        assert 0.5 / world < r["counters"]["written_pages"] / total < 1.5 / world, name
    assert all(r["surface"] == {k: True for k in r["surface"]} for r in runs)


@pytest.mark.parametrize("name", ["cp4_write", "cp4_to_cp2"])
def test_every_l3_read_and_write_runs_on_the_l3_io_threads(l3_ranks, name):
    for run in _runs(l3_ranks, name):
        threads = run["io_threads"]
        assert threads and run["scheduler_thread"] not in threads, threads
        assert all(t.startswith("cp-hicache-l3-rank") for t in threads), threads


# ---- cross-topology reads --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["cp4_to_cp2", "cp3_to_cp2"])
def test_cp2_restores_what_another_cp_size_wrote_bit_exact(l3_ranks, name):
    runs = _alike_runs(l3_ranks, name, world=2)
    for rank, run in enumerate(runs):
        c = run["counters"]
        assert c["restored_nodes"] > 0 and c["restored_pages"] > 0, (name, rank)
        assert run["l3_hit_tokens"] == 64 * c["restored_pages"], (name, rank)
        assert run["l3_pages_verified"] > 0, (name, rank)  # restored from L3 and checked on the device
        assert c["rejected_pages"] == 0, (name, rank)
    # the namespaces do not depend on the CP size
    assert runs[0]["namespaces"] == _runs(l3_ranks, "cp4_write")[0]["namespaces"]


# ---- faults ----------------------------------------------------------------------------


def test_damaged_objects_are_refused_and_every_rank_restores_the_same_shorter_prefix(l3_ranks):
    # (this run also aborts every third request right after its lookup was issued)
    runs, clean = _runs(l3_ranks, "damaged_read"), _runs(l3_ranks, "cp4_to_cp2")
    _alike(runs, "damaged")
    assert runs[0]["aborted_lookups"] == runs[1]["aborted_lookups"] > 0
    assert set(l3_ranks[0]["damaged"]) == {"deleted", "truncated", "flipped"}
    # Truncated / flipped objects are found and refused by a reader, or --
    # when a write of the same page comes first (a deleted page earlier in
    # the chain makes the reader compute and write the rest) -- found damaged
    # by that write and replaced.
    refused = sum(r["counters"]["rejected_pages"] for r in runs)
    repaired = sum(r["counters"]["repaired_pages"] for r in runs)
    assert refused + repaired >= 2, [r["counters"] for r in runs]
    assert sum(r["counters"]["restored_pages"] for r in runs) < sum(r["counters"]["restored_pages"] for r in clean)


def test_a_fetch_that_raises_on_one_rank_restores_nothing_anywhere_and_leaks_nothing(l3_ranks):
    runs = _alike_runs(l3_ranks, "fetch_raises", "fetch")
    for run in runs:
        c = run["counters"]
        assert c["prefetches"] > 0 and c["restored_nodes"] == 0 and c["restored_pages"] == 0
        assert run["l3_hit_tokens"] == 0
    assert runs[0]["counters"]["fetched_pages"] > 0  # rank 0 fetched its pages; the MIN said no


def test_a_put_that_fails_or_raises_on_one_rank_keeps_the_ranks_alike(l3_ranks):
    runs = _alike_runs(l3_ranks, "put_fails", "put")
    assert runs[1]["counters"]["written_pages"] == 0 and runs[1]["counters"]["write_failures"] > 0
    assert runs[0]["counters"]["written_pages"] > 0 and runs[0]["counters"]["write_failures"] == 0
    # a later read finds rank 0's pages only: a chain stops at its first page rank 1 owns
    later = _alike_runs(l3_ranks, "after_put_fails", "after put")
    assert all(r["counters"]["rejected_pages"] == 0 for r in later)


def test_another_models_objects_are_a_miss(l3_ranks):
    runs = _alike_runs(l3_ranks, "other_model", "other model")
    for run in runs:
        c = run["counters"]
        assert c["prefetches"] > 0 and c["restored_pages"] == 0 and c["rejected_pages"] == 0
    assert runs[0]["namespaces"] != _runs(l3_ranks, "cp4_to_cp2")[0]["namespaces"]


def test_an_unusable_l3_directory_stops_start_up_on_every_rank(l3_ranks):
    for message in _runs(l3_ranks, "unusable"):
        assert "SGLANG_CP_HICACHE_L3_DIR: L3 directory unusable" in message
        assert "a-file" in message and "is not a directory" in message


@pytest.mark.parametrize("name", ["stuck_query", "stuck_fetch"])
def test_a_read_that_blocks_on_one_rank_settles_alike_at_its_deadline_and_holds_up_nothing(l3_ranks, name):
    """Rank 1's first exists (a query) / get (a fetch) never returns while
    the run lasts: every rank settles that lookup within the deadline plus
    a step, every later lookup goes on (on a spare I/O thread) and restores
    pages, the ranks stay alike, nothing leaks, nothing is corrupted."""
    runs = _alike_runs(l3_ranks, name)
    assert runs[1]["counters"]["timeouts"] == 1 and runs[0]["counters"]["timeouts"] == 0
    for rank, run in enumerate(runs):
        steps, lookups = run["timing"]["steps"], run["timing"]["lookups"]
        assert lookups and max(lookups) < l3_scenarios.STUCK_DEADLINE_S + 2 * max(steps) + 0.5, (rank, run["timing"])
        assert run["counters"]["restored_pages"] > 0, rank  # later lookups went on


def test_k_requests_sharing_a_chain_do_one_lookup_and_one_fetch(l3_ranks):
    runs = _runs(l3_ranks, "joined")
    assert len(runs) == 2
    for rank, run in enumerate(runs):
        c = run["counters"]
        assert (c["prefetches"], c["joined_requests"], run["fetches"]) == (1, 3, 1), (rank, run)
        assert run["steps"] == 2  # the query's MIN, the fetch's
        assert run["spans"][0][0] > 0 and all(span[0] == 0 for span in run["spans"][1:])  # the asker's hit
        assert run["corrupted_pages"] == 0 and run["violations"] == [] and run["restored_pages_verified"] > 0
    assert runs[0]["spans"] == runs[1]["spans"]


# ---- the lifted refusal (SGLang's own resolution step) ------------------------------------


class _PastTheStorageCheck(Exception):
    """Raised where the step reads the model config, right after its storage check."""


def _record(backend: str, extra_config: Any = None) -> SimpleNamespace:
    """The fields handle_kv_cache_sharding reads up to its storage check, as a
    PD-prefill DSA server with --enable-kv-cache-sharding would have them."""
    return SimpleNamespace(
        enable_kv_cache_sharding=True, device="cpu", disaggregation_mode="prefill", speculative_algorithm=None,
        dllm_algorithm=None, radix_cache_backend=None, disable_radix_cache=False,
        enable_unified_cache_external_linker=False, enable_streaming_session=False,
        enable_session_radix_cache=False, enable_flexkv=False, enable_unified_memory=False, dcp_size=1,
        enable_hierarchical_cache=True, hicache_storage_backend=backend,
        hicache_storage_backend_extra_config=extra_config,
    )


@pytest.fixture
def resolution(monkeypatch):
    from sglang_cp_hicache.testing.cpu_0523 import ensure_sglang_importable

    ensure_sglang_importable()
    from sglang.srt.arg_groups import kv_shard_hook, resolution_hooks

    from sglang_cp_hicache.sglang_0523 import storage_lift, strategy

    def past(server_args: Any) -> Any:
        raise _PastTheStorageCheck()

    monkeypatch.setattr(kv_shard_hook, "model_config_of", past)
    monkeypatch.setattr(resolution_hooks, "_HOOKS", {})
    monkeypatch.setattr(storage_lift, "_registered", False)
    monkeypatch.setenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "python")
    monkeypatch.delenv("SGLANG_CP_HICACHE_L3_DIR", raising=False)
    yield SimpleNamespace(step=kv_shard_hook.handle_kv_cache_sharding, run=resolution_hooks.run_hook,
                          hooks=resolution_hooks, lift=storage_lift, strategy=strategy)
    strategy.uninstall_strategy()


REFUSAL = "supports HiCache host offload but not --hicache-storage-backend yet"


def test_upstream_refuses_storage_under_sharding_without_the_hook(resolution):
    with pytest.raises(ValueError, match=REFUSAL):
        resolution.run(resolution.step, _record("file"))


@pytest.mark.parametrize("copy_path,backend,lifted", [
    ("library", "file", True),
    ("library", "mooncake+master", True),  # served on the library's Mooncake page store, as on 0.5.18
    ("library", "mooncake", False),  # a Mooncake store without its master keeps upstream's refusal
    ("library", "hf3fs", False),  # a backend this adapter does not serve keeps upstream's refusal
    ("upstream", "file", False),  # upstream's copy path keeps upstream's refusal
    (None, "file", False),  # no strategy of this plugin (e.g. SGLANG_PLUGINS left it out)
])
def test_the_hook_lifts_the_refusal_only_for_the_library_stack(resolution, copy_path, backend, lifted):
    if copy_path is not None:
        resolution.strategy.install_strategy(copy_path)
    resolution.lift.register_storage_lift()
    extra = '{"master_server_address": "127.0.0.1:50051"}' if backend.endswith("+master") else None
    backend = backend.removesuffix("+master")
    record = _record(backend, extra)
    if lifted:
        with pytest.raises(_PastTheStorageCheck):
            resolution.run(resolution.step, record)
    else:
        with pytest.raises(ValueError, match=REFUSAL):
            resolution.run(resolution.step, record)
    from sglang.srt.arg_groups.model_override_base import resolving_view

    # every later step (and the published config) reads the flag as given
    assert resolving_view(record).hicache_storage_backend == backend
    assert record.hicache_storage_backend == backend


@pytest.mark.parametrize("copy_path,registered", [("library", True), ("upstream", False)])
def test_the_plugin_registers_the_lift_only_on_the_library_copy_path(resolution, monkeypatch, copy_path, registered):
    from sglang_cp_hicache.sglang_0523 import plugin

    monkeypatch.setenv("SGLANG_CP_HICACHE_COPY", copy_path)
    plugin.register()
    hooks = resolution.hooks._HOOKS.get(resolution.lift.STEP, [])
    assert (resolution.lift.lift_storage_refusal in hooks) is registered


# ---- the scheduler's storage calls -------------------------------------------------------------

#: Every storage-related name SGLang 0.5.23's scheduler reads on its tree
#: cache, and who serves it on the library stack.
SERVED = {
    # the library's driver, on the cache instance
    "prefetch_from_storage": "driver", "check_prefetch_progress": "driver",
    # upstream's methods over state the driver keeps in upstream's own fields
    "pop_prefetch_loaded_span": "upstream", "finish_storage_prefetch_admission": "upstream",
    "discard_storage_prefetch_accounting": "upstream", "storage_prefetch_retries": "upstream",
    "hicache_storage_pass_prefix_keys": "upstream", "get_prefix_hash_values": "upstream",
    "get_last_hash_value": "upstream", "is_backuped": "upstream", "is_root": "upstream",
    "waiting_storage_span": "upstream",  # buffer mode only (None in cache mode)
    "bind_prefetch_ticket": "upstream",  # pipeline parallelism only
    # the admin API: attach / detach are SGLang's own (refused under sharding by SGLang itself);
    # clear_hicache_storage clears the library's L3 (the driver)
    "attach_storage_backend": "admin", "detach_storage_backend": "admin", "clear_storage_backend": "driver",
}


def _scheduler_storage_names() -> set[str]:
    import sglang

    root = Path(sglang.__file__).parent / "srt" / "managers"
    names = set()
    for path in [root / "scheduler.py", root / "schedule_policy.py", *sorted((root / "scheduler_components").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Attribute, ast.Name)):
                owner = node.value.attr if isinstance(node.value, ast.Attribute) else node.value.id
                if owner == "tree_cache" and re.search(r"prefetch|storage|hash|backuped|is_root", node.attr):
                    names.add(node.attr)
    return names


def test_every_storage_call_of_the_scheduler_is_accounted_for():
    from sglang_cp_hicache.sglang_0523.l3_cache import L3Driver

    assert _scheduler_storage_names() == set(SERVED)
    assert {name for name, who in SERVED.items() if who == "driver"} <= set(L3Driver._REPLACED)


def test_an_aborted_request_reaches_the_driver_through_finish():
    from sglang_cp_hicache.testing.cpu_0523 import ensure_sglang_importable

    ensure_sglang_importable()
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache

    # the scheduler's _release_aborted_request calls finish(handle, ABORT),
    # which calls self.release_aborted_request: the instance's (the driver's)
    source = ast.unparse(ast.parse(__import__("inspect").getsource(BasePrefixCache.finish).strip()))
    assert "self.release_aborted_request(handle)" in source


# ---- the driver's step protocol, on stand-ins -------------------------------------------------


def _driver_on_stand_ins(seen: list):
    import torch

    from sglang_cp_hicache.l3.location import L3Location
    from sglang_cp_hicache.l3.prefetch import ChainPlan, L3Lookup, Stage
    from sglang_cp_hicache.l3.rank import RankL3
    from sglang_cp_hicache.placement import CpPlacement
    from sglang_cp_hicache.sglang_0523.l3_cache import L3Driver
    from sglang_cp_hicache.l3.host_tier import L3Counters

    cache = SimpleNamespace()

    def all_reduce(data, op):  # the group's MIN: another rank holds [4, 1, 9, 9]
        seen.append(data.clone())
        data.copy_(torch.minimum(data, torch.tensor([4, 1, 9, 9][: data.numel()], dtype=data.dtype)))

    def sync():
        counts = torch.tensor([7, 2], dtype=torch.int64)
        cache._all_reduce(counts, torch.distributed.ReduceOp.MIN)
        return counts.tolist()

    cache._all_reduce, cache._sync_hicache_ready_counts = all_reduce, sync
    for name in ("prefetch_from_storage", "check_prefetch_progress", "release_aborted_request",
                 "check_hicache_events", "_finish_write_through_ack", "reset", "clear_storage_backend"):
        setattr(cache, name, lambda *a, **k: seen.append(("upstream", a)))
    tier = SimpleNamespace(placement=CpPlacement(64, 2, 0), counters=L3Counters(), page_size=64)
    l3 = RankL3(tier, None, L3Location("/unused", False, "test"))
    driver = L3Driver(cache, l3, None)
    driver.install()

    def lookup(word):
        plan = ChainPlan(object(), None, (), ["0" * 64] * 9, [0] * 9)
        return L3Lookup(Stage.QUERY, plan, 9, None, word=word)

    return driver, cache, lookup


def test_the_lookup_words_ride_the_ready_ack_all_reduce():
    seen: list = []
    driver, cache, lookup = _driver_on_stand_ins(seen)
    driver.prefetcher.pending = [lookup(3), lookup(8)]
    assert cache._sync_hicache_ready_counts() == [4, 1]  # upstream's own words, reduced as before
    assert len(seen) == 1 and seen[0].tolist() == [7, 2, 3, 8]  # one all-reduce, two more words
    assert driver._riding.agreed == [3, 8]
    # no pending lookup: upstream's tensor, untouched
    seen.clear()
    driver.prefetcher.pending = []
    assert cache._sync_hicache_ready_counts() == [4, 1] and seen[0].tolist() == [7, 2]


def test_a_reset_drops_the_pending_lookups():
    seen: list = []
    driver, cache, lookup = _driver_on_stand_ins(seen)
    driver.prefetcher.pending = [lookup(1)]
    cache.reset()
    assert driver.pending == [] and ("upstream", ()) in seen


#: DeepSeek-V3.2's namespace digests (KV, indexer) per host layout: what both
#: releases' stored pages are filed under. A change orphans every stored page.
DSV32_DIGESTS = {"layer_first": ["9975222420546907", "e3a99c343a50909d"],
                 "page_first": ["07ce26c19b97421a", "e3a99c343a50909d"]}


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_an_identically_configured_0518_deployment_has_the_same_namespaces(layout, tmp_path, monkeypatch):
    """Same model, dtype, row format, page size, layers and host layout: the
    0.5.23 binding opens the wing's one tier class, whose namespaces are the
    pools' (the rule the 0.5.18 binding feeds too), and both key pages by
    SGLang's page hash, so either reads what the other wrote."""
    import torch

    from sglang_cp_hicache.testing.cpu_0523 import ensure_sglang_importable

    ensure_sglang_importable()
    from sglang.srt.mem_cache.utils import get_hash_str

    from sglang_cp_hicache.l3.host_tier import HostL3Tier, namespaces
    from sglang_cp_hicache.l3.identity import ModelIdentity
    from sglang_cp_hicache.l3.location import l3_location
    from sglang_cp_hicache.l3.opening import open_l3
    from sglang_cp_hicache.sglang_0523.l3_cache import l3_binding

    kv = SimpleNamespace(page_size=64, kv_buffer=torch.empty(0, dtype=torch.float8_e4m3fn), kv_cache_dim=656,
                         layer_num=61, layout=layout)
    indexer = SimpleNamespace(index_k_with_scale_buffer=torch.empty(0, dtype=torch.uint8),
                              indexer_page_stride_size=132 * 64, layer_num=61)
    assert [ns.digest() for ns in namespaces("deepseek-ai/DeepSeek-V3.2", kv, indexer, 0)] == DSV32_DIGESTS[layout]
    group = _rank1_group(0, monkeypatch)
    group.anchor_entry.host_pool.kv = kv
    group.entry_map[next(iter(group.entry_map))].host_pool = indexer
    location = l3_location("file", {"file_storage_path": str(tmp_path)})
    identity = ModelIdentity("name:deepseek-ai/DeepSeek-V3.2")
    opening = open_l3(location, "test", lambda: l3_binding(group, None, 0), identity=identity)
    assert opening.error is None and type(opening.tier) is HostL3Tier and opening.tier.page_hasher is get_hash_str
    assert [opening.tier.kv_ns.digest(), opening.tier.indexer_ns.digest()] == [
        ns.digest() for ns in namespaces(identity.text(), kv, indexer, 0)]


def test_file_and_mooncake_are_served_and_any_other_store_is_refused_naming_the_flag():
    from sglang_cp_hicache.testing.cpu_0523 import ensure_sglang_importable

    ensure_sglang_importable()
    from sglang_cp_hicache.l3.location import l3_location
    from sglang_cp_hicache.l3.opening import SERVED_BACKENDS, check_served, served

    assert SERVED_BACKENDS == ("file", "mooncake")
    assert served(l3_location("file", {"file_storage_path": "/x"}))
    mooncake = l3_location("mooncake", '{"master_server_address": "127.0.0.1:50051"}')
    assert served(mooncake)
    check_served(mooncake, "0.5.23")
    other = SimpleNamespace(directory=None, scheduler_driven=True, source="extra config", backend="hf3fs")
    assert not served(other)
    with pytest.raises(ValueError, match="--hicache-storage-backend 'hf3fs' is not served by sglang-cp-hicache's "
                                         "SGLang 0.5.23 adapter"):
        check_served(other, "0.5.23")
    # the strategy resolves the location first: a Mooncake store without its master stops start-up there
    with pytest.raises(ValueError, match="--hicache-storage-backend mooncake .*master_server_address"):
        l3_location("mooncake", "{}")


# ---- Mooncake wiring: open_l3 on stand-in host pools (a file store stands in for Mooncake) ----

P64 = 64


def _tiny_identity() -> Any:
    from sglang_cp_hicache.l3.identity import ModelIdentity

    return ModelIdentity("name:tiny/dsa")


TINY = _tiny_identity()


class _KvHost:
    """A layer_first MLA host pool of 4 local pages (what open_l3 reads)."""

    def __init__(self, fill: int) -> None:
        import torch

        self.kv_buffer = torch.full((2, 4 * P64, 8), fill, dtype=torch.uint8)
        self.kv_cache_dim, self.layer_num, self.layout, self.page_size = 8, 2, "layer_first", P64

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        page = self.kv_buffer[:, index:index + P64]
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index: int, data: Any) -> None:
        self.kv_buffer[:, index:index + P64] = data.reshape(2, P64, 8)


class _IndexerHost:
    def __init__(self, fill: int) -> None:
        import torch

        self.index_k_with_scale_buffer = torch.full((2, 4, P64 * 2), fill, dtype=torch.uint8)
        self.indexer_page_stride_size, self.layer_num, self.page_size = P64 * 2, 2, P64

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        page = self.index_k_with_scale_buffer[:, index // P64]
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index: int, data: Any) -> None:
        self.index_k_with_scale_buffer[:, index // P64] = data.reshape(2, P64 * 2)


def _rank1_group(fill: int, monkeypatch, *, distinct_rows: bool = False) -> SimpleNamespace:
    """Rank 1 of CP 2's host pool group, as open_l3 reads it (``distinct_rows``:
    local KV page ``r`` filled with ``fill + 1 + r``, else all ``fill``)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from sglang_cp_hicache.sglang_0523 import l3_cache

    kv = _KvHost(fill)
    for row in range(4 if distinct_rows else 0):
        kv.kv_buffer[:, row * P64:(row + 1) * P64] = fill + 1 + row
    anchor = SimpleNamespace(page_size=P64, shard_size=2, shard_rank=1, kv=kv)
    monkeypatch.setattr(l3_cache, "kv_host_pool_of", lambda host_pool: host_pool.kv)
    indexer = SimpleNamespace(host_pool=_IndexerHost(fill))
    return SimpleNamespace(anchor_entry=SimpleNamespace(host_pool=anchor), entry_map={PoolName.INDEXER: indexer})


@pytest.fixture
def mooncake_0523(tmp_path, monkeypatch):
    """open_page_store of the 0.5.23 tier replaced by a file store (no Mooncake
    runs here, and .venv-0523 has no client); records what it was asked."""
    from sglang_cp_hicache.testing.cpu_0523 import ensure_sglang_importable

    ensure_sglang_importable()
    from sglang_cp_hicache.l3.location import l3_location
    from sglang_cp_hicache.l3.store import FilePageStore
    from sglang_cp_hicache import l3_backends

    opened: list = []

    def fake_open(backend, directory, extra_config=None, *, mooncake_rules=None):
        opened.append((backend, directory, dict(extra_config or {})))
        return FilePageStore(tmp_path / "mooncake")

    monkeypatch.setattr(l3_backends, "open_page_store", fake_open)
    location = l3_location("mooncake", '{"master_server_address": "127.0.0.1:50051"}')
    return SimpleNamespace(location=location, opened=opened, l3_backends=l3_backends)


def _open_l3_0523(location, group, identity):
    """The strategy's opening of one rank's L3 on ``group``."""
    from sglang_cp_hicache.l3.opening import open_l3
    from sglang_cp_hicache.sglang_0523.l3_cache import l3_binding, source_text

    return open_l3(location, source_text(location), lambda: l3_binding(group, None, 0), identity=identity)


def test_mooncake_opens_the_library_page_store_and_reads_back_bit_exact_at_local_rows(mooncake_0523, monkeypatch):
    import torch

    from tests.l3.common import read_chain, write_chain

    m = mooncake_0523
    writer = _open_l3_0523(m.location, _rank1_group(0, monkeypatch, distinct_rows=True), TINY)
    assert writer.error is None and writer.tier is not None and writer.view == writer.tier.describe()
    assert m.opened == [("mooncake", None, {"master_server_address": "127.0.0.1:50051"})]
    hashes = [f"{i:064x}" for i in (7, 8, 9)]
    owners = [1, 0, 1]
    # logical slots P and 3P are rank 1's local rows 0 and P
    assert write_chain(writer.tier, hashes, owners, [P64, 3 * P64]) == 2
    reader = _open_l3_0523(m.location, _rank1_group(0xEE, monkeypatch), TINY)
    # logical slots 5P and 7P: rank 1's local rows 2P and 3P
    assert read_chain(reader.tier, hashes, owners, [5 * P64, 7 * P64]) == 3
    kv_host = writer.tier.kv_host
    filled = reader.tier.kv_host.kv_buffer
    assert torch.equal(filled[:, 2 * P64:4 * P64], kv_host.kv_buffer[:, 0:2 * P64])
    assert bool((filled[:, :2 * P64] == 0xEE).all()) and bool((filled[:, 4 * P64:] == 0xEE).all())
    assert reader.tier.counters.rejected_pages == 0


@pytest.mark.parametrize("error,message", [
    (ValueError("bad protocol"), "--hicache-storage-backend mooncake (settings from "
     "hicache_storage_backend_extra_config): L3 mooncake store unusable: bad protocol"),
    (ImportError("no module named mooncake"), "no module named mooncake"),
    (RuntimeError("setup failed"), "setup failed"),
])
def test_an_unusable_mooncake_store_is_this_ranks_view_not_a_crash(mooncake_0523, monkeypatch, error, message):
    """Raised only after the start-up agreement, so no rank waits alone."""
    def refuse(backend, directory, extra_config=None, *, mooncake_rules=None):
        raise error

    monkeypatch.setattr(mooncake_0523.l3_backends, "open_page_store", refuse)
    opening = _open_l3_0523(mooncake_0523.location, _rank1_group(0, monkeypatch), TINY)
    assert opening.tier is None and opening.view == f"unusable: {message}" and str(opening.error) == message
