"""L3 through SGLang 0.5.18's own Scheduler code, threaded ranks on gloo.

``--hicache-storage-backend file`` on a CP cache: the real, unbound
``Scheduler._prefetch_kvcache`` runs on real ``Req`` objects of every rank,
and each step runs the waiting-queue slice of ``get_new_batch_prefill``
(``check_hicache_events``, then per request ``check_prefetch_progress`` /
``pop_prefetch_loaded_tokens`` / ``init_next_round_input``; pinned against
the installed source below). CP 4 writes, CP 2 reads bit-exact; aborts in
either protocol stage leak nothing on any rank, even when one rank alone
saw the abort; requests with one prefix wait on one prefetch.
"""

from __future__ import annotations

import inspect
import json
import logging
import threading
import time
from array import array
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang_cp_hicache import settings
from sglang_cp_hicache.testing.stack_0518 import CpStackConfig, build_cp_rank_stack

from tests.helpers.cp_cluster import CpCluster
from tests.helpers.rank_snapshot import rank_state, shared_view
from tests.helpers.scheduler_import import scheduler_class

# The scheduler module imports a web stack the CPU harness does not install
# (import-only stand-ins, tests/helpers/scheduler_import.py).
Scheduler = scheduler_class()

from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

P = 64
PAGES = 5
TOKENS = list(range(1000, 1000 + PAGES * P))
# The scheduler's keys hold array('q'), and so do the nodes restored for them.
AS_SERVED = array("q", TOKENS)


@pytest.fixture(autouse=True)
def _only_the_flag(monkeypatch):
    """The directory comes from the flag's extra config alone."""
    monkeypatch.delenv(settings.L3_DIR.name, raising=False)
    monkeypatch.delenv(settings.SGLANG_FILE_DIR.name, raising=False)


def config(n: int, directory: Path, backend: str = "file") -> CpStackConfig:
    return CpStackConfig(
        cp_size=n, device_pages=8, host_pages=10, storage_backend=backend,
        storage_extra_config=json.dumps({"file_storage_path": str(directory)}),
    )


def cluster(n: int, directory: Path) -> CpCluster:
    return CpCluster(config(n, directory), threaded=True, timeout_s=30)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A directory CP 4 wrote through the flag (write-through, then L3)."""
    directory = tmp_path_factory.mktemp("l3")
    mp = pytest.MonkeyPatch()
    mp.delenv(settings.L3_DIR.name, raising=False)
    mp.delenv(settings.SGLANG_FILE_DIR.name, raising=False)
    try:
        cl = cluster(4, directory)
        try:
            cl.insert(TOKENS)
            cl.step()
            assert all(cl.each(lambda s: s.cache.l3_wait_io(timeout=10)))  # writes: the L3 worker thread
            assert sum(c.cp_l3.counters.written_pages for c in cl.caches) == PAGES
        finally:
            cl.close()
    finally:
        mp.undo()
    assert len(list(directory.rglob("*.bin"))) == 2 * PAGES
    return directory


# ---- the scheduler's calls -----------------------------------------------------------


def request(rid: str, tokens=TOKENS) -> Req:
    # One token past the pages: the scheduler matches at most input_len - 1.
    return Req(rid, "", array("q", [*tokens, 7]), SamplingParams(max_new_tokens=1))


def scheduler(stack) -> SimpleNamespace:
    """What ``_prefetch_kvcache`` reads of its scheduler."""
    return SimpleNamespace(enable_hicache_storage=True, tree_cache=stack.cache)


def arrive(cl: CpCluster, rids: list[str], tokens=TOKENS) -> list[dict]:
    """Each rank's scheduler takes the requests in (SGLang's own code)."""
    def run(s):
        reqs = {rid: request(rid, tokens) for rid in rids}
        for req in reqs.values():
            Scheduler._prefetch_kvcache(scheduler(s), req)
        return reqs
    return cl.each(run)


def waiting_pass(cl: CpCluster, queues: list[dict], *, wait_io: bool = True) -> list[list[str]]:
    """One step of ``get_new_batch_prefill``'s waiting-queue slice on every
    rank; returns the requests each rank would stage. ``wait_io``: first let
    each rank's L3 reads (worker thread) finish, so its words are ready."""
    def run(s):
        cache, queue = s.cache, queues[s.cp_rank]
        if wait_io:
            assert cache.l3_wait_io(timeout=10)
        cache.check_hicache_events()
        staged = []
        for req in queue.values():
            if not cache.check_prefetch_progress(req.rid):
                continue
            loaded = cache.pop_prefetch_loaded_tokens(req.rid)
            if loaded > 0:
                req.storage_hit_length = loaded
            req.init_next_round_input(cache)
            staged.append(req.rid)
        return staged
    return cl.each(run)


def test_the_waiting_queue_slice_is_the_installed_schedulers():
    source = inspect.getsource(Scheduler._get_new_batch_prefill_raw)
    steps = [
        "self.tree_cache.check_hicache_events()",
        "prefetch_done = self.tree_cache.check_prefetch_progress(req.rid)",
        "loaded_tokens = self.tree_cache.pop_prefetch_loaded_tokens(req.rid)",
        "req.storage_hit_length = loaded_tokens",
        "req.init_next_round_input(self.tree_cache)",
    ]
    positions = [source.index(step) for step in steps]
    assert positions == sorted(positions)
    assert "self.enable_hicache_storage = server_args.hicache_storage_backend is not None" in inspect.getsource(
        Scheduler.__init__
    ) or "hicache_storage_backend is not None" in inspect.getsource(Scheduler)


def assert_alike(cl: CpCluster) -> None:
    views = [shared_view(rank_state(s)) for s in cl.stacks]
    assert all(v == views[0] for v in views[1:])
    for s in cl.stacks:
        host = s.cache.cache_controller.mem_pool_host
        assert s.cache.host_slot_ledger.used[s.cp_rank] == host.size - host.available_size()


def assert_nothing_held(cl: CpCluster) -> None:
    for c in cl.caches:
        assert not c.cp_l3.prefetcher.pending and not c.cp_l3.prefetcher.waiting
        assert not c.prefetch_loaded_tokens_by_reqid
        assert c.root_node.host_ref_counter == 0
        host = c.cache_controller.mem_pool_host
        assert host.available_size() == host.size
        assert c.host_slot_ledger.used == [0] * cl.config.cp_size
    assert_alike(cl)


# ---- reads ---------------------------------------------------------------------------


def count_matches(cl: CpCluster) -> list[int]:
    """Each rank's ``match_prefix`` calls from now on (appended as they run)."""
    calls: list[int] = []

    def wrap(s):
        real = s.cache.match_prefix
        s.cache.match_prefix = lambda params: calls.append(s.cp_rank) or real(params)
    cl.each(wrap)
    return calls


def test_cp4_writes_cp2_reads_bit_exact_through_the_scheduler(written):
    with cluster(2, written) as cl:
        assert all(c.cp_l3 is not None and c.enable_storage is False for c in cl.caches)
        matches = count_matches(cl)
        queues = arrive(cl, ["a"])
        assert all(c.cp_l3.prefetcher.waiting.keys() == {"a"} for c in cl.caches)
        assert sorted(matches) == [0, 1]  # the lookup serves from the scheduler's own match
        assert waiting_pass(cl, queues) == [[], []]  # the query's MIN: still waiting
        assert waiting_pass(cl, queues) == [["a"], ["a"]]  # the fetch's MIN: restored
        for q in queues:
            req = q["a"]
            assert req.storage_hit_length == PAGES * P
            assert req.host_hit_length == PAGES * P and len(req.prefix_indices) == 0
        assert cl.each(lambda s: s.cache.pop_prefetch_loaded_tokens("a")) == [0, 0]  # popped once
        cl.load_back(AS_SERVED)
        assert [int(t.numel()) for t in cl.device_locs(AS_SERVED)] == [PAGES * P] * 2
        assert cl.check(AS_SERVED) == {}  # every token's KV and indexer bytes, on every rank
        assert sum(c.cp_l3.counters.restored_pages for c in cl.caches) == PAGES
        assert_alike(cl)


def test_a_lookup_that_is_not_the_last_matched_requests_is_skipped(tmp_path):
    """The lookup serves from the match the scheduler ran just before; tokens
    or a node that are not that match's start nothing (on every rank)."""
    with cluster(2, tmp_path) as cl:
        other = list(range(5000, 5000 + 3 * P))

        def run(s):
            cache = s.cache
            Scheduler._prefetch_kvcache(scheduler(s), request("a"))  # matched TOKENS: nothing cached
            cache.prefetch_from_storage("b", cache.root_node, array("q", other), None, None)
            cache.prefetch_from_storage("c", cache.root_node, array("q", TOKENS[P:]), None, None)
            return set(cache.cp_l3.prefetcher.waiting)
        assert cl.each(run) == [{"a"}, {"a"}]


def test_a_miss_releases_the_request_after_the_query(tmp_path):
    with cluster(2, tmp_path) as cl:
        queues = arrive(cl, ["m"], tokens=list(range(5000, 5000 + 3 * P)))
        assert waiting_pass(cl, queues) == [["m"], ["m"]]
        assert all(q["m"].storage_hit_length == 0 for q in queues)
        assert_nothing_held(cl)


def test_requests_with_one_prefix_wait_on_one_prefetch(written):
    with cluster(2, written) as cl:
        queues = arrive(cl, ["a", "b"])
        assert all(len(c.cp_l3.prefetcher.pending) == 1 for c in cl.caches)
        assert all(c.cp_l3.counters.joined_requests == 1 for c in cl.caches)
        assert waiting_pass(cl, queues) == [[], []]
        assert waiting_pass(cl, queues) == [["a", "b"], ["a", "b"]]
        for q in queues:  # the asker counts the storage hit; both find the pages on host
            assert (q["a"].storage_hit_length, q["b"].storage_hit_length) == (PAGES * P, 0)
            assert q["b"].host_hit_length == PAGES * P
        arrive(cl, ["a"])  # arriving again (a retraction): nothing new to fetch
        assert all(not c.cp_l3.prefetcher.pending for c in cl.caches)
        assert_alike(cl)


# ---- aborts ----------------------------------------------------------------------------


@pytest.mark.parametrize("passes_before", [0, 1])  # during the query, during the fetch
@pytest.mark.parametrize("seen_by", ["every rank", "rank 1 only"])
def test_an_aborted_prefetch_is_dropped_alike_and_leaks_nothing(written, passes_before, seen_by):
    with cluster(2, written) as cl:
        queues = arrive(cl, ["x"])
        for _ in range(passes_before):
            assert waiting_pass(cl, queues) == [[], []]
        if passes_before:  # the fetch holds host slots and a ledger charge now
            assert all(sum(c.host_slot_ledger.used) == PAGES * P for c in cl.caches)
        ranks = [0, 1] if seen_by == "every rank" else [1]
        cl.each(lambda s: s.cache.release_aborted_request("x") if s.cp_rank in ranks else None)
        for q, rank in zip(queues, range(2)):
            if rank in ranks:
                q.pop("x")
        staged = waiting_pass(cl, queues)  # the MIN drops it on every rank
        assert staged == [[] if r in ranks else ["x"] for r in range(2)]
        for q in queues:
            if "x" in q:
                assert q["x"].storage_hit_length == 0 and q["x"].host_hit_length == 0
        cl.each(lambda s: s.cache.release_aborted_request("x"))  # the late rank's abort
        assert_nothing_held(cl)
        assert all(not c.root_node.children for c in cl.caches)
        # Nothing left behind blocks the chain: a new request restores it bit-exact.
        queues = arrive(cl, ["y"])
        waiting_pass(cl, queues)
        assert waiting_pass(cl, queues) == [["y"], ["y"]]
        cl.load_back(AS_SERVED)
        assert cl.check(AS_SERVED) == {}
        assert_alike(cl)


# ---- I/O off the scheduler thread -------------------------------------------------------


def test_l3_reads_run_on_the_worker_thread_not_the_scheduler_thread(written):
    with cluster(2, written) as cl:
        seen: list[tuple[str, str]] = []
        for c in cl.caches:
            store = c.cp_l3.tier.store
            for method in ("exists", "open_object"):
                real = getattr(store, method)

                def recorded(keys, *args, _real=real, _method=method):
                    seen.append((_method, threading.current_thread().name))
                    return _real(keys, *args)
                setattr(store, method, recorded)
        callers = set(cl.each(lambda s: threading.current_thread().name))
        queues = arrive(cl, ["a"])
        waiting_pass(cl, queues)
        assert waiting_pass(cl, queues) == [["a"], ["a"]]
        assert {m for m, _ in seen} == {"exists", "open_object"}
        assert all(name.startswith("cp-hicache-l3-rank") and name not in callers for _, name in seen)
        assert all("-read-" in name for m, name in seen if m == "exists")


@pytest.mark.parametrize("method", ["exists", "open_object"])  # the query's I/O, the fetch's
def test_slow_io_on_one_rank_keeps_every_rank_waiting_alike(written, method):
    """Rank 1's store blocks: the step's MIN is NOT_READY on every rank, so
    both keep the prefetch and hold the request, step after step; once the
    I/O returns, both settle in the same step, bit-exact."""
    cl = cluster(2, written)
    release = threading.Event()
    try:
        store = cl.caches[1].cp_l3.tier.store
        real = getattr(store, method)

        def slow(keys, *args):
            assert release.wait(20)
            return real(keys, *args)
        setattr(store, method, slow)
        queues = arrive(cl, ["a"])
        if method == "open_object":  # the query is not slowed: let it settle first
            assert waiting_pass(cl, queues) == [[], []]
        stage = "query" if method == "exists" else "fetch"
        assert cl.caches[0].l3_wait_io(timeout=10)  # rank 0 is ready; rank 1 is not
        for _ in range(3):
            assert waiting_pass(cl, queues, wait_io=False) == [[], []]
            assert [[p.stage for p in c.cp_l3.prefetcher.pending] for c in cl.caches] == [[stage], [stage]]
            assert all(not c.root_node.children for c in cl.caches)
        release.set()
        if method == "exists":
            assert waiting_pass(cl, queues) == [[], []]  # the query settled; the fetch follows
        assert waiting_pass(cl, queues) == [["a"], ["a"]]
        assert all(q["a"].storage_hit_length == PAGES * P for q in queues)
        cl.load_back(AS_SERVED)
        assert cl.check(AS_SERVED) == {}
        assert_alike(cl)
    finally:
        release.set()
        cl.close()


def test_an_abort_while_one_ranks_fetch_still_runs_settles_at_the_next_min_and_the_fetch_writes_nothing(written):
    """An aborted lookup answers 0 at once, whatever its I/O is doing: every
    rank settles it at the next MIN and gives its host slots back, while
    rank 1's fetch is still blocked in the store. That fetch is cancelled:
    when its read returns it writes nothing into the (freed) host slots."""
    cl = cluster(2, written)
    release = threading.Event()
    try:
        store = cl.caches[1].cp_l3.tier.store
        real = store.open_object
        store.open_object = lambda *args: (release.wait(20), real(*args))[1]
        queues = arrive(cl, ["x"])
        assert waiting_pass(cl, queues) == [[], []]  # the fetch runs now
        jobs = cl.caches[1].cp_l3.prefetcher.pending[0].jobs
        host = cl.caches[1].cache_controller.mem_pool_host
        before = host.kv_buffer.clone()
        cl.each(lambda s: s.cache.release_aborted_request("x"))
        for q in queues:
            q.pop("x")
        waiting_pass(cl, queues, wait_io=False)
        assert not all(job.done() for job in jobs)  # rank 1's reads are still blocked ...
        assert_nothing_held(cl)  # ... and yet every rank gave everything back
        assert all(not c.root_node.children for c in cl.caches)
        release.set()
        assert all(job.wait(10) for job in jobs)
        assert torch.equal(host.kv_buffer, before)  # the cancelled fetch wrote nothing
    finally:
        release.set()
        cl.close()


@pytest.mark.parametrize("namespace", ["extra_key", "cache_salt"])
def test_a_lora_or_salted_request_never_looks_up_the_plain_chain(written, namespace):
    """A request with an extra key (a LoRA adapter) or a cache salt matches
    nothing (its namespace is empty) and is anchored at the root, like a
    plain request; it must not look up, fetch or insert the plain chain --
    though L3 holds it -- nor report it as its storage hit."""
    with cluster(2, written) as cl:
        def run(s):
            req = request("lora")
            setattr(req, namespace, "adapter-7")
            Scheduler._prefetch_kvcache(scheduler(s), req)
            return {"lora": req}
        queues = cl.each(run)
        assert all(c.cp_l3.counters.prefetches == 0 for c in cl.caches)
        assert waiting_pass(cl, queues) == [["lora"], ["lora"]]
        assert all(q["lora"].storage_hit_length == 0 and q["lora"].host_hit_length == 0 for q in queues)
        assert all(not c.root_node.children for c in cl.caches)
        # the same tokens without the namespace do look L3 up
        queues = arrive(cl, ["plain"])
        assert all(c.cp_l3.counters.prefetches == 1 for c in cl.caches)
        waiting_pass(cl, queues)
        assert waiting_pass(cl, queues) == [["plain"], ["plain"]]


def test_a_chain_that_one_rank_cannot_hash_is_a_miss_on_every_rank_not_a_missing_lookup(written):
    """SGLang's page hasher is a native extension compiled on first use; if
    it fails on one rank, that rank must still have the lookup (the count of
    words in the step's MIN must match on every rank) and answer 0."""
    with cluster(2, written) as cl:
        tier = cl.caches[1].cp_l3.tier
        real = tier.page_hasher

        def fails_once(*args, **kwargs):
            tier.page_hasher = real
            raise RuntimeError("Failed to load HiCache native hash extension (injected)")
        tier.page_hasher = fails_once
        queues = arrive(cl, ["a"])
        assert [c.cp_l3.counters.prefetches for c in cl.caches] == [1, 1]
        assert waiting_pass(cl, queues) == [["a"], ["a"]]  # the MIN: a miss everywhere, in one step
        assert all(q["a"].storage_hit_length == 0 for q in queues)
        assert_nothing_held(cl)
        queues = arrive(cl, ["b"])  # the next lookup hashes fine and restores
        waiting_pass(cl, queues)
        assert waiting_pass(cl, queues) == [["b"], ["b"]]
        assert all(q["b"].storage_hit_length == PAGES * P for q in queues)


def _deadline_config(n: int, directory: Path, deadline_s: float) -> CpStackConfig:
    extra = {"file_storage_path": str(directory), "prefetch_timeout_base": deadline_s,
             "prefetch_timeout_per_ki_token": 0.0, "prefetch_timeout_max": deadline_s}
    return CpStackConfig(cp_size=n, device_pages=8, host_pages=10, storage_backend="file",
                         storage_extra_config=json.dumps(extra))


OTHER = list(range(60_000, 60_000 + 3 * P))  # a second chain, written beside TOKENS
OTHER_SERVED = array("q", OTHER)


@pytest.mark.parametrize("method", ["exists", "open_object"])  # the query's I/O, the fetch's
def test_a_read_that_blocks_forever_on_one_rank_settles_at_its_deadline_and_holds_up_nothing(
    tmp_path, method
):
    """Rank 1's store call for one chain never returns. Every rank settles
    that lookup in the step after its deadline (rank 1 answers "miss from
    here"), nothing it held stays held, and the next request's lookup -- on
    a spare I/O thread -- restores its chain bit-exact."""
    deadline = 1.0
    writer = CpCluster(_deadline_config(2, tmp_path, deadline), threaded=True, timeout_s=30)
    try:
        for tokens in (TOKENS, OTHER):
            writer.insert(tokens)
            writer.step()
        assert all(writer.each(lambda s: s.cache.l3_wait_io(timeout=10)))
    finally:
        writer.close()
    cl = CpCluster(_deadline_config(2, tmp_path, deadline), threaded=True, timeout_s=30)
    never = threading.Event()
    try:
        store = cl.caches[1].cp_l3.tier.store
        real = getattr(store, method)
        stuck_keys = set(cl.caches[1].cp_l3.tier.page_hashes(TOKENS))

        def hangs(keys, *args):
            if any(k.split("_")[0] in stuck_keys for k in ([keys] if isinstance(keys, str) else keys)):
                never.wait()  # until the test ends: a read that never returns
            return real(keys, *args)
        setattr(store, method, hangs)
        queues = arrive(cl, ["a"])
        if method == "open_object":  # the query is not held: it settles first
            assert waiting_pass(cl, queues) == [[], []]
        start = time.monotonic()
        staged = waiting_pass(cl, queues)  # waits for each rank's word: done, or past the deadline
        took = time.monotonic() - start
        assert staged == [["a"], ["a"]] and took < deadline + 10.0, took  # the deadline, not the blocked read
        assert all(q["a"].storage_hit_length == 0 for q in queues)
        assert cl.caches[1].cp_l3.counters.timeouts == 1 and cl.caches[0].cp_l3.counters.timeouts == 0
        assert_nothing_held(cl)
        # The held thread is replaced: another chain's lookup goes on.
        later = {r: {"b": request("b", OTHER)} for r in range(2)}
        cl.each(lambda s: Scheduler._prefetch_kvcache(scheduler(s), later[s.cp_rank]["b"]))
        assert waiting_pass(cl, later) == [[], []]
        assert waiting_pass(cl, later) == [["b"], ["b"]]
        assert all(q["b"].storage_hit_length == len(OTHER) for q in later.values())
        cl.load_back(OTHER_SERVED)
        assert cl.check(OTHER_SERVED) == {}
        assert_alike(cl)
    finally:
        never.set()
        cl.close()


# ---- start-up and runtime storage control ------------------------------------------------


def test_the_flag_logs_one_line_per_rank_and_builds_no_sglang_storage(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="sglang_cp_hicache.sglang_0518.l3_cache"):
        cl = cluster(2, tmp_path)
    try:
        lines = [r.getMessage() for r in caplog.records if "cp-hicache L3 on cp_rank" in r.getMessage()]
        assert len(lines) == 2 and all(str(tmp_path) in line and "file_storage_path" in line for line in lines)
        assert all("scheduler prefetch on" in line and "kv:" in line for line in lines)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        for c in cl.caches:
            assert c.enable_storage is False and getattr(c.cache_controller, "storage_backend", None) is None
    finally:
        cl.close()


def test_the_setting_alone_warns_that_the_scheduler_will_not_prefetch(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(settings.L3_DIR.name, str(tmp_path))
    with caplog.at_level(logging.INFO, logger="sglang_cp_hicache.sglang_0518.l3_cache"):
        cl = CpCluster(CpStackConfig(cp_size=2, device_pages=8, host_pages=10), threaded=True, timeout_s=30)
    try:
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 2 and all("--hicache-storage-backend file" in w for w in warnings)
    finally:
        cl.close()


@pytest.mark.parametrize("backend", ["hf3fs", "nixl", "aibrix"])
def test_another_backend_is_refused_naming_the_flag(tmp_path, backend):
    with pytest.raises(ValueError, match=f"hicache_storage_backend='{backend}'.*--hicache-storage-backend"):
        build_cp_rank_stack(config(1, tmp_path, backend=backend), 0)


def test_mooncake_is_served_through_the_library_page_store(written, monkeypatch, caplog):
    """``--hicache-storage-backend mooncake``: the cache opens the library's
    Mooncake page store with the extra config (here replaced by a file store
    on the CP 4 directory, since no Mooncake runs here) and the scheduler's
    calls read through it bit-exact; without a master it stops start-up."""
    from sglang_cp_hicache.l3.store import FilePageStore
    from sglang_cp_hicache import l3_backends

    opened = []

    def fake_open(backend, directory, extra_config=None, *, mooncake_rules=None):
        opened.append((backend, directory, dict(extra_config or {})))
        return FilePageStore(written)

    monkeypatch.setattr(l3_backends, "open_page_store", fake_open)
    extra = json.dumps({"master_server_address": "127.0.0.1:50051"})
    mooncake = CpStackConfig(cp_size=2, device_pages=8, host_pages=10, storage_backend="mooncake",
                             storage_extra_config=extra)
    with caplog.at_level(logging.INFO, logger="sglang_cp_hicache.sglang_0518.l3_cache"):
        cl = CpCluster(mooncake, threaded=True, timeout_s=30)
    try:
        assert opened == [("mooncake", None, {"master_server_address": "127.0.0.1:50051"})] * 2
        assert sum("mooncake store" in r.getMessage() for r in caplog.records) == 2
        queues = arrive(cl, ["a"])
        waiting_pass(cl, queues)
        assert waiting_pass(cl, queues) == [["a"], ["a"]]
        cl.load_back(AS_SERVED)
        assert cl.check(AS_SERVED) == {}
    finally:
        cl.close()
    with pytest.raises(ValueError, match="master_server_address"):
        build_cp_rank_stack(CpStackConfig(cp_size=1, storage_backend="mooncake", storage_extra_config="{}"), 0)


def test_an_unusable_directory_from_the_flag_names_it(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ValueError, match="file_storage_path.*L3 directory unusable"):
        build_cp_rank_stack(config(1, not_a_dir), 0)


def test_runtime_attach_and_detach_are_refused(tmp_path):
    stack = build_cp_rank_stack(config(1, tmp_path), 0)
    try:
        ok, msg = stack.cache.attach_storage_backend("file")
        assert not ok and "not supported" in msg
        ok, msg = stack.cache.detach_storage_backend()
        assert not ok and "not supported" in msg
        assert stack.cache.cp_l3 is not None
    finally:
        stack.close()
