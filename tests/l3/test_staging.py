"""Staging buffers stay bounded whatever the storage does: I/O threads
replaced after storage hiccups reuse the buffers of the ones before, and a
buffer let go is unregistered from a store that reads in place."""

from __future__ import annotations

import ctypes
import threading
import time

from sglang_cp_hicache.l3.capabilities import StoreCapabilities
from sglang_cp_hicache.l3.keys import page_key
from sglang_cp_hicache.l3.staging import StagingPool
from sglang_cp_hicache.l3.store import FilePageStore
from sglang_cp_hicache.l3.workers import L3Workers
from tests.l3.common import namespace, write_chain
from tests.l3.test_host_tier import HASHES, OWNERS, P, _own_slots, _tier


class RegisteringStore(FilePageStore):
    """A file store that, like Mooncake's, takes buffer registrations (to
    count them), and whose reads of ``hang_key`` wait for ``release``."""

    def __init__(self, directory) -> None:
        super().__init__(directory)
        self.registered: set[tuple[int, int]] = set()
        self.hang_key = ""
        self.release = threading.Event()

    def register_buffers(self, views) -> bool:
        self.registered.update(_regions(views))
        return True

    def unregister_buffers(self, views) -> None:
        self.registered.difference_update(_regions(views))

    def open_object(self, key, size):
        if key == self.hang_key:
            self.release.wait(30)
        return super().open_object(key, size)


def _regions(views) -> set[tuple[int, int]]:
    return {(ctypes.addressof(ctypes.c_ubyte.from_buffer(v)), len(v)) for v in views}


def test_eight_storage_hiccups_leave_staging_memory_and_registrations_bounded(tmp_path):
    """Each hiccup: a read hangs past its deadline, a spare thread takes the
    next read, the hung one returns, the spare retires. Per-thread buffers
    grew by one set (4 registered buffers) a hiccup; lent ones stay at the
    two reads ever in flight at once."""
    store = RegisteringStore(tmp_path / "l3")
    writer = _tier(store, 0, seed=11)
    assert write_chain(writer, HASHES, OWNERS, _own_slots(0)) == 3
    reader = _tier(store, 0, seed=5)
    keys = [(page_key(HASHES[i], reader.kv_ns, HASHES[i - 1] if i else None),
             page_key(HASHES[i], reader.indexer_ns, HASHES[i - 1] if i else None)) for i in (0, 3)]
    workers = L3Workers("hiccup", threads=1, spare=1)
    try:
        for _ in range(8):
            store.hang_key, store.release = keys[0][0], threading.Event()
            stuck = workers.submit(lambda job: reader.read_page(*keys[0], 0, job.publish), timeout_s=0.05)
            while not stuck.started or not stuck.overdue():
                time.sleep(0.01)
            ok = workers.submit(lambda job: reader.read_page(*keys[1], P, job.publish), timeout_s=30)
            assert ok.wait(30) and ok.result()  # served by a spare while the first is stuck
            store.release.set()
            assert stuck.wait(30) and stuck.result()
        assert workers._serial >= 9  # threads were replaced, hiccup after hiccup
    finally:
        store.release.set()
        workers.shutdown()
    assert reader.staging.created <= 2
    # header + page, KV and indexer, of every buffer alive (the writer's too: one store)
    assert len(store.registered) == 4 * (reader.staging.alive + writer.staging.alive)


def test_buffers_past_the_idle_bound_are_freed_and_unregistered(tmp_path):
    store = RegisteringStore(tmp_path / "l3")
    kv, idx = namespace(), namespace(pool="indexer", row_bytes=132)
    pool = StagingPool(kv, idx, StoreCapabilities.of(store), keep=2)
    held, entered = [], []
    for _ in range(5):
        cm = pool.borrow()
        held.append(cm.__enter__())
        entered.append(cm)
    assert pool.created == 5 and len(store.registered) == 20
    assert len({id(s) for s in held}) == 5  # one page's buffers are never lent twice at once
    for cm in entered:
        cm.__exit__(None, None, None)
    assert pool.alive == 2 and pool.freed == 3 and len(store.registered) == 8
    with pool.borrow() as again:
        assert any(again is s for s in held[:2])  # an idle buffer is reused, not a new one made
    assert pool.created == 5
