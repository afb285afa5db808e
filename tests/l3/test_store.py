"""The file store: round trip, atomic and idempotent writes, clear errors for
an unusable directory, misses (never crashes) on unreadable objects, and no
page of one namespace ever valid for another in a shared directory."""

import os
import shutil
import tempfile
import threading
import time

import pytest
import torch

from sglang_cp_hicache.l3.envelope import HEADER_BYTES, Rejection, pack, unpack
from sglang_cp_hicache.l3.keys import page_key, page_keys
from sglang_cp_hicache.l3.store import STALE_TMP_S, FilePageStore, PageStore, SizeMismatch, preadv_all
from tests.l3.common import hash_chain, namespace, payload

NS = namespace()


def _leftovers(directory) -> list[str]:
    return [name for _, _, files in os.walk(directory) for name in files if not name.endswith(".bin")]


def test_round_trip_layout_and_misses(tmp_path):
    store = FilePageStore(tmp_path / "a" / "b")  # created, parents included
    assert isinstance(store, PageStore)
    keys = page_keys(hash_chain(3), NS)
    blobs = [pack(k, NS, payload(NS, i)) for i, k in enumerate(keys)]
    assert store.exists(keys) == [False] * 3
    assert store.get(keys) == [None] * 3
    assert store.put(keys[:2], [blobs[0], bytearray(blobs[1])]) == [True, True]
    assert store.exists(keys) == [True, True, False]
    assert store.get(keys) == [blobs[0], blobs[1], None]
    assert store.path_of(keys[0]) == tmp_path / "a" / "b" / keys[0][:2] / f"{keys[0]}.bin"
    assert store.path_of(keys[0]).read_bytes() == blobs[0]
    assert store.put([], []) == [] and store.get([]) == []
    assert _leftovers(tmp_path) == []


def test_a_put_replaces_what_is_there_atomically(tmp_path):
    """The store replaces; deciding to keep a sound object is the writer's
    (``pages.store_owned`` verifies it first)."""
    store = FilePageStore(tmp_path)
    key = page_key("3" * 64, NS)
    first, second = pack(key, NS, payload(NS, 1)), pack(key, NS, payload(NS, 2))
    assert store.put([key], [first]) == [True]
    assert bytes(store.get([key])[0]) == first
    store.path_of(key).write_bytes(first[:100])  # a torn leftover
    assert store.put([key], [second]) == [True]
    assert bytes(store.get([key])[0]) == second
    assert not list(tmp_path.rglob("*.tmp"))


def test_get_checks_the_size_before_reading_a_byte(tmp_path):
    """An object of another size than the caller expects comes back as a
    SizeMismatch, unread: a 100 GiB sparse file under a key's name costs no
    memory (the test would be killed if it were read)."""
    store = FilePageStore(tmp_path)
    key = page_key("4" * 64, NS)
    want = HEADER_BYTES + NS.page_bytes
    path = store.path_of(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(100 << 30)  # sparse: no disk used
    assert store.get([key], [want]) == [SizeMismatch(100 << 30)]
    path.write_bytes(b"x" * (want - 1))
    assert store.get([key], [want]) == [SizeMismatch(want - 1)]
    blob = pack(key, NS, payload(NS, 3))
    assert store.put([key], [blob]) == [True]
    assert bytes(store.get([key], [want])[0]) == blob
    assert store.get([page_key("5" * 64, NS)], [want]) == [None]
    with pytest.raises(ValueError, match="sizes must have one entry per key"):
        store.get([key], [want, want])


def test_temporary_files_of_dead_writers_are_swept_never_read(tmp_path):
    key = page_key("6" * 64, NS)
    store = FilePageStore(tmp_path)
    sub = store.path_of(key).parent
    sub.mkdir(parents=True, exist_ok=True)
    old = sub / f".{key}.bin.123.456.deadbeef.tmp"
    fresh = sub / f".{key}.bin.789.456.cafebabe.tmp"
    for f in (old, fresh):
        f.write_bytes(b"half a page")
    ten_min_ago = time.time() - STALE_TMP_S - 5
    os.utime(old, (ten_min_ago, ten_min_ago))
    assert store.get([key]) == [None]  # a temporary file is never an object
    assert FilePageStore(tmp_path).swept_files == 1  # at start-up: the dead writer's only
    assert not old.exists() and fresh.exists()
    assert store.sweep(max_age_s=0) == 1 and not fresh.exists()


def test_a_path_that_is_a_regular_file_is_refused(tmp_path):
    path = tmp_path / "file"
    path.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"directory .*file.* is not a directory"):
        FilePageStore(path)
    with pytest.raises(ValueError, match=r"directory .*cannot be created"):
        FilePageStore(path / "below")
    assert path.read_bytes() == b"x"


def test_an_existing_directory_that_refuses_files_is_refused():
    # Tests run as root, where chmod 0o500 does not stop writes; /proc refuses
    # new files even to root, so the writability probe is tested for real.
    assert os.path.isdir("/proc")
    with pytest.raises(ValueError, match=r"directory '/proc' is not writable"):
        FilePageStore("/proc")


def test_a_permission_error_from_the_probe_is_a_clear_error(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(ValueError, match="is not writable.*Permission denied"):
        FilePageStore(tmp_path)


def test_bad_arguments_name_themselves(tmp_path):
    store = FilePageStore(tmp_path)
    key = page_key("4" * 64, NS)
    with pytest.raises(TypeError, match="directory"):
        FilePageStore(3)
    with pytest.raises(TypeError, match="fsync"):
        FilePageStore(tmp_path, fsync="yes")
    with pytest.raises(ValueError, match=r"keys\[1\]"):
        store.put([key, "../../etc/passwd"], [b"a", b"b"])
    with pytest.raises(ValueError, match="blobs"):
        store.put([key], [b"a", b"b"])
    with pytest.raises(TypeError, match=r"blobs\[0\]"):
        store.put([key], ["text"])
    with pytest.raises(TypeError, match="keys"):
        store.get(key)
    assert os.listdir(tmp_path) == []  # nothing written by refused calls


def test_concurrent_writers_of_one_key_end_with_one_whole_object(tmp_path):
    store = FilePageStore(tmp_path)
    writers = 8
    for round_ in range(6):
        key = page_key(f"{round_:064x}", NS)
        candidates = [pack(key, NS, payload(NS, 100 * round_ + w)) for w in range(writers)]
        barrier = threading.Barrier(writers)
        results = [None] * writers

        def write(w: int) -> None:
            barrier.wait()
            results[w] = store.put([key], [candidates[w]])

        threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [[True]] * writers
        [stored] = store.get([key])
        assert stored in candidates
        page = unpack(key, NS, stored)
        assert isinstance(page, torch.Tensor)
        assert any(torch.equal(page, payload(NS, 100 * round_ + w)) for w in range(writers))
    assert _leftovers(tmp_path) == []


def test_failed_writes_report_false_and_leave_no_temp_files(tmp_path, caplog):
    store = FilePageStore(tmp_path)
    keys = page_keys(hash_chain(2, seed=7), NS)
    blocked = tmp_path / keys[0][:2]
    blocked.write_bytes(b"")  # a file where the fan-out directory must go
    assert keys[1][:2] != keys[0][:2]
    blobs = [pack(k, NS, payload(NS, i)) for i, k in enumerate(keys)]
    assert store.put(keys, blobs) == [False, True]
    assert "L3 file store: cannot" in caplog.text
    assert store.get(keys) == [None, blobs[1]]
    assert _leftovers(tmp_path) == [keys[0][:2]]


def test_a_failed_rename_reports_false_and_removes_its_temp_file(tmp_path, monkeypatch, caplog):
    store = FilePageStore(tmp_path)
    key = page_key("6" * 64, NS)

    def no_space(src, dst, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    assert store.put([key], [pack(key, NS, payload(NS, 0))]) == [False]
    assert "cannot write" in caplog.text and "No space left" in caplog.text
    assert _leftovers(tmp_path) == [] and store.exists([key]) == [False]


def test_an_unreadable_object_is_a_miss(tmp_path, caplog):
    store = FilePageStore(tmp_path)
    key = page_key("5" * 64, NS)
    store.path_of(key).mkdir(parents=True)  # a directory where the object should be
    assert store.exists([key]) == [False]
    assert store.get([key]) == [None]
    assert "cannot read" in caplog.text


def test_another_namespace_in_the_same_directory_is_never_valid(tmp_path):
    ns_a, ns_b = namespace(model_id="model/a"), namespace(model_id="model/b")
    store_a, store_b = FilePageStore(tmp_path), FilePageStore(tmp_path)
    hashes = hash_chain(4)
    keys_a, keys_b = page_keys(hashes, ns_a), page_keys(hashes, ns_b)
    assert not set(keys_a) & set(keys_b)  # same pages, distinct objects
    pages_a = [payload(ns_a, i) for i in range(4)]
    pages_b = [payload(ns_b, 10 + i) for i in range(4)]
    assert store_a.put(keys_a, [pack(k, ns_a, p) for k, p in zip(keys_a, pages_a)]) == [True] * 4
    assert store_b.put(keys_b, [pack(k, ns_b, p) for k, p in zip(keys_b, pages_b)]) == [True] * 4
    for key, blob, page in zip(keys_a, store_a.get(keys_a), pages_a):
        assert torch.equal(unpack(key, ns_a, blob), page)
    # b's object copied over a's name: refused by namespace; a's page 1 over
    # a's page 0: refused by key. Never a's bytes for a's key otherwise.
    shutil.copyfile(store_b.path_of(keys_b[0]), store_a.path_of(keys_a[0]))
    shutil.copyfile(store_a.path_of(keys_a[1]), store_a.path_of(keys_a[2]))
    got = [unpack(k, ns_a, blob) for k, blob in zip(keys_a, store_a.get(keys_a))]
    assert isinstance(got[0], Rejection) and got[0].reason == "namespace"
    assert torch.equal(got[1], pages_a[1])
    assert isinstance(got[2], Rejection) and got[2].reason == "key"
    assert torch.equal(got[3], pages_a[3])


def _views(sizes: list[int]) -> list[memoryview]:
    return [memoryview(bytearray(n)) for n in sizes]


@pytest.mark.parametrize("sizes", [[7, 0, 4096, 1, 9000], [3] * 1500, [0, 0]])
def test_preadv_all_fills_every_view_in_order(tmp_path, sizes):
    """One call where one fills them, several where the views are more than
    IOV_MAX or the kernel reads short; zero-length views skipped, never an
    error; the bytes land in the views in file order."""
    data = os.urandom(sum(sizes) + 11)
    path = tmp_path / "f"
    path.write_bytes(data)
    views = _views(sizes)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert preadv_all(fd, views, 5) == sum(sizes)
        assert preadv_all(fd, []) == 0
    finally:
        os.close(fd)
    assert b"".join(bytes(v) for v in views) == data[5:5 + sum(sizes)]


def test_preadv_all_retries_a_short_read_and_stops_at_end_of_file(tmp_path, monkeypatch):
    data = os.urandom(10_000)
    path = tmp_path / "f"
    path.write_bytes(data)
    real = os.preadv
    calls = []

    def short(fd, views, offset, flags=0):  # at most 1000 bytes a call, as a slow file system may
        calls.append(offset)
        budget, cut = 1000, []
        for v in views:
            if budget <= 0:
                break
            cut.append(v[:budget])
            budget -= len(cut[-1])
        return real(fd, cut, offset, flags)

    monkeypatch.setattr(os, "preadv", short)
    views = _views([4000, 7000])  # 11,000 bytes asked, 10,000 there
    fd = os.open(path, os.O_RDONLY)
    try:
        assert preadv_all(fd, views) == 10_000
    finally:
        os.close(fd)
    assert len(calls) == 11  # ten of 1,000 bytes, then one that finds the end
    assert bytes(views[0]) + bytes(views[1])[:6000] == data and bytes(views[1])[6000:] == bytes(1000)


def test_a_write_makes_a_subdirectory_removed_under_it_again(tmp_path):
    store = FilePageStore(tmp_path)
    keys = page_keys(hash_chain(2), NS)
    blobs = [pack(k, NS, payload(NS, i)) for i, k in enumerate(keys)]
    assert store.put(keys[:1], blobs[:1]) == [True]
    shutil.rmtree(store.path_of(keys[0]).parent)  # cleared by an operator meanwhile
    assert store.put(keys, blobs) == [True, True]
    assert store.get(keys) == blobs
    assert _leftovers(tmp_path) == []
