"""L3 of the 0.5.18 CP cache, real SGLang stacks, threaded ranks on gloo.

* CP 4 writes a directory; CP 2 and CP 1 read it back bit-exact (KV and
  indexer, checked against the content every token must have: the readers'
  device pools never held it);
* each rank writes exactly its own pages;
* a deleted / truncated / bit-flipped object of one page (KV or indexer):
  every rank restores the same shorter prefix, no page is wrong;
* a failed put (or one that raises) on one rank: no error, every rank stays
  alike, a later read stops at the first missing page;
* a fetch that raises on one rank, another model's namespace: nothing
  restored anywhere, every host slot and ledger charge given back;
* an unusable directory stops start-up, naming the setting.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from sglang.srt.mem_cache.radix_cache import RadixKey

from sglang_cp_hicache import settings
from sglang_cp_hicache.l3.identity import ModelIdentity
from sglang_cp_hicache.l3.rank import RankL3
from sglang_cp_hicache.sglang_0518.l3_port import L3Port0518
from sglang_cp_hicache.l3.opening import open_l3
from sglang_cp_hicache.sglang_0518.l3_cache import l3_binding
from sglang_cp_hicache.sglang_0518.l3_port import balanced_owners
from sglang_cp_hicache.testing.stack_0518 import CpStackConfig

from tests.helpers.cp_cluster import CpCluster
from tests.helpers.rank_snapshot import rank_state, shared_view

P = 64
PAGES = 5
TOKENS = list(range(1000, 1000 + PAGES * P))


def cluster(n: int) -> CpCluster:
    return CpCluster(CpStackConfig(cp_size=n, device_pages=8, host_pages=10), threaded=True, timeout_s=30)


def write_with_cp4(directory: Path, monkeypatch, tokens=TOKENS, *, setup=None) -> CpCluster:
    """CP 4 prefills ``tokens``: write-through, then L3 once the ack is consumed."""
    monkeypatch.setenv(settings.L3_DIR.name, str(directory))
    cl = cluster(4)
    if setup is not None:
        setup(cl)
    cl.insert(tokens)
    cl.step()
    io_done(cl)  # the writes run on each rank's L3 worker thread
    return cl


def io_done(cl: CpCluster) -> None:
    assert all(cl.each(lambda s: s.cache.l3_wait_io(timeout=10)))


def read_back(cl: CpCluster, tokens=TOKENS) -> list[int]:
    """Prefetch from L3 on every rank, the two step all-reduces, the load-back;
    returns the device tokens each rank then holds for ``tokens``."""
    looked_up = cl.each(lambda s: s.cache.l3_prefetch(RadixKey(tokens)))
    assert len(set(looked_up)) == 1
    io_done(cl)  # each rank's query I/O (worker thread) is done: its word is ready
    cl.step()  # the query's MIN: which pages exist on their owners
    io_done(cl)
    cl.step()  # the fetch's MIN: which pages verified; the node is inserted
    assert all(not c.cp_l3.prefetcher.pending for c in cl.caches)
    cl.load_back(tokens)
    return [int(locs.numel()) for locs in cl.device_locs(tokens)]


def assert_alike(cl: CpCluster) -> None:
    views = [shared_view(rank_state(s)) for s in cl.stacks]
    assert all(v == views[0] for v in views[1:])
    for s in cl.stacks:  # the ledger mirrors each rank's host pool exactly
        host = s.cache.cache_controller.mem_pool_host
        used = host.size - host.available_size()
        assert s.cache.host_slot_ledger.used[s.cp_rank] == used


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One directory written by CP 4, shared by the read tests."""
    directory = tmp_path_factory.mktemp("l3")
    mp = pytest.MonkeyPatch()
    try:
        cl = write_with_cp4(directory, mp)
        counters = [c.cp_l3.counters for c in cl.caches]
        owners = [int(o) for o in _node_owners(cl.caches[0])]
        assert_alike(cl)
        cl.close()
    finally:
        mp.undo()
    return directory, counters, owners


def _node_owners(cache):
    node = next(iter(cache.root_node.children.values()))
    assert len(node.key) == PAGES * P
    return node.cp_hicache.token_owners[::P].tolist()


def test_each_cp4_rank_writes_exactly_its_own_pages(written):
    directory, counters, owners = written
    assert [c.written_pages for c in counters] == [owners.count(r) for r in range(4)]
    assert all(c.write_failures == 0 for c in counters)
    objects = sorted(directory.rglob("*.bin"))
    assert len(objects) == 2 * PAGES  # KV + indexer per page, no rank suffix, nothing twice
    assert not list(directory.rglob("*.tmp*"))


def check_restored_whole(cl: CpCluster) -> None:
    """Nothing cached: L3 alone supplies every page of ``TOKENS``, bit-exact,
    refusing none, and every rank ends alike."""
    assert cl.device_locs(TOKENS)[0].numel() == 0
    assert read_back(cl) == [PAGES * P] * len(cl.caches)
    assert cl.check(TOKENS) == {}
    assert sum(c.cp_l3.counters.restored_pages for c in cl.caches) == PAGES
    assert all(c.cp_l3.counters.rejected_pages == 0 for c in cl.caches)
    assert_alike(cl)


@pytest.mark.parametrize("n", [2, 1])
def test_cp4_writes_cp_n_reads_bit_exact(written, n, monkeypatch):
    directory, _, _ = written
    monkeypatch.setenv(settings.L3_DIR.name, str(directory))
    cl = cluster(n)
    try:
        check_restored_whole(cl)
    finally:
        cl.close()


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "delete":
        path.unlink()
    elif how == "truncate":
        path.write_bytes(data[: len(data) - 7])
    else:  # one payload bit
        flipped = bytearray(data)
        flipped[len(data) - 100] ^= 0x10
        path.write_bytes(bytes(flipped))


def copy_of(source: Path, directory: Path) -> Path:
    """``directory``, holding a copy of the L3 objects under ``source`` (the
    shared directory stays whole)."""
    for f in source.rglob("*.bin"):
        (directory / f.parent.name).mkdir(parents=True, exist_ok=True)
        (directory / f.parent.name / f.name).write_bytes(f.read_bytes())
    return directory


def object_path(cl: CpCluster, pool: str, page: int) -> Path:
    """The object of page ``page`` of ``TOKENS`` in ``pool`` ("kv" or "indexer")."""
    tier = cl.caches[0].cp_l3.tier
    kv_keys, idx_keys = tier.chain_keys(tier.page_hashes(TOKENS))
    return tier.store.path_of((kv_keys if pool == "kv" else idx_keys)[page])


@pytest.mark.parametrize("pool", ["kv", "indexer"])
@pytest.mark.parametrize("how", ["delete", "truncate", "flip"])
def test_a_damaged_object_on_one_rank_gives_every_rank_the_same_shorter_prefix(
    written, tmp_path, monkeypatch, how, pool
):
    source, _, _ = written
    monkeypatch.setenv(settings.L3_DIR.name, str(copy_of(source, tmp_path / "l3")))
    cl = cluster(2)
    try:
        bad = 3
        assert balanced_owners([0, 0], PAGES, P)[bad] == 1  # the damaged page is rank 1's
        _damage(object_path(cl, pool, bad), how)
        assert read_back(cl) == [bad * P, bad * P]
        assert cl.check(TOKENS) == {}  # every restored token right, on every rank
        # A deleted object stops the query (nothing past it is fetched); a
        # damaged one is fetched and refused by its owner alone.
        assert cl.caches[1].cp_l3.counters.rejected_pages == (0 if how == "delete" else 1)
        assert cl.caches[0].cp_l3.counters.rejected_pages == 0  # rank 0 never reads rank 1's pages
        assert sum(c.cp_l3.counters.restored_pages for c in cl.caches) == bad
        assert_alike(cl)
    finally:
        cl.close()


@pytest.mark.parametrize("failure", ["returns False", "raises"])
def test_a_failed_put_on_one_rank_keeps_every_rank_alike(tmp_path, monkeypatch, failure):
    def break_rank_2(cl):
        store = cl.caches[2].cp_l3.tier.store
        if failure == "returns False":
            store.write_from = lambda key, views: False
        else:
            def write_from(key, views):
                raise OSError("disk full (injected)")
            store.write_from = write_from

    cl = write_with_cp4(tmp_path, monkeypatch, setup=break_rank_2)
    try:
        owners = _node_owners(cl.caches[0])
        assert cl.caches[2].cp_l3.counters.write_failures == owners.count(2) > 0
        assert cl.caches[2].cp_l3.counters.written_pages == 0
        assert_alike(cl)  # the host tier is untouched by L3 failures
        assert cl.check(TOKENS) == {}
    finally:
        cl.close()
    reader = cluster(1)
    try:
        first_missing = owners.index(2)
        assert read_back(reader) == [first_missing * P]
        assert reader.check(TOKENS) == {}
    finally:
        reader.close()


@pytest.mark.parametrize("method", ["exists", "open_object"])  # the query's, the fetch's
def test_a_store_call_that_raises_on_one_rank_restores_nothing_anywhere(written, monkeypatch, method):
    directory, _, _ = written
    monkeypatch.setenv(settings.L3_DIR.name, str(directory))
    cl = cluster(2)
    try:
        def broken(*args):
            raise OSError("I/O error (injected)")
        setattr(cl.caches[1].cp_l3.tier.store, method, broken)
        assert read_back(cl) == [0, 0]
        assert all(not c.root_node.children for c in cl.caches)
        assert [c.host_slot_ledger.used for c in cl.caches] == [[0, 0], [0, 0]]
        assert_alike(cl)
    finally:
        cl.close()


def test_another_models_namespace_in_the_same_directory_misses(written, monkeypatch):
    directory, _, _ = written
    monkeypatch.setenv(settings.L3_DIR.name, str(directory))
    cl = cluster(2)
    try:
        for c in cl.caches:
            other = open_l3(c.cp_l3_location, "test", lambda c=c: l3_binding(
                c.cp_placement, c.cp_copy_targets, c.token_to_kv_pool_allocator.get_kvcache(), None),
                identity=ModelIdentity("name:another-model"))
            port = L3Port0518(c, other.tier, c.cp_placement, c.cp_host)
            c.cp_l3_cache.rank_l3 = RankL3(other.tier, port, c.cp_l3_location)
        assert read_back(cl) == [0, 0]
        assert all(not c.root_node.children for c in cl.caches)
        assert all(c.cp_l3.counters.restored_pages == 0 for c in cl.caches)
        assert_alike(cl)
    finally:
        cl.close()


def test_an_unusable_directory_stops_start_up_naming_the_setting(tmp_path, monkeypatch):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    monkeypatch.setenv(settings.L3_DIR.name, str(not_a_dir))
    with pytest.raises(ValueError, match="SGLANG_CP_HICACHE_L3_DIR.*unusable"):
        cluster(2)


def test_l3_off_by_default(monkeypatch):
    monkeypatch.delenv(settings.L3_DIR.name, raising=False)
    cl = cluster(2)
    try:
        assert all(c.cp_l3 is None for c in cl.caches)
        assert cl.each(lambda s: s.cache.l3_prefetch(RadixKey(TOKENS))) == [0, 0]
    finally:
        cl.close()


def test_ranks_that_disagree_on_l3_refuse_to_start(tmp_path, monkeypatch):
    """One rank without L3 would miss where the others hit: every rank
    refuses at the start-up agreement, naming it."""
    from sglang_cp_hicache.agreement import CpAgreementError
    from tests.helpers.cp_cluster import RankSetup, build_each_rank, building_rank

    from sglang_cp_hicache.l3.location import L3Location
    from sglang_cp_hicache.sglang_0518 import hiradix

    monkeypatch.setenv(settings.L3_DIR.name, str(tmp_path))
    real_location = hiradix.storage_location
    monkeypatch.setattr(
        hiradix, "storage_location",
        lambda args: L3Location(None, False, "off") if building_rank() == 1 else real_location(args),
    )
    outcomes = build_each_rank(CpStackConfig(cp_size=2, device_pages=8, host_pages=10), lambda r: RankSetup(r))
    assert all(isinstance(o, CpAgreementError) for o in outcomes), outcomes
    assert all("disagree on l3" in str(o) and "'off'" in str(o) for o in outcomes)


def test_a_write_taken_back_at_the_step_reaches_l3_on_no_rank(tmp_path, monkeypatch):
    """Rank 1's host allocation comes up short: the step takes the write back
    on every rank before its ack is consumed, so no rank stores a page; the
    retry backs the node up and every rank stores its pages."""
    from tests.helpers.rank_snapshot import FailOn

    def short_on_rank_1(cl):
        host = cl.caches[1].cache_controller.mem_pool_host
        host.alloc = FailOn(host.alloc)

    cl = write_with_cp4(tmp_path, monkeypatch, setup=short_on_rank_1)
    try:
        assert cl.caches[1].cache_controller.mem_pool_host.alloc.fired
        assert all(c.cp_counters.write_failures == 1 for c in cl.caches)
        assert all(c.cp_l3.counters.written_pages == 0 for c in cl.caches)
        assert not list(tmp_path.rglob("*.bin"))
        cl.insert(TOKENS)  # the hit backs the node up again
        cl.step()
        io_done(cl)
        assert sum(c.cp_l3.counters.written_pages for c in cl.caches) == PAGES
        assert len(list(tmp_path.rglob("*.bin"))) == 2 * PAGES
        assert_alike(cl)
    finally:
        cl.close()


def test_a_miss_takes_no_host_room_and_a_hit_evicts_host_leaves_for_its_pages(tmp_path, monkeypatch):
    """Host pools full: a chain L3 does not hold allocates and evicts nothing
    on any rank (the query's MIN comes first); a chain it holds evicts host
    leaves for its pages, alike on every rank, and is restored bit-exact."""
    monkeypatch.setenv(settings.L3_DIR.name, str(tmp_path))
    cl = cluster(2)
    try:
        cl.insert(TOKENS)  # backed up and written to L3, then gone from device and host
        cl.evict_device(PAGES * P)
        cl.evict_host(10 * P)
        assert all(not c.root_node.children for c in cl.caches)
        others = [list(range(50_000 * (i + 1), 50_000 * (i + 1) + PAGES * P)) for i in range(4)]
        for tokens in others:  # 20 pages: both host pools full
            cl.insert(tokens)
            cl.evict_device(PAGES * P)
        assert [c.host_slot_ledger.used for c in cl.caches] == [[10 * P, 10 * P]] * 2
        never_written = list(range(900_000, 900_000 + PAGES * P))
        before = [rank_state(s) for s in cl.stacks]
        assert read_back(cl, never_written) == [0, 0]
        assert [rank_state(s) for s in cl.stacks] == before
        assert sum(c.cp_l3.counters.fetched_pages for c in cl.caches) == 0

        evicted = [c.cp_counters.host_evicted_nodes for c in cl.caches]
        assert read_back(cl, TOKENS) == [PAGES * P, PAGES * P]
        assert cl.check(TOKENS) == {}
        assert [c.cp_counters.host_evicted_nodes - e for c, e in zip(cl.caches, evicted)] == [2, 2]
        assert_alike(cl)
    finally:
        cl.close()


def test_a_write_stores_the_pages_as_they_were_at_its_ack_on_the_worker_thread(tmp_path, monkeypatch):
    """Writes run on the L3 worker thread, from copies taken when the ack is
    consumed: the node's host slots may hold other pages by the time the
    write runs (here: evicted and reused while the worker is held busy), and
    a reader still restores exactly the right bytes."""
    monkeypatch.setenv(settings.L3_DIR.name, str(tmp_path))
    cl = cluster(2)
    release, threads = threading.Event(), []
    try:
        callers = set(cl.each(lambda s: threading.current_thread().name))
        for c in cl.caches:
            def recorded(key, views, _real=c.cp_l3.tier.store.write_from):
                threads.append(threading.current_thread().name)
                assert release.wait(20)  # every write waits until the host slots were reused
                return _real(key, views)
            c.cp_l3.tier.store.write_from = recorded
        cl.insert(TOKENS)
        cl.step()  # the ack is consumed: the pages are copied, the writes queued
        cl.evict_device(PAGES * P)
        cl.evict_host(10 * P)
        assert all(not c.root_node.children for c in cl.caches)
        for i in range(4):  # 20 pages: every host slot of both ranks, other bytes
            cl.insert(list(range(70_000 * (i + 1), 70_000 * (i + 1) + PAGES * P)))
            cl.step()
            cl.evict_device(PAGES * P)
        assert [c.host_slot_ledger.used for c in cl.caches] == [[10 * P, 10 * P]] * 2
        assert not list(tmp_path.rglob("*.bin"))  # nothing stored yet
        release.set()
        io_done(cl)
        assert sum(c.cp_l3.counters.written_pages for c in cl.caches) == 5 * PAGES
        assert threads and all(t.startswith("cp-hicache-l3-rank") and t not in callers for t in threads)
        assert all("-write-" in t for t in threads)
    finally:
        release.set()
        cl.close()
    reader = cluster(1)
    try:
        assert read_back(reader) == [PAGES * P]
        assert reader.check(TOKENS) == {}
    finally:
        reader.close()


# ---- the model's identity ---------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two checkpoints of one architecture (different weights), a link to
    the first, and an L3 directory that checkpoint A, served as "prod",
    wrote TOKENS to."""
    from sglang_cp_hicache.testing.env import tiny_model_dir

    root = tmp_path_factory.mktemp("models")
    for name, weights in (("A", b"a" * 256), ("B", b"b" * 256)):
        (root / name).mkdir()
        (root / name / "config.json").write_bytes((Path(tiny_model_dir()) / "config.json").read_bytes())
        (root / name / "model.safetensors").write_bytes(weights)
    (root / "A-link").symlink_to(root / "A")
    directory = root / "l3"
    mp = pytest.MonkeyPatch()
    try:
        mp.setenv(settings.L3_DIR.name, str(directory))
        cl = CpCluster(_served(2, root / "A", served_model_name="prod"), threaded=True, timeout_s=30)
        try:
            cl.insert(TOKENS)
            cl.step()
            io_done(cl)
            assert sum(c.cp_l3.counters.written_pages for c in cl.caches) == PAGES
        finally:
            cl.close()
    finally:
        mp.undo()
    return root, directory


def _served(n: int, model: Path, **args) -> CpStackConfig:
    return CpStackConfig(cp_size=n, device_pages=8, host_pages=10,
                         server_args=(("model_path", str(model)), *sorted(args.items())))


@pytest.mark.parametrize("model,args,restores", [
    ("B", {"served_model_name": "prod"}, False),  # another checkpoint under the same alias
    ("A", {"served_model_name": "prod", "revision": "v2"}, False),
    ("A", {"served_model_name": "prod", "quantization": "fp8"}, False),
    ("A", {"served_model_name": "prod", "json_model_override_args": '{"rope_scaling": {"factor": 4.0}}'}, False),
    ("A", {"served_model_name": "another-alias"}, True),  # the same checkpoint under another alias
    ("A-link", {"served_model_name": "prod"}, True),  # ... and through a link to it
], ids=["other-checkpoint", "revision", "quantization", "override-args", "other-alias", "link"])
def test_only_the_same_models_bytes_are_restored(checkpoints, monkeypatch, model, args, restores):
    root, directory = checkpoints
    monkeypatch.setenv(settings.L3_DIR.name, str(directory))
    cl = CpCluster(_served(2, root / model, **args), threaded=True, timeout_s=30)
    try:
        restored = read_back(cl)
        assert restored == ([PAGES * P] * 2 if restores else [0, 0])
        assert sum(c.cp_l3.counters.restored_pages for c in cl.caches) == (PAGES if restores else 0)
        assert all(c.cp_l3.counters.rejected_pages == 0 for c in cl.caches)  # another model's keys: a plain miss
        if restores:
            assert cl.check(TOKENS) == {}
        assert_alike(cl)
    finally:
        cl.close()


def test_one_ranks_unusable_directory_stops_every_rank_at_once_with_the_l3_message(tmp_path, monkeypatch):
    """Rank 1's L3 directory is a file: rank 1 does not raise before the
    start-up agreement (its peers would wait in the all-gather until the
    collective timeout); its problem is its agreement view, so every rank
    stops at once, naming it."""
    import time

    from sglang_cp_hicache.agreement import CpAgreementError
    from sglang_cp_hicache.l3.location import L3Location
    from sglang_cp_hicache.sglang_0518 import hiradix
    from tests.helpers.cp_cluster import RankSetup, build_each_rank, building_rank

    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("x")
    monkeypatch.setenv(settings.L3_DIR.name, str(tmp_path / "l3"))
    real_location = hiradix.storage_location
    monkeypatch.setattr(
        hiradix, "storage_location",
        lambda args: L3Location(str(not_a_dir), False, "SGLANG_CP_HICACHE_L3_DIR") if building_rank() == 1
        else real_location(args),
    )
    start = time.monotonic()
    outcomes = build_each_rank(CpStackConfig(cp_size=2, device_pages=8, host_pages=10), lambda r: RankSetup(r),
                               timeout_s=120)
    assert time.monotonic() - start < 60  # not the collective timeout
    assert all(isinstance(o, CpAgreementError) for o in outcomes), outcomes
    assert all("disagree on l3" in str(o) and "L3 directory unusable" in str(o) and "a-file" in str(o)
               for o in outcomes)
