"""The shared L3 tier (:class:`HostL3Tier`) on stand-in host pools: plain
torch tensors with the attributes SGLang's MLA KV and DSA indexer host pools
have, two CP ranks over one file store."""

from __future__ import annotations

import logging

import pytest
import torch

from sglang_cp_hicache.l3.auth import UNKEYED
from sglang_cp_hicache.l3.host_tier import HostL3Tier, L3Snapshot, namespaces, open_tier_store
from sglang_cp_hicache.l3.keys import page_key
from sglang_cp_hicache.l3.store import FilePageStore
from sglang_cp_hicache.placement import CpPlacement
from tests.l3.common import hash_chain, read_chain, write_chain

P, LAYERS, KV_DIM, IDX_STRIDE, ROWS = 4, 2, 24, 4 * 12, 16 * 4
OWNERS = [0, 1, 1, 0, 0, 1]  # the chain's owners: store by these, never by page % N
POISON = 0xA5


class KvHost:
    """An MLA host pool: kv_buffer (layers, rows, kv_cache_dim) layer_first,
    (rows, layers, kv_cache_dim) page_first (a page is then a view)."""

    def __init__(self, seed: int, layout: str = "layer_first") -> None:
        shape = (LAYERS, ROWS, KV_DIM) if layout == "layer_first" else (ROWS, LAYERS, KV_DIM)
        self.kv_buffer = torch.empty(*shape, dtype=torch.float8_e4m3fn)
        self.kv_cache_dim, self.layer_num, self.layout, self.page_size = KV_DIM, LAYERS, layout, P
        _fill(self.kv_buffer, seed)

    def _rows(self, index: int) -> torch.Tensor:
        rows = self.kv_buffer.view(torch.uint8)
        return rows[:, index:index + P] if self.layout == "layer_first" else rows[index:index + P]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self._rows(index).view(self.kv_buffer.dtype)
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index: int, data: torch.Tensor) -> None:
        assert data.dtype == self.kv_buffer.dtype
        self._rows(index).copy_(data.view(torch.uint8).reshape(self._rows(index).shape))


class IndexerHost:
    """A DSA indexer host pool: index_k_with_scale_buffer (layers, pages, stride)."""

    def __init__(self, seed: int) -> None:
        self.index_k_with_scale_buffer = torch.empty(LAYERS, ROWS // P, IDX_STRIDE, dtype=torch.uint8)
        self.indexer_page_stride_size, self.layer_num, self.page_size = IDX_STRIDE, LAYERS, P
        _fill(self.index_k_with_scale_buffer, seed)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.index_k_with_scale_buffer[:, index // P]
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index: int, data: torch.Tensor) -> None:
        self.index_k_with_scale_buffer[:, index // P] = data.reshape(LAYERS, IDX_STRIDE)


def _fill(buf: torch.Tensor, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))


def _poisoned(host):
    host_buffer = host.kv_buffer if isinstance(host, KvHost) else host.index_k_with_scale_buffer
    host_buffer.view(torch.uint8).fill_(POISON)
    return host


HASHES = hash_chain(len(OWNERS), seed=3, page_size=P)


def fake_hasher(tokens, prior, page_size):
    """Stands in for SGLang's get_hash_str: one hash per whole page."""
    assert prior is None and page_size == P and len(tokens) % P == 0
    return HASHES[: len(tokens) // P]


def shifted_row(slot: int) -> int:
    """A release whose host row of slot ``s`` is ``s + 8 * P`` (the row hook)."""
    return slot + 8 * P


def _tier(store, rank: int, seed: int, host_row=None, poisoned: bool = False,
          layout: str = "layer_first", seal=UNKEYED) -> HostL3Tier:
    kv, idx = KvHost(seed, layout), IndexerHost(seed + 1000)
    if poisoned:
        _poisoned(kv), _poisoned(idx)
    return HostL3Tier(store, CpPlacement(P, 2, rank), kv, idx, model_id="tiny/dsa", page_hasher=fake_hasher,
                      host_row=host_row, seal=seal)


def _own_slots(rank: int) -> list[int]:
    """This rank's own pages at host slots 0, P, 2P, ... in chain order."""
    return [j * P for j in range(sum(o == rank for o in OWNERS))]


def _own_indices(rank: int) -> list[int]:
    return [i for i, o in enumerate(OWNERS) if o == rank]


def _page(tier: HostL3Tier, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    kv = tier.kv_host.get_data_page(row).reshape(-1).contiguous().view(torch.uint8).clone()
    idx = tier.indexer_host.get_data_page(row).reshape(-1).contiguous().view(torch.uint8).clone()
    return kv, idx


@pytest.fixture
def written(tmp_path):
    """Both ranks stored their own pages of the chain; returns (store, writers)."""
    store = FilePageStore(tmp_path / "l3")
    writers = [_tier(store, r, seed=10 + r) for r in range(2)]
    for rank, tier in enumerate(writers):
        assert write_chain(tier, HASHES, OWNERS, _own_slots(rank)) == len(_own_indices(rank))
    return store, writers


def _keys(tier: HostL3Tier, index: int) -> tuple[str, str]:
    parent = HASHES[index - 1] if index else None  # the chain starts at the root
    return page_key(HASHES[index], tier.kv_ns, parent), page_key(HASHES[index], tier.indexer_ns, parent)


def test_each_rank_stores_exactly_its_own_pages(written, tmp_path):
    store, writers = written
    files = sorted(p.name for p in store.directory.rglob("*.bin"))
    assert files == sorted(f"{k}.bin" for i in range(len(OWNERS)) for k in _keys(writers[0], i))
    for rank, tier in enumerate(writers):
        assert (tier.counters.written_pages, tier.counters.write_failures) == (len(_own_indices(rank)), 0)
    with pytest.raises(ValueError, match=r"one host slot per owned page \(3\), got 2"):
        writers[0].snapshot_pages(HASHES, OWNERS, [0, P])
    short = _tier(FilePageStore(tmp_path / "other"), 0, seed=1)
    assert write_chain(short, HASHES, OWNERS, [0, P]) == 0  # the writer never raises: it counts
    assert (short.counters.write_failures, short.counters.written_pages) == (3, 0)
    assert list((tmp_path / "other").rglob("*.bin")) == []


def test_a_reader_reads_its_own_pages_bit_exact_into_its_host_pools(written):
    store, writers = written
    for rank in range(2):
        reader = _tier(store, rank, seed=99, poisoned=True)
        assert reader.query_pages(HASHES, OWNERS) == len(OWNERS)
        odd_rows = [2 * j * P + P for j in range(len(_own_indices(rank)))]
        assert read_chain(reader, HASHES, OWNERS, odd_rows) == len(OWNERS)
        for j, row in enumerate(odd_rows):
            want_kv, want_idx = _page(writers[rank], j * P)
            assert [torch.equal(a, b) for a, b in zip(_page(reader, row), (want_kv, want_idx))] == [True] * 2
        poison = torch.full_like(want_kv, POISON)
        assert torch.equal(_page(reader, 0)[0], poison)  # an even row: untouched
        assert (reader.counters.fetched_pages, reader.counters.rejected_pages) == (len(_own_indices(rank)), 0)


def test_a_flipped_object_is_refused_counted_and_stops_the_owners_prefix(written, caplog):
    store, writers = written
    kv_key = _keys(writers[1], 2)[0]  # rank 1's KV object of chain page 2
    path = store.path_of(kv_key)
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0x01
    path.write_bytes(bytes(blob))
    reader = _tier(store, 1, seed=5, poisoned=True)
    assert reader.query_pages(HASHES, OWNERS) == len(OWNERS)  # present: only the read verifies
    with caplog.at_level(logging.WARNING, logger="sglang_cp_hicache.l3"):
        assert read_chain(reader, HASHES, OWNERS, _own_slots(1)) == 2
    assert f"L3 object of {kv_key} rejected (checksum)" in caplog.text
    assert [torch.equal(a, b) for a, b in zip(_page(reader, 0), _page(writers[1], 0))] == [True] * 2  # page 1
    assert (reader.counters.rejected_pages, reader.counters.fetched_pages) == (1, 1)
    other = _tier(store, 0, seed=5)
    assert read_chain(other, HASHES, OWNERS, _own_slots(0)) == len(OWNERS)  # rank 0's pages are whole


def test_a_missing_object_is_a_miss_not_a_rejection(written, caplog):
    store, writers = written
    store.path_of(_keys(writers[0], 3)[1]).unlink()  # rank 0's indexer object of chain page 3
    reader = _tier(store, 0, seed=5)
    assert reader.query_pages(HASHES, OWNERS) == 3
    with caplog.at_level(logging.WARNING, logger="sglang_cp_hicache.l3"):
        assert read_chain(reader, HASHES, OWNERS, _own_slots(0)) == 3
    assert "rejected" not in caplog.text
    assert (reader.counters.rejected_pages, reader.counters.fetched_pages) == (0, 1)


def test_the_row_hook_places_every_read_and_write(tmp_path):
    store = FilePageStore(tmp_path / "l3")
    writer = _tier(store, 0, seed=21, host_row=shifted_row)
    slots = _own_slots(0)
    assert write_chain(writer, HASHES, OWNERS, slots) == 3
    reader = _tier(store, 0, seed=22, host_row=shifted_row, poisoned=True)
    assert read_chain(reader, HASHES, OWNERS, slots) == len(OWNERS)
    for slot in slots:
        want = _page(writer, slot + 8 * P)  # stored from the hooked row...
        assert not torch.equal(want[0], _page(writer, slot)[0])  # ...not the slot's own
        assert [torch.equal(a, b) for a, b in zip(_page(reader, slot + 8 * P), want)] == [True] * 2
    assert torch.equal(_page(reader, 0)[0], torch.full_like(want[0], POISON))  # the unhooked row: untouched


def test_a_snapshot_keeps_the_bytes_of_when_it_was_taken(tmp_path):
    store = FilePageStore(tmp_path / "l3")
    writer = _tier(store, 1, seed=31, layout="page_first")  # a KV page is a view of the pool
    slots = _own_slots(1)
    before = [_page(writer, s) for s in slots]
    snap = writer.snapshot_pages(HASHES, OWNERS, slots)
    assert isinstance(snap, L3Snapshot) and snap.hashes == HASHES and snap.owners == OWNERS
    _poisoned(writer.kv_host), _poisoned(writer.indexer_host)  # the host rows are reused
    stored = [writer.store_page(kv_key, idx_key, kv, idx)
              for (kv_key, idx_key), kv, idx in zip(writer.snapshot_keys(snap), snap.kv, snap.indexer)]
    assert stored == [True] * 3 and writer.counters.written_pages == 3
    reader = _tier(store, 1, seed=32, layout="page_first", poisoned=True)
    assert read_chain(reader, HASHES, OWNERS, slots) == len(OWNERS)
    for j, slot in enumerate(slots):
        assert [torch.equal(a, b) for a, b in zip(_page(reader, slot), before[j])] == [True] * 2


def test_page_hashes_use_the_injected_hasher_on_whole_pages_only(tmp_path):
    tier = _tier(FilePageStore(tmp_path / "l3"), 0, seed=1)
    assert tier.page_hashes(list(range(P - 1))) == []
    assert tier.page_hashes(list(range(3 * P + 2))) == HASHES[:3]
    tier.page_hasher = lambda tokens, prior, page_size: HASHES[:1]
    with pytest.raises(RuntimeError, match="gave 1 hashes for 2 pages"):
        tier.page_hashes(list(range(2 * P)))


def test_namespaces_describe_both_pools_and_refuse_a_ragged_indexer_page():
    kv, idx = namespaces("tiny/dsa", KvHost(0), IndexerHost(0), 5)
    assert (kv.pool, kv.row_bytes, kv.page_size, kv.layer_start, kv.layer_end, kv.byte_order) == (
        "kv", KV_DIM, P, 5, 5 + LAYERS, "LPD")
    assert namespaces("tiny/dsa", KvHost(0, "page_first"), IndexerHost(0), 5)[0].byte_order == "PLD"
    assert (idx.pool, idx.row_bytes, idx.byte_order) == ("indexer", IDX_STRIDE // P, "LPD")
    ragged = IndexerHost(0)
    ragged.indexer_page_stride_size = IDX_STRIDE + 1
    with pytest.raises(ValueError, match="not a whole number of 4 token rows"):
        namespaces("tiny/dsa", KvHost(0), ragged, 0)


def test_a_bad_store_names_what_chose_it():
    def refuse(backend, directory, extra_config):
        raise ValueError("nope")

    with pytest.raises(ValueError, match=r"^SRC: L3 directory unusable: nope$"):
        open_tier_store(refuse, "file", "/x", None, "SRC")
    with pytest.raises(ValueError, match=r"^--flag: L3 mooncake store unusable: nope$"):
        open_tier_store(refuse, "mooncake", None, {}, "--flag")
    seen = []
    opened = open_tier_store(lambda *a: seen.append(a) or "store", "mooncake", None, {"k": 1}, "SRC")
    assert opened == "store" and seen == [("mooncake", None, {"k": 1})]
