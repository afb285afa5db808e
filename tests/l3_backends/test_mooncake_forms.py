"""Mooncake's settings in every form SGLang reads them -- the extra config,
``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH``, the ``MOONCAKE_*`` environment of
Mooncake's SGLang guide -- in SGLang's order and with each release's rules,
checked against the installed SGLang's own ``MooncakeStoreConfig``; where L3
lives accepts each form; what CP cannot serve is refused naming it. No
Mooncake needed (the real store is opened from these forms in
``test_mooncake_store.py``)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from sglang_cp_hicache.l3.location import l3_location
from sglang_cp_hicache.l3_backends import SGLangRules, sglang_mooncake_config
from sglang_cp_hicache.settings import MOONCAKE_SETTINGS

GIB = 1 << 30
VARS = [s.name for s in MOONCAKE_SETTINGS]


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    for name in VARS:
        monkeypatch.delenv(name, raising=False)


def config_file(tmp_path, data) -> str:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(data))
    return str(path)


# ---- the order: extra config, then the file, then the environment --------------------------------


def test_the_extra_config_wins_when_it_names_a_master(tmp_path):
    env = {"MOONCAKE_MASTER": "env:1", "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": config_file(tmp_path, {
        "master_server_address": "file:1"})}
    assert sglang_mooncake_config({"master_server_address": "extra:1"}, environ=env).master_server_address == "extra:1"
    assert sglang_mooncake_config({}, environ=env).master_server_address == "file:1"
    del env["SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"]
    assert sglang_mooncake_config(None, environ=env).master_server_address == "env:1"


def test_the_environment_form_reads_every_variable_of_the_guide():
    env = {"MOONCAKE_MASTER": "10.0.0.5:50051", "MOONCAKE_TE_META_DATA_SERVER": "http://10.0.0.5:8080/metadata",
           "MOONCAKE_GLOBAL_SEGMENT_SIZE": "8gb", "MOONCAKE_PROTOCOL": "tcp", "MOONCAKE_DEVICE": "mlx5_0",
           "LOCAL_HOSTNAME": "10.0.0.7", "MOONCAKE_TENANT_ID": " team-a ", "MOONCAKE_ENABLE_SSD_OFFLOAD": "yes",
           "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": "/nvme/mc"}
    c = sglang_mooncake_config(None, SGLangRules("0.5.18", segment_ranks=2, rank=1), env)
    assert (c.master_server_address, c.metadata_server, c.protocol, c.device_name, c.local_hostname) == (
        "10.0.0.5:50051", "http://10.0.0.5:8080/metadata", "tcp", "mlx5_0", "10.0.0.7")
    assert c.global_segment_size == 4 * GIB  # 8gb shared by the TP group's 2 ranks, as SGLang mounts it
    assert (c.tenant_id, c.enable_ssd_offload, c.ssd_offload_path) == ("team-a", True, "/nvme/mc/rank_1")
    assert sglang_mooncake_config(None, environ={**env, "MOONCAKE_LOCAL_HOSTNAME": "n7"}).local_hostname == "n7"


@pytest.mark.parametrize("release, hostname, protocol", [("0.5.18", "from-config", "rdma"),
                                                         ("0.5.23", "from-env", "tcp")])
def test_each_release_s_precedence_of_hostname_and_protocol(tmp_path, release, hostname, protocol):
    env = {"MOONCAKE_LOCAL_HOSTNAME": "from-env", "MOONCAKE_PROTOCOL": "tcp"}
    extra = {"master_server_address": "m:1", "local_hostname": "from-config"}
    for form in (extra, {}):
        if not form:
            env["SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"] = config_file(tmp_path, extra)
        c = sglang_mooncake_config(form, SGLangRules(release), env)
        assert (c.local_hostname, c.protocol) == (hostname, protocol)


def test_a_json_device_map_gives_each_rank_its_device():
    extra = {"master_server_address": "m:1", "device_name": '{"0": "mlx5_0", "1": "mlx5_1"}'}
    assert [sglang_mooncake_config(extra, SGLangRules(rank=r), {}).device_name for r in (0, 1, 2)] == [
        "mlx5_0", "mlx5_1", ""]


@pytest.mark.parametrize("size, ranks, expected", [(4 * GIB, 1, 4 * GIB), ("4gb", 4, GIB), (" 2 GB ", 1, 2 * GIB),
                                                   ("1073741824", 2, GIB // 2), (2.0 * GIB, 2, GIB),
                                                   ("64mb", 1, 64 << 20)])
def test_segment_sizes_in_sglangs_forms_shared_by_the_ranks(size, ranks, expected):
    extra = {"master_server_address": "m:1", "global_segment_size": size}
    assert sglang_mooncake_config(extra, SGLangRules(segment_ranks=ranks), {}).global_segment_size == expected


# ---- against SGLang's own reading ----------------------------------------------------------------


def _sglang_config(extra: dict):
    pytest.importorskip("sglang")
    from sglang_cp_hicache.testing.torchvision_standin import ensure_sglang_importable

    ensure_sglang_importable()
    import importlib.metadata

    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeBaseStore

    release = importlib.metadata.version("sglang")
    return MooncakeBaseStore()._load_config(SimpleNamespace(extra_config=extra)), release


FORMS = {
    "extra": ({"master_server_address": "m:1", "protocol": "tcp", "global_segment_size": "2gb",
               "local_hostname": "cfg-host", "tenant_id": "t1"}, {"MOONCAKE_LOCAL_HOSTNAME": "env-host"}),
    "extra, defaults from env": ({"master_server_address": "m:1"}, {"MOONCAKE_PROTOCOL": "tcp", "LOCAL_HOSTNAME": "h"}),
    "file": ({}, {"SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": {"master_server_address": "f:1", "device_name": "mlx5_2",
                                                          "metadata_server": "http://m:8080/metadata"}}),
    "environment": ({}, {"MOONCAKE_MASTER": "e:1", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "3221225472",
                         "MOONCAKE_PROTOCOL": "tcp", "MOONCAKE_DEVICE": "mlx5_3", "LOCAL_HOSTNAME": "legacy",
                         "MOONCAKE_TENANT_ID": "t2", "MOONCAKE_ENABLE_SSD_OFFLOAD": "true"}),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_form_reads_as_the_installed_sglang_reads_it(tmp_path, monkeypatch, form):
    extra, env = FORMS[form]
    for name, value in env.items():
        monkeypatch.setenv(name, config_file(tmp_path, value) if isinstance(value, dict) else value)
    theirs, release = _sglang_config(dict(extra))
    mine = sglang_mooncake_config(dict(extra), SGLangRules(release))  # from os.environ, as SGLang
    fields = ("master_server_address", "metadata_server", "local_hostname", "protocol", "device_name",
              "global_segment_size", "tenant_id", "enable_ssd_offload")
    assert {f: getattr(mine, f) for f in fields} == {f: getattr(theirs, f) for f in fields}


# ---- where L3 lives, and what CP refuses -----------------------------------------------------------


def test_where_l3_lives_accepts_each_form_and_names_it(tmp_path):
    loc = l3_location("mooncake", None, {"MOONCAKE_MASTER": "10.0.0.5:50051"})
    assert loc.backend == "mooncake" and loc.source == "MOONCAKE_MASTER" and loc.scheduler_driven
    path = config_file(tmp_path, {"master_server_address": "f:1"})
    loc = l3_location("mooncake", "{}", {"SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": path})
    assert loc.source == "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"
    loc = l3_location("mooncake", {"master_server_address": "x:1"}, {"MOONCAKE_MASTER": "e:1"})
    assert loc.source == "hicache_storage_backend_extra_config"


@pytest.mark.parametrize("extra, env", [
    (None, {}), ("{}", {"MOONCAKE_CLIENT": "c:1"}), ({"client_server_address": "c:1"}, {"MOONCAKE_MASTER": "e:1"}),
    (None, {"MOONCAKE_MASTER": "  "}),
])
def test_without_a_master_where_l3_lives_is_refused_naming_every_form(extra, env):
    with pytest.raises(ValueError, match=r"needs master_server_address.*SGLANG_HICACHE_MOONCAKE_CONFIG_PATH.*"
                                         r"MOONCAKE_MASTER.*client-only"):
        l3_location("mooncake", extra, env)


@pytest.mark.parametrize("extra, env, match", [
    ({"master_server_address": "m:1", "standalone_storage": True}, {}, "standalone_storage is not supported"),
    (None, {"MOONCAKE_MASTER": "m:1", "MOONCAKE_STANDALONE_STORAGE": "y"}, "standalone_storage .from the environment"),
    (None, {"MOONCAKE_MASTER": "m:1", "MOONCAKE_ENABLE_SSD_OFFLOAD": "maybe"}, "enable_ssd_offload must be a boolean"),
    (None, {"MOONCAKE_MASTER": "m:1", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "lots"}, "global_segment_size .from the env"),
    (None, {"MOONCAKE_MASTER": "m:1", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "64mb"}, "shared by 8 rank.s.: 8388608 bytes"),
    ({"client_server_address": "c:1"}, {}, "master_server_address is required under CP"),
    (None, {"SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": "/nonexistent/mc.json"}, "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH="
                                                                             "/nonexistent/mc.json: cannot read"),
])
def test_what_cp_cannot_serve_is_refused_naming_it(extra, env, match):
    with pytest.raises(ValueError, match=match):
        sglang_mooncake_config(extra, SGLangRules(segment_ranks=8), env)


@pytest.mark.parametrize("content, match", [([1], "must hold a JSON object"), ({"protocol": "tcp"}, "names neither"),
                                            ("{bad", "cannot read")])
def test_a_bad_config_file_is_refused_naming_the_variable(tmp_path, content, match):
    path = tmp_path / "mc.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match=f"SGLANG_HICACHE_MOONCAKE_CONFIG_PATH={path}: .*{match}"):
        sglang_mooncake_config(None, environ={"SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": str(path)})


def test_every_variable_is_declared_as_read_never_set():
    assert {"SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", "MOONCAKE_MASTER", "MOONCAKE_CLIENT", "MOONCAKE_LOCAL_HOSTNAME",
            "LOCAL_HOSTNAME", "MOONCAKE_TE_META_DATA_SERVER", "MOONCAKE_GLOBAL_SEGMENT_SIZE", "MOONCAKE_PROTOCOL",
            "MOONCAKE_DEVICE", "MOONCAKE_TENANT_ID"} <= set(VARS)
    assert all("read (never set)" in s.meaning for s in MOONCAKE_SETTINGS)
    assert not any(name in os.environ for name in VARS)  # this test module's fixture
