"""One object read into a host page (:func:`read_into_host`): straight into
the host rows from the page cache, through the staging buffer otherwise, and
never a write into host memory once the reading job is cancelled."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from sglang_cp_hicache.l3.capabilities import StoreCapabilities
from sglang_cp_hicache.l3.envelope import HEADER_BYTES, byte_view, checksum, checksum_parts
from sglang_cp_hicache.l3.host_copy import HostPageRuns
from sglang_cp_hicache.l3.host_read import read_into_host
from sglang_cp_hicache.l3.keys import page_keys
from sglang_cp_hicache.l3.pages import store_verified
from sglang_cp_hicache.l3.store import FilePageStore, OpenObject
from sglang_cp_hicache.l3.workers import L3Cancelled, L3Workers
from tests.l3.common import hash_chain, namespace, payload
from tests.l3.test_host_tier import P, IndexerHost, KvHost

POISON = 0xA5


def _kv_ns(layout: str = "layer_first"):
    host = KvHost(seed=0, layout=layout)
    return namespace(page_size=P, row_bytes=host.kv_cache_dim, layer_end=host.layer_num), host


class _Staging:
    def __init__(self, ns) -> None:
        self.head = memoryview(bytearray(HEADER_BYTES))
        self.page = torch.full((ns.page_bytes,), POISON, dtype=torch.uint8)


def _written(tmp_path, ns, pages: int = 3):
    store = FilePageStore(tmp_path / "l3")
    keys = page_keys(hash_chain(pages, seed=5, page_size=P), ns)
    data = [payload(ns, seed=i) for i in range(pages)]
    scratch = (memoryview(bytearray(HEADER_BYTES)), byte_view(torch.empty(ns.page_bytes, dtype=torch.uint8)))
    for key, page in zip(keys, data):
        assert store_verified(StoreCapabilities.of(store), ns, key, page, scratch)
    return store, keys, data


def _read(store, ns, key, host, row, staging, publish=lambda fn: fn()):
    rows = HostPageRuns(host, host.kv_buffer)
    return read_into_host(StoreCapabilities.of(store), ns, key, rows, row, staging.head, staging.page, publish)


def _page(host, row) -> torch.Tensor:
    return host.get_data_page(row).view(torch.uint8).clone()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_a_cached_object_goes_straight_into_the_host_rows_and_nothing_else_changes(tmp_path, layout):
    ns, host = _kv_ns(layout)
    store, keys, data = _written(tmp_path, ns)
    host.kv_buffer.view(torch.uint8).fill_(POISON)
    staging = _Staging(ns)
    assert _read(store, ns, keys[1], host, 2 * P, staging) is None
    assert torch.equal(_page(host, 2 * P), data[1])
    assert torch.equal(staging.page, torch.full_like(staging.page, POISON))  # no staging copy: read in place
    others = host.kv_buffer.view(torch.uint8).clone()
    others_rows = HostPageRuns(host, host.kv_buffer).runs(2 * P, ns.page_bytes)
    for run in others_rows:  # every byte outside the page's runs is still poison
        torch.frombuffer(run, dtype=torch.uint8).fill_(POISON)
    assert torch.equal(host.kv_buffer.view(torch.uint8), torch.full_like(others, POISON))


def test_an_object_not_in_the_page_cache_is_read_through_the_staging_buffer(tmp_path, monkeypatch):
    ns, host = _kv_ns()
    store, keys, data = _written(tmp_path, ns)
    real = OpenObject.read
    calls = []

    def uncached(self, views, *, cached_only=False):
        calls.append(cached_only)
        return 0 if cached_only else real(self, views)

    monkeypatch.setattr(OpenObject, "read", uncached)
    host.kv_buffer.view(torch.uint8).fill_(POISON)
    staging = _Staging(ns)
    assert _read(store, ns, keys[2], host, 0, staging) is None
    assert calls == [True, False]
    assert torch.equal(_page(host, 0), data[2]) and torch.equal(staging.page, data[2])


def test_a_page_dropped_from_the_page_cache_is_still_read_bit_exact(tmp_path):
    ns, host = _kv_ns()
    store, keys, data = _written(tmp_path, ns)
    path = store.path_of(keys[0])
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    host.kv_buffer.view(torch.uint8).fill_(POISON)
    assert _read(store, ns, keys[0], host, P, _Staging(ns)) is None
    assert torch.equal(_page(host, P), data[0])


@pytest.mark.parametrize("where", ["header", "payload"])
def test_a_damaged_object_read_in_place_is_refused(tmp_path, where):
    ns, host = _kv_ns()
    store, keys, _ = _written(tmp_path, ns)
    path = store.path_of(keys[1])
    raw = bytearray(path.read_bytes())
    raw[0 if where == "header" else HEADER_BYTES + ns.page_bytes - 1] ^= 0x01
    path.write_bytes(bytes(raw))
    bad = _read(store, ns, keys[1], host, 0, _Staging(ns))
    assert bad is not None and bad.reason == ("magic" if where == "header" else "checksum")


def test_missing_and_wrong_sized_objects_are_refused_without_a_read(tmp_path):
    ns, host = _kv_ns()
    store, keys, _ = _written(tmp_path, ns)
    other = page_keys(hash_chain(1, seed=99, page_size=P), ns)[0]
    before = host.kv_buffer.view(torch.uint8).clone()
    assert _read(store, ns, other, host, 0, _Staging(ns)).reason == "missing"
    store.path_of(keys[0]).write_bytes(b"x" * 10)
    assert _read(store, ns, keys[0], host, 0, _Staging(ns)).reason == "short"
    assert torch.equal(host.kv_buffer.view(torch.uint8), before)


def _cancel_while_stalled(store, ns, key, host, stalled: threading.Event, release: threading.Event) -> None:
    """Read ``key`` into poisoned host rows on an L3 job; once the read
    stalls (``stalled``), cancel the job (at once: it holds no lock while it
    waits), let the read go on (``release``), and check the job ends
    cancelled with every host byte still poison."""
    host.kv_buffer.view(torch.uint8).fill_(POISON)
    workers = L3Workers("test-host-read", 1, spare=0)
    try:
        job = workers.submit(lambda job: _read(store, ns, key, host, P, _Staging(ns), job.publish), timeout_s=30)
        assert stalled.wait(10)
        job.cancel()
        release.set()
        job.wait(10)
        with pytest.raises(L3Cancelled):
            job.result()
    finally:
        release.set()
        workers.shutdown()
    assert torch.equal(host.kv_buffer.view(torch.uint8), torch.full_like(host.kv_buffer.view(torch.uint8), POISON))


def test_a_cancelled_job_whose_read_waited_on_storage_writes_nothing(tmp_path, monkeypatch):
    """The read not served by the page cache blocks (a storage outage); the
    job is cancelled meanwhile and its host rows handed out again; when the
    read returns the job writes nothing into them."""
    ns, host = _kv_ns()
    store, keys, _ = _written(tmp_path, ns)
    real, entered, release = OpenObject.read, threading.Event(), threading.Event()

    def stuck_when_waiting(self, views, *, cached_only=False):
        if cached_only:
            return 0  # not cached
        entered.set()
        assert release.wait(20)
        return real(self, views)

    monkeypatch.setattr(OpenObject, "read", stuck_when_waiting)
    _cancel_while_stalled(store, ns, keys[0], host, entered, release)


def test_a_job_cancelled_before_its_cached_read_writes_nothing(tmp_path, monkeypatch):
    ns, host = _kv_ns()
    store, keys, _ = _written(tmp_path, ns)
    real_open, opened, release = store.open_object, threading.Event(), threading.Event()

    def slow_open(key, size):  # the open waits on storage: no lock is held meanwhile
        opened.set()
        assert release.wait(20)
        return real_open(key, size)

    monkeypatch.setattr(store, "open_object", slow_open)
    _cancel_while_stalled(store, ns, keys[0], host, opened, release)


def test_the_indexer_pool_reads_in_place_too(tmp_path):
    idx = IndexerHost(seed=1)
    ns = namespace(page_size=P, pool="indexer", row_bytes=idx.indexer_page_stride_size // P, layer_end=idx.layer_num)
    store, keys, data = _written(tmp_path, ns)
    idx.index_k_with_scale_buffer.fill_(POISON)
    staging = _Staging(ns)
    rows = HostPageRuns(idx, idx.index_k_with_scale_buffer)
    assert len(rows.runs(3 * P, ns.page_bytes)) == idx.layer_num
    assert read_into_host(StoreCapabilities.of(store), ns, keys[0], rows, 3 * P, staging.head, staging.page,
                          lambda fn: fn()) is None
    assert torch.equal(idx.get_data_page(3 * P), data[0])
    assert torch.equal(staging.page, torch.full_like(staging.page, POISON))


def test_a_pool_that_hands_out_copies_is_filled_through_its_own_copy(tmp_path):
    ns, host = _kv_ns()
    store, keys, data = _written(tmp_path, ns)
    real = host.get_data_page
    host.get_data_page = lambda index, flat=True: real(index, flat).clone()  # not a view of the buffer
    rows = HostPageRuns(host, host.kv_buffer)
    assert rows.runs(0, ns.page_bytes) is None
    host.kv_buffer.view(torch.uint8).fill_(POISON)
    staging = _Staging(ns)
    assert read_into_host(StoreCapabilities.of(store), ns, keys[1], rows, P, staging.head, staging.page,
                          lambda fn: fn()) is None
    assert torch.equal(real(P).view(torch.uint8), data[1])


@pytest.mark.parametrize("sizes", [[1], [3, 0, 5], [4096] * 61, [1, 65537, 2]])
def test_the_checksum_of_the_runs_is_the_checksum_of_their_concatenation(sizes):
    blobs = [os.urandom(n) for n in sizes]
    assert checksum_parts([memoryview(b) for b in blobs]) == checksum(memoryview(b"".join(blobs)))
