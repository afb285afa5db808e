"""The Mooncake store's settings, the backend switch, and the store's
failure paths on a stand-in client; no Mooncake needed."""

from __future__ import annotations

import json
import sys

import pytest

from sglang_cp_hicache.l3.keys import page_keys
from sglang_cp_hicache.l3.store import FilePageStore, SizeMismatch
from sglang_cp_hicache.l3_backends import MooncakeConfig, MooncakePageStore, open_page_store
from tests.l3.common import hash_chain, namespace

MASTER = "127.0.0.1:50051"


def test_defaults_are_sglangs():
    envs = pytest.importorskip("sglang.srt.environ").envs
    config = MooncakeConfig.from_extra_config({"master_server_address": MASTER})
    assert config.metadata_server == envs.MOONCAKE_TE_META_DATA_SERVER.default
    assert config.local_hostname == envs.MOONCAKE_LOCAL_HOSTNAME.default
    assert config.protocol == envs.MOONCAKE_PROTOCOL.default
    assert config.device_name == envs.MOONCAKE_DEVICE.default
    assert config.global_segment_size == 4 << 30 and envs.MOONCAKE_GLOBAL_SEGMENT_SIZE.default == "4gb"


@pytest.mark.parametrize("extra_form", [dict, json.dumps])
def test_reads_sglangs_keys(extra_form):
    extra = {"master_server_address": MASTER, "metadata_server": "http://127.0.0.1:8080/metadata",
             "local_hostname": "10.0.0.7", "protocol": "tcp", "device_name": "mlx5_0",
             "global_segment_size": "2gb", "local_buffer_size": "32mb", "file_storage_path": "/ignored",
             "check_server": True}
    config = MooncakeConfig.from_extra_config(extra_form(extra))
    assert config == MooncakeConfig(MASTER, "http://127.0.0.1:8080/metadata", "10.0.0.7", "tcp", "mlx5_0",
                                    2 << 30, 32 << 20)


@pytest.mark.parametrize("size, expected", [(16 << 20, 16 << 20), ("16777216", 16 << 20), (" 1GB ", 1 << 30),
                                            ("64mb", 64 << 20)])
def test_segment_sizes(size, expected):
    config = MooncakeConfig.from_extra_config({"master_server_address": MASTER, "global_segment_size": size})
    assert config.global_segment_size == expected


@pytest.mark.parametrize("extra, error, match", [
    (None, ValueError, "master_server_address"),
    ({}, ValueError, "master_server_address"),
    ({"client_server_address": "127.0.0.1:50052"}, ValueError, "master_server_address"),
    ("{bad", ValueError, "not JSON"),
    ("[1]", ValueError, "JSON object"),
    ({"master_server_address": "no-port"}, ValueError, "master_server_address must be host:port"),
    ({"master_server_address": ":50051"}, ValueError, "master_server_address must be host:port"),
    ({"master_server_address": 50051}, TypeError, "master_server_address must be a string"),
    ({"master_server_address": MASTER, "protocol": ""}, ValueError, "protocol must not be empty"),
    ({"master_server_address": MASTER, "global_segment_size": "1mb"}, ValueError, "global_segment_size must be at least"),
    ({"master_server_address": MASTER, "global_segment_size": "lots"}, ValueError, "global_segment_size must be a byte"),
    ({"master_server_address": MASTER, "global_segment_size": True}, TypeError, "global_segment_size"),
    ({"master_server_address": MASTER, "local_buffer_size": 0}, ValueError, "local_buffer_size must be at least"),
    ({"master_server_address": MASTER, "local_hostname": None}, TypeError, "local_hostname must be a string"),
])
def test_bad_settings_are_refused_naming_the_key(extra, error, match):
    with pytest.raises(error, match=match):
        MooncakeConfig.from_extra_config(extra)


def test_open_page_store_file(tmp_path):
    store = open_page_store("file", tmp_path / "l3", {"master_server_address": MASTER})
    assert isinstance(store, FilePageStore) and store.directory == tmp_path / "l3"


@pytest.mark.parametrize("backend, directory, match", [
    ("file", None, "directory is required"),
    ("nixl", "/tmp/x", "backend must be 'file' or 'mooncake'"),
    ("Mooncake", None, "backend must be"),
])
def test_open_page_store_refuses_naming_the_argument(backend, directory, match):
    with pytest.raises(ValueError, match=match):
        open_page_store(backend, directory, None)


def test_mooncake_store_bad_extra_config_fails_before_any_import(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(ValueError, match="master_server_address"):
        open_page_store("mooncake", None, {})


def test_without_the_package_the_error_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import fails as if not installed
    with pytest.raises(ImportError, match="needs the mooncake package .*mooncake-transfer-engine"):
        MooncakePageStore(MooncakeConfig(MASTER))
    with pytest.raises(TypeError, match="config must be a MooncakeConfig"):
        MooncakePageStore({"master_server_address": MASTER})


class _StandIn:
    """Mooncake's client calls on a dict, with the failures Mooncake reports:
    ``fail_keys`` cannot be written (a batch holding one fails whole, code
    -600, as Mooncake's does); ``broken``: every call raises."""

    def __init__(self, fail_keys=(), broken=False):
        self.objects: dict[str, bytes] = {}
        self.fail_keys = set(fail_keys)
        self.broken = broken
        self.batches: list[list[str]] = []

    def _check(self):
        if self.broken:
            raise RuntimeError("connection reset")

    def batch_is_exist(self, keys):
        self._check()
        return [1 if k in self.objects else 0 for k in keys]

    def get_batch(self, keys):
        self._check()
        return [self.objects.get(k, b"") for k in keys]

    def get_size(self, key):
        self._check()
        return len(self.objects[key]) if key in self.objects else -704

    def upsert_batch(self, keys, blobs):
        self._check()
        self.batches.append(list(keys))
        if self.fail_keys & set(keys):
            return -600
        self.objects.update(zip(keys, blobs))
        return 0

    def upsert(self, key, blob):
        return self.upsert_batch([key], [blob])

    def close(self):
        pass


def _keys(n):
    return page_keys(hash_chain(n, seed=3), namespace())


def test_a_failed_batch_is_retried_per_object_and_only_the_failure_is_false(caplog):
    keys = _keys(4)
    client = _StandIn(fail_keys={keys[2]})
    store = MooncakePageStore(MooncakeConfig(MASTER), client=client)
    with caplog.at_level("WARNING", logger="sglang_cp_hicache"):
        assert store.put(keys, [b"a", b"b", b"c", b"d"]) == [True, True, False, True]
    assert f"cannot write {keys[2]}" in caplog.text
    assert store.get(keys) == [b"a", b"b", None, b"d"]
    assert store.exists(keys) == [True, True, False, True]


def test_a_put_replaces_what_is_there():
    """Deciding to keep a sound object is the writer's (pages.store_owned
    verifies it first); the store upserts."""
    keys = _keys(3)
    client = _StandIn()
    client.objects = {keys[0]: b"old!", keys[1]: b"short"}
    store = MooncakePageStore(MooncakeConfig(MASTER), client=client)
    assert store.put(keys, [b"new!", b"longer one", b"x"]) == [True, True, True]
    assert client.objects == {keys[0]: b"new!", keys[1]: b"longer one", keys[2]: b"x"}
    assert client.batches == [keys]


def test_reads_go_in_batches_that_fit_the_staging_buffer_and_sizes_are_checked():
    keys = _keys(5)
    client = _StandIn()
    buffer = 16 << 20
    client.objects = {k: bytes(buffer // 3) for k in keys[:4]}
    client.objects[keys[4]] = b"x"
    reads = []
    get_batch = client.get_batch
    client.get_batch = lambda ks: (reads.append(list(ks)), get_batch(ks))[1]
    store = MooncakePageStore(MooncakeConfig(MASTER, local_buffer_size=buffer), client=client)
    got = store.get(keys, [buffer // 3] * 5)
    assert reads == [keys[0:3], keys[3:5]]  # three objects fill the buffer, the rest go next
    assert got[:4] == [bytes(buffer // 3)] * 4 and got[4] == SizeMismatch(1)
    reads.clear()
    assert store.get(keys[:2]) == [bytes(buffer // 3)] * 2 and reads == [keys[:1], keys[1:2]]  # sizes unknown
    reads.clear()
    assert store.get(keys[:1], [buffer + 1]) == [None] and reads == []  # larger than the buffer: never fetched


def test_batches_fit_the_staging_buffer():
    keys = _keys(5)
    client = _StandIn()
    buffer = 16 << 20
    store = MooncakePageStore(MooncakeConfig(MASTER, local_buffer_size=buffer), client=client)
    sizes = [buffer // 2, buffer // 2, 1, buffer, buffer + 1]
    assert store.put(keys, [bytes(n) for n in sizes]) == [True] * 5  # the stand-in has no size limit
    assert client.batches == [keys[0:2], keys[2:3], keys[3:4], keys[4:5]]


def test_a_broken_store_is_a_miss_and_a_failed_write_never_an_exception(caplog):
    keys = _keys(2)
    store = MooncakePageStore(MooncakeConfig(MASTER), client=_StandIn(broken=True))
    with caplog.at_level("WARNING", logger="sglang_cp_hicache"):
        assert store.exists(keys) == [False, False]
        assert store.get(keys) == [None, None]
        assert store.put(keys, [b"a", b"b"]) == [False, False]
    assert "connection reset" in caplog.text


def test_a_closed_store_says_so():
    store = MooncakePageStore(MooncakeConfig(MASTER), client=_StandIn())
    store.close()
    store.close()  # twice is fine
    for call in (lambda: store.exists(_keys(1)), lambda: store.get(_keys(1)), lambda: store.put(_keys(1), [b"a"])):
        with pytest.raises(RuntimeError, match="closed"):
            call()
