"""A rank's L3 figures (meter, per-step deltas, the exported counters) and
clearing a deployment's namespaces from a file store."""

from __future__ import annotations

import os
import threading
from functools import partial
from types import SimpleNamespace

import pytest

from sglang_cp_hicache.l3 import clear as clear_mod
from sglang_cp_hicache.l3.clear import ClearReport, clear_file_namespaces, clear_namespaces
from sglang_cp_hicache.l3.host_tier import L3Counters
from sglang_cp_hicache.l3.keys import page_keys
from sglang_cp_hicache.l3.metrics import (
    IoSample, L3IoMeter, L3MetricsSource, MeteredTier, PrometheusL3Counters, counter_names,
)
from sglang_cp_hicache.l3.store import FilePageStore
from tests.l3.common import hash_chain, namespace

# ---- the meter and the metered tier -------------------------------------------------------


class _Tier:
    """The calls MeteredTier makes of a tier."""

    def __init__(self, rank: int, usable: int = 0, whole: int = 0, fail: bool = False) -> None:
        self.kv_ns, self.indexer_ns = namespace(), namespace(pool="indexer", row_bytes=132)
        self.placement = SimpleNamespace(cp_rank=rank)
        self.usable, self.whole, self.fail = usable, whole, fail
        self.page_size = 4

    def read_page(self, kv_key, idx_key, slot, publish):
        if self.fail:
            raise OSError("injected")
        return self.usable > 0

    def store_page(self, kv_key, idx_key, kv, idx):
        if self.fail:
            raise OSError("injected")
        return self.whole > 0


def _clock(*ticks):
    it = iter(ticks)
    return lambda: next(it)


def test_a_page_read_is_one_sample_and_a_miss_none():
    meter = L3IoMeter()
    tier = _Tier(rank=1, usable=1)
    metered = MeteredTier(tier, meter, clock=_clock(10.0, 10.5))
    assert metered.read_page("k", "i", 3, None) is True
    assert MeteredTier(_Tier(rank=1, usable=0), meter, clock=_clock(0.0, 1.0)).read_page("k", "i", 3, None) is False
    page = tier.kv_ns.page_bytes + tier.indexer_ns.page_bytes
    reads, writes = meter.drain()
    assert reads == [IoSample(1, page, 0.5)] and writes == []
    assert reads[0].gib_per_s == pytest.approx(page / (1 << 30) / 0.5)
    assert meter.totals()["read_bytes"] == page and meter.totals()["read_seconds"] == 0.5
    assert meter.drain() == ([], [])  # drained once
    assert metered.page_size == 4 and metered.placement is tier.placement  # everything else is the tier's


def test_a_page_stored_is_one_sample_and_a_failure_nothing():
    meter = L3IoMeter()
    metered = MeteredTier(_Tier(rank=0, whole=1), meter, clock=_clock(1.0, 1.25))
    assert metered.store_page("k", "i", None, None) is True
    assert MeteredTier(_Tier(rank=0, whole=0), meter, clock=_clock(0.0, 1.0)).store_page("k", "i", None, None) is False
    failing = MeteredTier(_Tier(rank=0, fail=True), meter)
    with pytest.raises(OSError):
        failing.store_page("k", "i", None, None)
    with pytest.raises(OSError):
        failing.read_page("k", "i", 0, None)
    reads, writes = meter.drain()
    assert reads == [] and [(s.pages, s.seconds) for s in writes] == [(1, 0.25)]
    assert meter.totals()["write_seconds"] == 0.25


def test_the_meter_keeps_at_most_max_samples_but_every_total():
    meter = L3IoMeter(max_samples=3)
    for i in range(5):
        meter.record_write(1, 10, 0.1)
    reads, writes = meter.drain()
    assert len(writes) == 3 and meter.totals()["written_bytes"] == 50


def test_each_step_gives_what_grew_since_the_last_in_sglangs_units():
    counters, meter = L3Counters(), L3IoMeter()
    source = L3MetricsSource(counters, meter, page_size=64)
    counters.add(written_pages=3, kept_pages=1, dropped_writes=2, restored_tokens=128)
    meter.record_read(2, 100, 0.5)
    step = source.step()
    assert (step.restored_tokens, step.backed_up_tokens, step.dropped_backup_tokens) == (128, 4 * 64, 2 * 64)
    assert [s.pages for s in step.reads] == [2] and bool(step)
    nothing = source.step()
    assert not nothing and nothing.backed_up_tokens == 0
    assert source.snapshot()["written_pages"] == 3 and source.snapshot()["read_bytes"] == 100


# ---- the exported counters ------------------------------------------------------------------


def test_counters_are_exported_with_the_library_prefix_and_grow_by_deltas():
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    counter_cls = partial(prometheus_client.Counter, registry=registry)
    fields = {**L3Counters().as_dict(), **L3IoMeter().totals()}
    names = counter_names(fields)
    assert names["written_pages"] == "sglang_cp_hicache:l3_written_pages_total"
    assert names["read_bytes"] == "sglang_cp_hicache:l3_read_bytes_total"
    rank0 = PrometheusL3Counters({"attn_cp_rank": 0, "storage_backend": "file"}, fields, counter_cls)
    rank1 = PrometheusL3Counters({"attn_cp_rank": 1, "storage_backend": "file"}, fields, counter_cls)  # one family
    rank0.publish({"written_pages": 3, "read_seconds": 0.5})
    rank0.publish({"written_pages": 5, "read_seconds": 0.5})
    rank1.publish({"written_pages": 1})

    def value(name, rank):
        return registry.get_sample_value(name, {"attn_cp_rank": str(rank), "storage_backend": "file"})

    assert value("sglang_cp_hicache:l3_written_pages_total", 0) == 5
    assert value("sglang_cp_hicache:l3_read_seconds_total", 0) == 0.5
    assert value("sglang_cp_hicache:l3_written_pages_total", 1) == 1
    text = prometheus_client.generate_latest(registry).decode()
    assert "# HELP sglang_cp_hicache:l3_written_pages_total Own pages whose KV and indexer" in text


# ---- clearing ----------------------------------------------------------------------------------


KV, IDX, OTHER = namespace(), namespace(pool="indexer", row_bytes=132), namespace(model_id="another/model")


def _filled(tmp_path, pages: int = 6):
    store = FilePageStore(tmp_path / "l3")
    keys = {ns: page_keys(hash_chain(pages, seed=i), ns) for i, ns in enumerate((KV, IDX, OTHER))}
    for ns_keys in keys.values():
        assert all(store.put(ns_keys, [b"object"] * len(ns_keys)))
    return store, keys


def test_clear_removes_exactly_the_namespaces_objects(tmp_path):
    store, keys = _filled(tmp_path)
    sub = store.path_of(keys[KV][0]).parent
    (sub / f".{keys[KV][0]}.bin.1.2.abc.tmp").write_bytes(b"a writer in flight")
    (sub / "notes.txt").write_text("not an object")
    (sub / f"{keys[KV][1]}.bin.bak").write_text("not an object name")
    wrong = "ff" if keys[KV][0][:2] != "ff" else "fe"
    misplaced = store.directory / wrong / f"{keys[KV][0]}.bin"  # a key's name where the store never keeps it
    misplaced.parent.mkdir(exist_ok=True)
    misplaced.write_bytes(b"x")
    report = clear_namespaces(store, [KV.digest(), IDX.digest()])
    assert report == ClearReport(removed=12, errors=0, detail="") and report.ok
    assert store.exists(keys[KV] + keys[IDX]) == [False] * 12
    assert store.exists(keys[OTHER]) == [True] * 6
    assert misplaced.exists()
    assert {p.name for p in sub.iterdir()} >= {f".{keys[KV][0]}.bin.1.2.abc.tmp", "notes.txt",
                                                 f"{keys[KV][1]}.bin.bak"}
    assert clear_namespaces(store, [KV.digest()]) == ClearReport(0, 0, "")  # nothing left: still ok


def test_ranks_clearing_at_once_remove_each_object_once(tmp_path):
    store, keys = _filled(tmp_path, pages=40)
    reports: list[ClearReport] = []
    threads = [threading.Thread(target=lambda: reports.append(clear_file_namespaces(store, [KV.digest()])))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.ok for r in reports) and sum(r.removed for r in reports) == 40
    assert store.exists(keys[KV]) == [False] * 40


def test_a_reader_that_opened_an_object_still_reads_it_whole(tmp_path):
    store, keys = _filled(tmp_path)
    with open(store.path_of(keys[KV][0]), "rb") as reading:
        assert clear_namespaces(store, [KV.digest()]).removed == 6
        assert reading.read() == b"object"
    assert store.get(keys[KV][:1]) == [None]  # a later reader misses


def test_an_object_that_cannot_be_removed_is_reported_not_raised(tmp_path, monkeypatch):
    store, keys = _filled(tmp_path)
    stuck = os.fspath(store.path_of(keys[KV][2]))
    unlink = os.unlink

    def refusing(path, *args, **kwargs):  # the clear removes by name, relative to the subdirectory
        if os.fspath(path) == os.path.basename(stuck):
            raise PermissionError(13, "Permission denied", stuck)
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(clear_mod.os, "unlink", refusing)
    report = clear_namespaces(store, [KV.digest()])
    assert (report.removed, report.errors, report.ok) == (5, 1, False)
    assert stuck in report.detail and "Permission denied" in report.detail


def test_a_store_that_clears_itself_is_asked_to(tmp_path):
    seen = []

    class Own:
        def clear_namespaces(self, digests):
            seen.append(list(digests))
            return ClearReport(7)

    assert clear_namespaces(Own(), [IDX.digest(), KV.digest()]) == ClearReport(7)
    assert seen == [sorted([KV.digest(), IDX.digest()])]


@pytest.mark.parametrize("digests, error", [
    ([], TypeError), ("abcd", TypeError), (["ABCDEF0123456789"], ValueError), (["abc"], ValueError),
])
def test_bad_digests_are_refused_naming_the_argument(tmp_path, digests, error):
    with pytest.raises(error, match="digests"):
        clear_namespaces(FilePageStore(tmp_path), digests)


def test_a_store_without_clearing_is_refused(tmp_path):
    with pytest.raises(TypeError, match="cannot clear namespaces"):
        clear_namespaces(object(), [KV.digest()])
