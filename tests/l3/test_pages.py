"""A chain through L3 end to end, one page's object at a time (what the
tier does for each own page): CP 4 writes, any CP size reads bit-exact; a
damaged or missing page on any rank is a miss for every rank from that page
on; nothing wrong is ever returned."""

import logging
import os
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sglang_cp_hicache.l3.envelope import HEADER_BYTES, pack
from sglang_cp_hicache.l3.keys import page_keys
from sglang_cp_hicache.l3.pages import PutOutcome, store_verified
from sglang_cp_hicache.l3.plan import interleaved_owners, write_plan
from sglang_cp_hicache.l3.store import FilePageStore
from tests.l3.common import check_reads, hash_chain, namespace, payload, read_own_pages, scratch, write_own_pages

NS = namespace()
NUM_PAGES = 13
HASHES = hash_chain(NUM_PAGES, seed=5)
KEYS = page_keys(HASHES, NS)
PAGES = [payload(NS, 1000 + i) for i in range(NUM_PAGES)]  # the non-CP pool's pages


def _write(store, cp_size: int, owners: list[int]) -> list[list[PutOutcome]]:
    return [write_own_pages(store, NS, KEYS, PAGES, owners, cp_size, rank) for rank in range(cp_size)]


def _read(store, cp_size: int, owners: list[int], ns=NS):
    keys = page_keys(HASHES, ns)
    results = [read_own_pages(store, ns, keys, owners, cp_size, r) for r in range(cp_size)]
    return results, min(r.usable_pages for r in results)  # the group's MIN


def _check_restored(results, agreed: int) -> None:
    check_reads(results, agreed, PAGES)


@pytest.fixture
def written(tmp_path):
    store = FilePageStore(tmp_path)
    results = _write(store, 4, interleaved_owners(2, NUM_PAGES, 4))
    assert all(all(r) for r in results)
    return store


def test_cp4_writes_each_rank_one_quarter(tmp_path):
    store = FilePageStore(tmp_path)
    owners = interleaved_owners(2, NUM_PAGES, 4)
    for rank in range(4):
        before = sum(1 for _ in tmp_path.rglob("*.bin"))
        plan = write_plan(KEYS, owners, 4, rank)
        outcomes = write_own_pages(store, NS, KEYS, PAGES, owners, 4, rank)
        assert outcomes == [PutOutcome.WRITTEN] * len(plan.page_indices)
        written = sum(1 for _ in tmp_path.rglob("*.bin")) - before
        assert written == len(plan.page_indices) == owners.count(rank)
    assert sorted(p.name for p in tmp_path.rglob("*.bin")) == sorted(f"{k}.bin" for k in KEYS)
    assert all(p.stat().st_size == HEADER_BYTES + NS.page_bytes for p in tmp_path.rglob("*.bin"))


@pytest.mark.parametrize("cp_size, base", [(1, 0), (2, 1), (3, 0), (4, 3), (8, 5)])
def test_any_cp_size_reads_what_cp4_wrote_bit_exact(written, cp_size, base):
    results, agreed = _read(written, cp_size, interleaved_owners(base, NUM_PAGES, cp_size))
    assert agreed == NUM_PAGES
    assert sum(len(r.page_indices) for r in results) == NUM_PAGES
    _check_restored(results, agreed)


@given(data=st.data())
def test_any_owner_choice_reads_bit_exact(tmp_path_factory, data):
    store = FilePageStore(tmp_path_factory.mktemp("l3"))
    _write(store, 4, interleaved_owners(0, NUM_PAGES, 4))
    cp_size = data.draw(st.integers(1, 8))
    owners = data.draw(st.lists(st.integers(0, cp_size - 1), min_size=NUM_PAGES, max_size=NUM_PAGES))
    results, agreed = _read(store, cp_size, owners)
    assert agreed == NUM_PAGES
    _check_restored(results, agreed)


def _damage(store, key: str, kind: str) -> str:
    path = store.path_of(key)
    blob = path.read_bytes()
    if kind == "deleted":
        os.unlink(path)
        return "missing"
    if kind == "truncated":
        path.write_bytes(blob[: HEADER_BYTES + 10])
        return "short"
    if kind == "bit_flip":
        path.write_bytes(blob[:-5] + bytes([blob[-5] ^ 0x10]) + blob[-4:])
        return "checksum"
    if kind == "other_model":
        other = namespace(model_id="other/model")
        path.write_bytes(pack(page_keys([key[:64]], other)[0], other, PAGES[0]))
        return "namespace"
    if kind == "other_page":
        path.write_bytes(store.path_of(KEYS[0] if key != KEYS[0] else KEYS[1]).read_bytes())
        return "key"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["deleted", "truncated", "bit_flip", "other_model", "other_page"])
@pytest.mark.parametrize("damaged", [0, 6, NUM_PAGES - 1])
def test_a_bad_page_on_one_rank_is_a_miss_for_all_from_that_page(written, kind, damaged):
    reason = _damage(written, KEYS[damaged], kind)
    results, agreed = _read(written, 2, interleaved_owners(1, NUM_PAGES, 2))
    assert agreed == damaged
    _check_restored(results, agreed)
    owner = next(r for r in results if damaged in r.page_indices)
    rejection = owner.rejections[owner.page_indices.index(damaged)]
    assert rejection is not None and rejection.reason == reason


def test_another_namespace_reads_nothing(written):
    results, agreed = _read(written, 2, interleaved_owners(0, NUM_PAGES, 2), ns=namespace(page_size=8))
    assert agreed == 0
    assert all(p is None for r in results for p in r.pages)
    assert {b.reason for r in results for b in r.rejections} == {"missing"}


class _FailingStore(FilePageStore):
    """A backend that reports one key's write as failed."""

    def __init__(self, directory, fail_key: str):
        super().__init__(directory)
        self.fail_key = fail_key

    def write_from(self, key, views):
        return key != self.fail_key and super().write_from(key, views)


def test_a_failed_write_on_one_rank_is_reported_and_later_read_as_a_miss(tmp_path, caplog):
    store = _FailingStore(tmp_path, KEYS[5])
    owners = interleaved_owners(0, NUM_PAGES, 4)
    with caplog.at_level(logging.WARNING, logger="sglang_cp_hicache.l3"):
        results = _write(store, 4, owners)
    assert results[owners[5]][write_plan(KEYS, owners, 4, owners[5]).page_indices.index(5)] is PutOutcome.FAILED
    assert sum(not ok for r in results for ok in r) == 1
    assert f"L3 write failed: {KEYS[5]}" in caplog.text
    read, agreed = _read(store, 8, interleaved_owners(3, NUM_PAGES, 8))
    assert agreed == 5
    _check_restored(read, agreed)


def test_bad_input_writes_nothing(tmp_path):
    store = FilePageStore(tmp_path)
    with pytest.raises(ValueError, match="payload"):
        store_verified(store, NS, KEYS[0], PAGES[0][:-1], scratch(NS))
    with pytest.raises(ValueError, match="payload"):
        store_verified(store, NS, KEYS[0], PAGES[0].to(torch.int16), scratch(NS))
    with pytest.raises(ValueError, match="is not a key of namespace"):
        store_verified(store, namespace(page_size=8), KEYS[0], PAGES[0], scratch(NS))
    assert list(tmp_path.rglob("*.bin")) == []


class _CountingStore(FilePageStore):
    """Records which keys were written."""

    def __init__(self, directory):
        super().__init__(directory)
        self.puts: list[str] = []

    def write_from(self, key, views):
        self.puts.append(key)
        return super().write_from(key, views)


@pytest.mark.parametrize("damage", ["flipped", "zero-filled", "symlink", "truncated", "foreign"])
def test_a_write_over_a_damaged_object_repairs_it(tmp_path, damage):
    """A flipped bit, a zero-filled file after a crash, a torn leftover,
    another namespace's object under the key: the next write of the page
    finds it unsound and replaces it; a symlink to another page's object is
    no object at all and is replaced the same way; a sound object is left
    alone."""
    store = _CountingStore(tmp_path)
    assert all(_write(store, 1, [0] * NUM_PAGES)[0])
    path = store.path_of(KEYS[3])
    blob = path.read_bytes()
    if damage == "flipped":
        flipped = bytearray(blob)
        flipped[-10] ^= 0x01
        path.write_bytes(bytes(flipped))
    elif damage == "zero-filled":
        path.write_bytes(bytes(len(blob)))
    elif damage == "symlink":
        path.unlink()
        path.symlink_to(store.path_of(KEYS[4]))
    elif damage == "truncated":
        path.write_bytes(blob[:-1])
    else:
        other = namespace(model_id="another-model")
        path.write_bytes(pack(page_keys(HASHES, other)[3], other, PAGES[3]))
    store.puts.clear()
    outcomes = _write(store, 1, [0] * NUM_PAGES)[0]
    # a link is never an object (never read, never written through): the page is simply written
    assert outcomes[3] is (PutOutcome.WRITTEN if damage == "symlink" else PutOutcome.REPAIRED)
    assert all(o is PutOutcome.KEPT for i, o in enumerate(outcomes) if i != 3)
    assert store.puts == [KEYS[3]]  # only the damaged page was written
    assert not path.is_symlink() and path.read_bytes() == blob
    assert store.path_of(KEYS[4]).read_bytes() == pack(KEYS[4], NS, PAGES[4])  # the link's target untouched
    assert _read(store, 1, [0] * NUM_PAGES)[1] == NUM_PAGES


def test_an_object_of_the_wrong_size_is_refused_unread(tmp_path):
    store = FilePageStore(tmp_path)
    _write(store, 1, [0] * NUM_PAGES)
    path = store.path_of(KEYS[2])
    with open(path, "r+b") as f:
        f.truncate(64 << 30)  # sparse: reading it would cost 64 GiB
    results, agreed = _read(store, 1, [0] * NUM_PAGES)
    assert agreed == 2 and results[0].rejections[2].reason == "long"
