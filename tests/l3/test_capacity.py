"""A bounded file L3 directory: SGLang's max_size / min_free_space forms,
chains evicted from their ends in LRU order, one count for every writer,
readers that only ever miss."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from sglang_cp_hicache.l3.capabilities import StoreCapabilities
from sglang_cp_hicache.l3.capacity import CapacityConfig, DirectoryCapacity
from sglang_cp_hicache.sizes import parse_file_size
from sglang_cp_hicache.l3.envelope import HEADER_BYTES
from sglang_cp_hicache.l3.keys import page_keys, split_page_key
from sglang_cp_hicache.l3.pages import PutOutcome, read_verified, store_verified
from sglang_cp_hicache.l3.store import FilePageStore
from tests.l3.common import hash_chain, namespace, payload

NS = namespace()
OBJECT = HEADER_BYTES + NS.page_bytes


@pytest.mark.parametrize("text,size", [
    (None, 0), ("", 0), ("0", 0), (0, 0), (1048576, 1048576), ("1048576", 1048576), ("200G", 200 * 10**9),
    ("1.5T", int(1.5 * 10**12)), ("64Gi", 64 * 2**30), ("25.6k", 25600), ("3Mi", 3 * 2**20),
])
def test_sizes_are_read_as_sglangs_file_backend_reads_them(text, size):
    assert parse_file_size("max_size", text) == size


@pytest.mark.parametrize("bad", ["1.5Gi", "ten", "-5", "5 G", True, -1])
def test_a_bad_size_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="max_size"):
        parse_file_size("max_size", bad)


def test_the_extra_config_wins_over_sglangs_variables():
    env = {"SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE": "1G", "SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE": "2G",
           "SGLANG_HICACHE_FILE_BACKEND_EVICTION_RATIO": "0.5"}
    assert CapacityConfig.from_sources({}, env, "lru-leaves") == CapacityConfig(10**9, 2 * 10**9, 0.5)
    extra = {"max_size": "3Gi", "eviction_ratio": 1.0}
    assert CapacityConfig.from_sources(extra, env, "lru-leaves") == CapacityConfig(3 * 2**30, 2 * 10**9, 1.0)
    assert not CapacityConfig.from_sources({}, {}, "lru-leaves").bounded
    with pytest.raises(ValueError, match="eviction_ratio"):
        CapacityConfig.from_sources({"eviction_ratio": 1.5}, {}, "lru-leaves")
    with pytest.raises(ValueError, match="eviction policy"):
        CapacityConfig.from_sources({}, {}, "fifo")


def _write_chain(store: FilePageStore, seed: int, pages: int, scratch) -> list[str]:
    keys = page_keys(hash_chain(pages, seed=seed), NS)
    for i, key in enumerate(keys):
        assert store_verified(StoreCapabilities.of(store), NS, key, payload(NS, seed * 100 + i), scratch) is PutOutcome.WRITTEN
    return keys


def _scratch():
    return memoryview(bytearray(HEADER_BYTES)), memoryview(bytearray(NS.page_bytes))


def _objects(directory: Path) -> dict[str, int]:
    return {p.name[:-4]: p.stat().st_size for p in directory.rglob("*.bin")}


def _bytes_in(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file() and not p.name.startswith(".l3-"))


def _chains_whole_from_the_root(keys_by_chain: list[list[str]], present: set[str]) -> None:
    """No chain is cut in the middle: what is left of each is a prefix."""
    for keys in keys_by_chain:
        kept = [k in present for k in keys]
        assert kept == sorted(kept, reverse=True), kept


def test_a_bounded_directory_evicts_chains_from_their_ends_least_recently_used_first(tmp_path):
    cap = 12 * OBJECT
    store = FilePageStore(tmp_path, capacity=CapacityConfig(max_size=cap, eviction_ratio=1.0))
    scratch = _scratch()
    old = _write_chain(store, 1, 5, scratch)
    time.sleep(0.02)
    hot = _write_chain(store, 2, 5, scratch)
    time.sleep(0.02)
    assert read_verified(StoreCapabilities.of(store), NS, old[-1], *scratch) is None  # the old chain's end is used: it is recent now
    time.sleep(0.02)
    assert read_verified(StoreCapabilities.of(store), NS, old[0], *scratch) is None
    new = _write_chain(store, 3, 4, scratch)  # 14 objects' worth: two must go
    present = set(_objects(tmp_path))
    assert _bytes_in(tmp_path) <= cap and store.capacity.used_bytes() == _bytes_in(tmp_path)
    assert set(new) <= present
    # the hot chain was the least recently used leaf's owner: its end went, a page at a time
    assert [k in present for k in hot] == [True, True, True, False, False]
    assert all(k in present for k in old)
    _chains_whole_from_the_root([old, hot, new], present)
    assert store.capacity.evicted_objects == 2 and store.capacity.refused_writes == 0


def test_evicting_a_leaf_makes_its_parent_a_leaf_and_the_count_is_kept_across_opens(tmp_path):
    cap = 6 * OBJECT
    config = CapacityConfig(max_size=cap, eviction_ratio=1.0)
    store = FilePageStore(tmp_path, capacity=config)
    scratch = _scratch()
    first = _write_chain(store, 1, 6, scratch)
    second = _write_chain(store, 2, 6, scratch)  # the whole first chain goes, from its end
    assert set(_objects(tmp_path)) == set(second)
    assert first  # every page of the first chain went, deepest first
    reopened = FilePageStore(tmp_path, capacity=config)  # another process: the state is the directory's
    assert reopened.capacity.used_bytes() == 6 * OBJECT


def test_an_object_larger_than_the_cap_is_refused_and_nothing_is_evicted(tmp_path):
    store = FilePageStore(tmp_path, capacity=CapacityConfig(max_size=OBJECT - 1))
    key = page_keys(hash_chain(1, seed=9), NS)[0]
    assert store_verified(StoreCapabilities.of(store), NS, key, payload(NS, 1), _scratch()) is PutOutcome.FAILED
    assert store.capacity.refused_writes == 1 and _objects(tmp_path) == {}


def test_the_free_space_floor_evicts_too(tmp_path, monkeypatch):
    store = FilePageStore(tmp_path, capacity=CapacityConfig(min_free_space=10**15))  # more than any disk
    scratch = _scratch()
    key = page_keys(hash_chain(1, seed=9), NS)[0]
    assert store_verified(StoreCapabilities.of(store), NS, key, payload(NS, 1), scratch) is PutOutcome.FAILED  # nothing to evict
    assert store.capacity.refused_writes == 1


@pytest.mark.parametrize("policy", ["lru-leaves", "random-chains"])
def test_several_writers_hold_the_cap_within_one_page_each_and_readers_only_miss(tmp_path, policy):
    """Four writers (separate stores: separate locks, as separate processes
    hold them) and a reader on one directory: sampled all along, the bytes
    never pass the cap plus one page per writer; every object the reader
    finds is sound; no chain is ever cut in the middle."""
    cap = 20 * OBJECT
    config = CapacityConfig(max_size=cap, eviction_ratio=0.9, policy=policy)
    writers = [FilePageStore(tmp_path, capacity=config) for _ in range(4)]
    chains = {w: [page_keys(hash_chain(6, seed=100 * w + c), NS) for c in range(8)] for w in range(4)}
    stop, errors, peak, cut = threading.Event(), [], [0], []
    for store in writers:  # every eviction (under the directory's lock) takes a page nothing stored follows
        unlink = store.capacity._unlink

        def checked(name, _unlink=unlink):
            parents = {split_page_key("k", n)[2] for n in _objects(tmp_path)}
            if name[:16] in parents:
                cut.append(name)
            return _unlink(name)
        store.capacity._unlink = checked

    def write(w: int) -> None:
        scratch = _scratch()
        try:
            for c, keys in enumerate(chains[w]):
                for i, key in enumerate(keys):
                    store_verified(StoreCapabilities.of(writers[w]), NS, key, payload(NS, 1000 * w + 10 * c + i), scratch)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def read() -> None:
        scratch = _scratch()
        while not stop.is_set():
            for keys in (k for w in chains.values() for k in w):
                for key in keys:
                    bad = read_verified(StoreCapabilities.of(writers[0]), NS, key, *scratch)
                    if bad is not None and bad.reason != "missing":
                        errors.append(AssertionError(f"{key}: {bad}"))

    def sample() -> None:
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], _bytes_in(tmp_path))
            except FileNotFoundError:
                pass  # evicted while being measured

    threads = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    watchers = [threading.Thread(target=read), threading.Thread(target=sample)]
    for t in watchers + threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    for t in watchers:
        t.join()
    assert not errors, errors[:3]
    assert peak[0] <= cap + 4 * OBJECT, (peak[0], cap)
    present = set(_objects(tmp_path))
    assert _bytes_in(tmp_path) <= cap and len(present) > 0
    if policy == "lru-leaves":
        # (a page written after its chain's start was evicted is stored, unreachable, and next to go)
        assert cut == [], cut[:3]
    for name in present:
        split_page_key("name", name)
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_the_count_is_rebuilt_from_the_directory_when_a_store_opens(tmp_path):
    config = CapacityConfig(max_size=100 * OBJECT)
    store = FilePageStore(tmp_path, capacity=config)
    _write_chain(store, 1, 3, _scratch())
    (tmp_path / ".l3-capacity").write_bytes(os.urandom(8))  # a torn state (a writer died mid-write)
    assert FilePageStore(tmp_path, capacity=config).capacity.used_bytes() == 3 * OBJECT


# ---- writers that die, temporary files, one bound per directory, a floor shown late -------------------


def _reserve_in_child_and_die(directory: Path, config: CapacityConfig, name: str) -> None:
    """A forked writer reserves ``name`` and dies before its write is done."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            store = FilePageStore(directory, capacity=config)
            code = 0 if store.capacity.reserve(name, OBJECT) == OBJECT else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _pending(directory: Path) -> dict:
    return json.loads((directory / ".l3-capacity").read_text())["pending"]


def test_a_writer_that_died_on_this_host_lets_go_of_its_reservation_at_once(tmp_path):
    config = CapacityConfig(max_size=10 * OBJECT)
    store = FilePageStore(tmp_path, capacity=config)
    keys = page_keys(hash_chain(2, seed=5), NS)
    dead = f"{keys[1]}.bin"
    _reserve_in_child_and_die(tmp_path, config, dead)
    assert dead in _pending(tmp_path)  # registered, and its writer is gone
    assert store.capacity.reserve(f"{keys[0]}.bin", OBJECT) == OBJECT
    assert set(_pending(tmp_path)) == {f"{keys[0]}.bin"}  # the dead writer's was dropped at once
    assert store.capacity.used_bytes() == OBJECT  # and its bytes (no object was written) with it


def test_another_hosts_registration_waits_for_the_timeout(tmp_path):
    config = CapacityConfig(max_size=10 * OBJECT)
    store = FilePageStore(tmp_path, capacity=config)
    state = json.loads((tmp_path / ".l3-capacity").read_text())
    state["pending"]["x.bin"] = [OBJECT, "0" * 16, time.time()]
    state["writers"]["x.bin"] = [1, "another-host/boot/1"]
    state["used"] = OBJECT
    (tmp_path / ".l3-capacity").write_text(json.dumps(state))
    assert store.capacity.used_bytes() == OBJECT and "x.bin" in _pending(tmp_path)


def test_the_states_temporary_files_of_dead_writers_are_swept(tmp_path):
    store = FilePageStore(tmp_path, capacity=CapacityConfig(max_size=10 * OBJECT))
    old = [tmp_path / ".l3-capacity.tmp.0123456789abcdef", tmp_path / ".l3-capacity.123.456"]  # ours, earlier releases'
    fresh = tmp_path / ".l3-capacity.tmp.fedcba9876543210"
    for path in old + [fresh]:
        path.write_text("{}")
    for path in old:
        os.utime(path, (0, 0))
    assert store.sweep() == 2
    assert not any(p.exists() for p in old) and fresh.exists()
    assert (tmp_path / ".l3-capacity").exists() and (tmp_path / ".l3-capacity.lock").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".l3-capacity", ".l3-capacity.lock", fresh.name]


def test_a_deployment_with_another_bound_is_refused_naming_both(tmp_path):
    FilePageStore(tmp_path, capacity=CapacityConfig(max_size=10 * OBJECT))
    FilePageStore(tmp_path, capacity=CapacityConfig(max_size=10 * OBJECT, eviction_ratio=0.5))  # same bound
    with pytest.raises(ValueError, match=rf"max_size={10 * OBJECT} B.*this one asks max_size={20 * OBJECT} B"
                                         r".*SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE.*remove .*\.l3-capacity"):
        FilePageStore(tmp_path, capacity=CapacityConfig(max_size=20 * OBJECT))
    with pytest.raises(ValueError, match="min_free_space=1 B"):
        FilePageStore(tmp_path, capacity=CapacityConfig(max_size=10 * OBJECT, min_free_space=1))
    (tmp_path / ".l3-capacity").unlink()  # every server stopped: the bound may change
    assert FilePageStore(tmp_path, capacity=CapacityConfig(max_size=20 * OBJECT)).capacity is not None


def test_the_free_space_floor_counts_its_own_frees_and_leaves_a_margin(tmp_path, monkeypatch):
    """A file system that shows frees late (ZFS, btrfs, NFS): a round evicts
    what the floor and its margin need, not everything; later writes fit in
    the margin without a rescan each."""
    floor = 100 * OBJECT  # margin: (1 - 0.9) * floor = 10 objects
    shown = [10**15]
    monkeypatch.setattr(DirectoryCapacity, "_free_bytes", lambda self: shown[0])
    store = FilePageStore(tmp_path, capacity=CapacityConfig(min_free_space=floor, eviction_ratio=0.9))
    scratch = _scratch()
    for seed in range(30):
        _write_chain(store, seed, 1, scratch)
    shown[0] = floor  # at the floor, and it never shows a free
    scans = []
    listing = store.capacity._pages
    monkeypatch.setattr(store.capacity, "_pages", lambda: scans.append(1) or listing())
    for seed in range(100, 110):
        _write_chain(store, seed, 1, scratch)
    assert store.capacity.refused_writes == 0
    assert 10 <= store.capacity.evicted_objects <= 12  # the write and the margin, not all 30
    assert len(scans) == 1  # one round for ten writes


def test_a_registration_dated_in_the_future_does_not_pin_its_bytes(tmp_path):
    store = FilePageStore(tmp_path, capacity=CapacityConfig(max_size=10 * OBJECT))
    state = json.loads((tmp_path / ".l3-capacity").read_text())
    state["pending"]["x.bin"] = [5 * OBJECT, "0" * 16, time.time() + 86400]  # forged, or a skewed clock
    state["used"] = 5 * OBJECT
    (tmp_path / ".l3-capacity").write_text(json.dumps(state))
    assert store.capacity.used_bytes() == 0
    assert store.capacity.reserve("y.bin", OBJECT) == OBJECT and set(_pending(tmp_path)) == {"y.bin"}
