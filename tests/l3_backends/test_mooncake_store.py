"""The L3 on a real Mooncake store (master + metadata on loopback, TCP):
every rank its own client; CP 4 writes, CP 2 and CP 1 read bit-exact through
the core's store/fetch; damaged, foreign or missing objects are misses from
that page on, never restored; a failed write is False and logged.

Skipped where the mooncake package is not installed, except under CI (the
environment variable ``CI`` set), where that is a failure."""

from __future__ import annotations

import logging
import os

import pytest
import torch

try:
    import mooncake.store  # noqa: F401  (loads the native client: libibverbs must be present)

    MOONCAKE_ERROR = None
except (ImportError, OSError) as exc:
    MOONCAKE_ERROR = f"{type(exc).__name__}: {exc}"

if MOONCAKE_ERROR is not None:
    WHY = (f"mooncake is not importable ({MOONCAKE_ERROR}); install requirements/mooncake.txt "
           "(and the system's libibverbs1)")
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(f"under CI the Mooncake tests must run: {WHY}", pytrace=False)
    pytest.skip(WHY, allow_module_level=True)

from sglang_cp_hicache.l3.capabilities import StoreCapabilities
from sglang_cp_hicache.l3.envelope import HEADER_BYTES, pack, unpack
from sglang_cp_hicache.l3.keys import page_keys
from sglang_cp_hicache.l3.pages import PutOutcome
from sglang_cp_hicache.l3.plan import interleaved_owners
from sglang_cp_hicache.l3.store import PageStore
from sglang_cp_hicache.l3_backends import MooncakePageStore, open_page_store
from tests.l3.common import check_reads, hash_chain, namespace, payload, read_own_pages, write_own_pages
from tests.l3_backends.mooncake_cluster import master_binary, start_cluster

NS = namespace()
NUM_PAGES = 13


class Chain:
    """A chain of pages with its keys, distinct per test (a fresh seed)."""

    def __init__(self, seed: int, ns=NS) -> None:
        self.ns = ns
        self.keys = page_keys(hash_chain(NUM_PAGES, seed=seed), ns)
        self.pages = [payload(ns, seed * 100 + i) for i in range(NUM_PAGES)]

    def write(self, stores, owners, skip=()) -> list[list[PutOutcome]]:
        """Each rank stores its own pages through its own client."""
        return [write_own_pages(store, self.ns, self.keys, self.pages, owners, len(stores), rank, skip)
                for rank, store in enumerate(stores)]

    def read(self, stores, owners):
        results = [read_own_pages(s, self.ns, self.keys, owners, len(stores), r) for r, s in enumerate(stores)]
        return results, min(r.usable_pages for r in results)  # the group's MIN

    def check_restored(self, results, agreed: int) -> None:
        check_reads(results, agreed, self.pages)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A master, peer-to-peer handshake metadata (SGLang's default), and 4
    clients, one per rank (closing a client takes Mooncake about 2 s)."""
    binary = master_binary()
    assert binary is not None, "the mooncake package ships no mooncake_master"
    cl = start_cluster(binary, tmp_path_factory.mktemp("mooncake"), http_metadata=False)
    try:
        for _ in range(4):
            cl.open_store()
        yield cl
    finally:
        cl.stop()


def test_round_trip_and_misses(cluster):
    a, b = cluster.stores[:2]
    assert isinstance(a, PageStore)
    chain = Chain(seed=1)
    blobs = [pack(k, NS, p) for k, p in zip(chain.keys[:3], chain.pages[:3])]
    assert a.get([]) == [] and a.exists([]) == [] and a.put([], []) == []
    assert b.exists(chain.keys[:3]) == [False] * 3 and b.get(chain.keys[:3]) == [None] * 3
    assert a.put(chain.keys[:2], blobs[:2]) == [True, True]
    assert b.exists(chain.keys[:3]) == [True, True, False]
    got = b.get(chain.keys[:3])
    assert got[:2] == blobs[:2] and got[2] is None
    assert b.put(chain.keys[:3], blobs) == [True] * 3  # the first two are already there
    assert a.get([chain.keys[2]]) == [blobs[2]]


def test_cp4_writes_cp2_and_cp1_read_bit_exact(cluster):
    chain = Chain(seed=2)
    writers = cluster.stores[:4]
    results = chain.write(writers, interleaved_owners(2, NUM_PAGES, 4))
    assert [len(r) for r in results] == [3, 3, 4, 3] and all(all(r) for r in results)
    # CP 2 and CP 1 on other clients than most of the pages' writers
    for readers, base in ((cluster.stores[2:4], 1), (cluster.stores[1:2], 0), (cluster.stores[3:4], 0)):
        read, agreed = chain.read(readers, interleaved_owners(base, NUM_PAGES, len(readers)))
        assert agreed == NUM_PAGES
        assert sum(len(r.page_indices) for r in read) == NUM_PAGES
        chain.check_restored(read, agreed)


def _damaged(chain: Chain, index: int, kind: str) -> tuple[bytes, str]:
    good = pack(chain.keys[index], NS, chain.pages[index])
    if kind == "truncated":
        return good[: HEADER_BYTES + 10], "short"
    if kind == "bit_flip":
        return good[:-5] + bytes([good[-5] ^ 0x10]) + good[-4:], "checksum"
    if kind == "other_model":
        other = namespace(model_id="other/model")
        return pack(page_keys([chain.keys[index][:64]], other)[0], other, chain.pages[index]), "namespace"
    if kind == "other_page":
        j = 0 if index else 1
        return pack(chain.keys[j], NS, chain.pages[j]), "key"
    raise AssertionError(kind)


KINDS = ["truncated", "bit_flip", "other_model", "other_page"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_object_is_a_miss_from_that_page_never_restored(cluster, kind):
    chain = Chain(seed=10 + KINDS.index(kind))
    damaged = 6
    owners_w = interleaved_owners(0, NUM_PAGES, 4)
    chain.write(cluster.stores[:4], owners_w, skip={damaged})
    blob, reason = _damaged(chain, damaged, kind)
    owner = cluster.stores[owners_w[damaged]]
    assert owner.put([chain.keys[damaged]], [blob]) == [True]  # the store takes it: it does not judge
    read, agreed = chain.read(cluster.stores[1:3], interleaved_owners(1, NUM_PAGES, 2))
    assert agreed == damaged
    chain.check_restored(read, agreed)
    holder = next(r for r in read if damaged in r.page_indices)
    assert holder.rejections[holder.page_indices.index(damaged)].reason == reason
    if kind == "truncated":  # another size under the key: the owner's next write replaces it
        chain.write(cluster.stores[:4], owners_w)
        read, agreed = chain.read(cluster.stores[3:4], [0] * NUM_PAGES)
        assert agreed == NUM_PAGES
        chain.check_restored(read, agreed)


@pytest.mark.parametrize("missing", [0, 7, NUM_PAGES - 1])
def test_a_missing_object_is_a_miss_on_its_owner_and_the_prefix_stops_there(cluster, missing):
    chain = Chain(seed=20 + missing)
    chain.write(cluster.stores[:4], interleaved_owners(3, NUM_PAGES, 4), skip={missing})
    owners = interleaved_owners(0, NUM_PAGES, 2)
    read, agreed = chain.read(cluster.stores[2:4], owners)
    assert agreed == missing
    holder = read[owners[missing]]
    assert holder.usable_pages == missing
    assert holder.rejections[holder.page_indices.index(missing)].reason == "missing"
    other = read[1 - owners[missing]]
    assert other.usable_pages > missing  # the other rank's own pages were fine
    chain.check_restored(read, agreed)


def test_a_failed_write_is_false_and_logged_and_the_rest_is_written(cluster, caplog):
    store = cluster.stores[0]
    chain = Chain(seed=30)
    small = [pack(k, NS, p) for k, p in zip(chain.keys[:3], chain.pages[:3])]
    too_big = bytes(store.config.local_buffer_size + 1)  # larger than the staging buffer
    with caplog.at_level(logging.WARNING, logger="sglang_cp_hicache"):
        ok = store.put(chain.keys[:3], [small[0], too_big, small[2]])
    assert ok == [True, False, True]
    assert f"cannot write {chain.keys[1]}" in caplog.text
    assert cluster.stores[1].get(chain.keys[:3]) == [small[0], None, small[2]]


def test_bad_input_raises_naming_the_argument_and_writes_nothing(cluster):
    store = cluster.stores[0]
    chain = Chain(seed=40)
    blob = pack(chain.keys[0], NS, chain.pages[0])
    with pytest.raises(TypeError, match="keys"):
        store.put(chain.keys[0], [blob])
    with pytest.raises(ValueError, match="blobs"):
        store.put(chain.keys[:2], [blob])
    with pytest.raises(ValueError, match=r"blobs\[1\] is empty"):
        store.put(chain.keys[:2], [blob, b""])
    with pytest.raises(ValueError, match=r"keys\[0\]"):
        store.get(["not-a-key"])
    assert store.exists(chain.keys[:2]) == [False, False]


def test_open_page_store_on_the_http_metadata_server(tmp_path):
    """The master's HTTP metadata server; a store opened from the extra
    config as a server would (keys of other backends ignored)."""
    cl = start_cluster(master_binary(), tmp_path, http_metadata=True)
    try:
        config = cl.config()
        extra = {"master_server_address": config.master_server_address, "metadata_server": config.metadata_server,
                 "local_hostname": config.local_hostname, "protocol": "tcp", "global_segment_size": "16mb",
                 "file_storage_path": "/not/used"}
        store = open_page_store("mooncake", None, extra)
        cl.stores.append(store)
        assert isinstance(store, MooncakePageStore) and store.config == config
        chain = Chain(seed=60)
        assert all(chain.write([store], [0] * NUM_PAGES)[0])
        read, agreed = chain.read([store], [0] * NUM_PAGES)
        assert agreed == NUM_PAGES
        chain.check_restored(read, agreed)
    finally:
        cl.stop()


def test_a_40_page_chain_of_deepseek_pages_restores_whole_through_the_default_staging_buffer(cluster):
    """DeepSeek-V3.2 KV pages (61 layers x 64 tokens x 656 B = 2.44 MiB) and
    Mooncake's default 16 MiB staging buffer: a read of the whole chain goes
    in batches that fit the buffer (6 objects each), so all 40 pages come
    back, bit-exact, instead of the first 6."""
    ns = namespace(row_bytes=656, page_size=64, layer_end=61)
    assert ns.page_bytes == 2_561_024
    keys = page_keys(hash_chain(40, seed=40, page_size=64), ns)
    pages = [torch.full((ns.page_bytes,), i, dtype=torch.uint8) for i in range(40)]
    store = cluster.open_store(global_segment_size=256 << 20)  # the default buffer: 16 MiB
    assert store.config.local_buffer_size == 16 << 20
    assert all(write_own_pages(store, ns, keys, pages, [0] * 40, 1, 0))
    blobs = cluster.stores[0].get(keys, [HEADER_BYTES + ns.page_bytes] * 40)  # one call: batched to fit
    assert [torch.equal(unpack(key, ns, blob), page) for key, blob, page in zip(keys, blobs, pages)] == [True] * 40


def test_a_write_over_a_damaged_object_repairs_it(cluster):
    chain = Chain(seed=9)
    store = cluster.stores[0]
    assert all(chain.write([store], [0] * NUM_PAGES)[0])
    bad, _ = _damaged(chain, 4, "bit_flip")
    assert store.put([chain.keys[4]], [bad]) == [True]
    outcomes = chain.write([store], [0] * NUM_PAGES)[0]
    assert [o.value for o in outcomes].count("repaired") == 1 and outcomes[4].value == "repaired"
    read, agreed = chain.read([cluster.stores[1]], [0] * NUM_PAGES)
    assert agreed == NUM_PAGES
    chain.check_restored(read, agreed)


def test_reads_in_place_into_registered_buffers_and_writes_in_parts(cluster):
    """The copy-free path: a reader's registered buffers are filled in place
    (header and page in one transfer), a writer sends header and page as the
    parts of one object; unregistered buffers go through the copying path.
    Both give the same bytes; misses and wrong sizes are said as such."""
    from sglang_cp_hicache.l3.envelope import byte_view
    from sglang_cp_hicache.l3.pages import read_verified, store_verified
    from sglang_cp_hicache.l3.store import SizeMismatch

    chain = Chain(seed=71)  # a chain no other test of the module writes
    store = cluster.stores[0]
    scratch = (memoryview(bytearray(HEADER_BYTES)), memoryview(bytearray(NS.page_bytes)))
    for key, page in zip(chain.keys, chain.pages):
        assert store_verified(StoreCapabilities.of(store), NS, key, page, scratch).value == "written"  # write_from: parts
    head, page = bytearray(HEADER_BYTES), torch.empty(NS.page_bytes, dtype=torch.uint8)
    views = [memoryview(head), byte_view(page)]
    reader = cluster.stores[1]
    assert reader.read_into(chain.keys[3], HEADER_BYTES + NS.page_bytes, views) == HEADER_BYTES + NS.page_bytes
    assert torch.equal(page, chain.pages[3])  # copying path (not registered)
    assert reader.register_buffers(views)
    page.zero_()
    assert read_verified(StoreCapabilities.of(reader), NS, chain.keys[4], *views) is None  # in place
    assert torch.equal(page, chain.pages[4])
    missing = page_keys(hash_chain(1, seed=99), NS)[0]
    assert reader.read_into(missing, HEADER_BYTES + NS.page_bytes, views) is None
    short = bytes(pack(chain.keys[5], NS, chain.pages[5]))[:-3]
    assert store.put([chain.keys[5]], [short]) == [True]
    assert reader.read_into(chain.keys[5], HEADER_BYTES + NS.page_bytes, views) == SizeMismatch(len(short))
    reader.unregister_buffers(views)  # freed staging: never read into in place again
    assert reader.unregister_buffers(views) is None  # a second time: nothing left to release
    page.zero_()
    assert read_verified(StoreCapabilities.of(reader), NS, chain.keys[6], *views) is None  # the copying path again
    assert torch.equal(page, chain.pages[6])


def test_with_a_secret_a_forged_object_in_the_store_is_refused_and_counted(cluster):
    """Anyone with a client of the store can upsert under a page's key. With
    a deployment secret, an object whose payload was replaced and whose
    checksum was recomputed (all an unkeyed reader checks) fails its MAC:
    that page and the chain after it are misses, never restored."""
    import xxhash

    from sglang_cp_hicache.l3.auth import ObjectSeal
    from sglang_cp_hicache.l3.envelope import TAG_OFFSET

    keyed = namespace(seal=ObjectSeal.keyed(os.urandom(32)))
    chain = Chain(seed=73, ns=keyed)
    owners = interleaved_owners(0, NUM_PAGES, 2)
    assert all(all(r) for r in chain.write(cluster.stores[:2], owners))
    good = bytes(pack(chain.keys[4], keyed, chain.pages[4]))
    fake = payload(keyed, 666).numpy().tobytes()
    forged = good[:TAG_OFFSET] + xxhash.xxh3_64_intdigest(fake).to_bytes(8, "little") + bytes(24) + fake
    assert cluster.stores[2].put([chain.keys[4]], [forged]) == [True]
    read, agreed = chain.read(cluster.stores[2:4], owners)
    assert agreed == 4
    assert [r.reason for res in read for r in res.rejections if r is not None] == ["mac"]
    chain.check_restored(read, agreed)


def test_clear_removes_this_deployments_namespaces_from_the_whole_store_and_nothing_else(cluster):
    """Two clients (ranks) wrote KV and indexer objects of one deployment;
    another namespace's objects and a key of SGLang's own form share the
    store. Every rank's clear (alike) removes the deployment's objects
    wherever they are mounted, each once, even those just read; the others
    stay."""
    from sglang_cp_hicache.l3.clear import clear_namespaces

    # namespaces of this test alone (the module's other tests share the store)
    kv, idx = namespace(model_id="clear/me"), namespace(model_id="clear/me", pool="indexer", row_bytes=132)
    other = namespace(model_id="another/model")
    stores = cluster.stores[:2]
    ours = {ns: Chain(900 + i, ns) for i, ns in enumerate((kv, idx))}
    theirs = Chain(950, other)
    for chain in (*ours.values(), theirs):
        chain.write(stores, interleaved_owners(0, NUM_PAGES, 2))
    sglang_key = "deepseek-ai-DeepSeek-V3.2_" + "f" * 64  # not a page key: the raw client writes it
    assert stores[0]._client.put(sglang_key, b"sglang's own object") == 0
    # Just looked up and read: under Mooncake's read lease, which the clear overrides.
    assert stores[1].exists(ours[kv].keys) == [True] * NUM_PAGES and stores[1].get(ours[kv].keys[:1])[0]
    reports = [clear_namespaces(store, [kv.digest(), idx.digest()]) for store in stores]
    assert all(r.ok for r in reports) and sum(r.removed for r in reports) == 2 * NUM_PAGES
    for store in stores:
        assert store.exists(ours[kv].keys + ours[idx].keys) == [False] * (2 * NUM_PAGES)
        assert store.exists(theirs.keys) == [True] * NUM_PAGES
    assert stores[1]._client.is_exist(sglang_key) == 1
    with pytest.raises(ValueError, match="digests"):
        stores[0].clear_namespaces([".*"])


@pytest.mark.parametrize("form", ["environment", "config file"])
def test_the_store_opens_from_mooncakes_environment_and_config_file(cluster, tmp_path, monkeypatch, form):
    """``--hicache-storage-backend mooncake`` with no extra config: the
    master and the rest from ``MOONCAKE_*`` (Mooncake's SGLang guide) or
    from the JSON file ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH`` names."""
    import json

    from sglang_cp_hicache.l3.location import l3_location

    values = {"master_server_address": f"127.0.0.1:{cluster.rpc_port}", "metadata_server": cluster.metadata_server,
              "local_hostname": "127.0.0.1", "protocol": "tcp", "global_segment_size": str(16 << 20)}
    if form == "environment":
        for key, var in (("master_server_address", "MOONCAKE_MASTER"), ("metadata_server",
                         "MOONCAKE_TE_META_DATA_SERVER"), ("local_hostname", "MOONCAKE_LOCAL_HOSTNAME"),
                         ("protocol", "MOONCAKE_PROTOCOL"), ("global_segment_size", "MOONCAKE_GLOBAL_SEGMENT_SIZE")):
            monkeypatch.setenv(var, values[key])
    else:
        path = tmp_path / "mooncake.json"
        path.write_text(json.dumps(values))
        monkeypatch.setenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", str(path))
    location = l3_location("mooncake", None)
    assert location.source == ("MOONCAKE_MASTER" if form == "environment" else "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH")
    store = open_page_store(location.backend, location.directory, location.extra_config)
    try:
        chain = Chain(seed=77)
        blob = pack(chain.keys[0], NS, chain.pages[0])
        assert store.put(chain.keys[:1], [blob]) == [True]
        assert cluster.stores[0].get(chain.keys[:1]) == [blob]  # another client of the same store sees it
    finally:
        store.close()
