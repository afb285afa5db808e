"""Where the L3 lives: the flag, the settings and SGLang's file-backend rules."""

import json

import pytest

from sglang_cp_hicache.l3.location import DEFAULT_FILE_DIR, l3_location

OWN = "SGLANG_CP_HICACHE_L3_DIR"
SG = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"


def test_no_flag_no_setting_is_off():
    loc = l3_location(None, None, {})
    assert loc.directory is None and not loc.scheduler_driven
    assert loc.backend == "file" and not loc.enabled


def test_the_setting_alone_switches_l3_on_without_the_scheduler():
    loc = l3_location(None, None, {OWN: " /shared/l3 "})
    assert loc.directory == "/shared/l3" and not loc.scheduler_driven and loc.source == OWN


def test_file_backend_precedence():
    extra = '{"file_storage_path": "/from/extra"}'
    assert l3_location("file", extra, {OWN: "/own", SG: "/sg"}).directory == "/own"
    assert l3_location("file", extra, {SG: "/sg"}).directory == "/sg"
    assert l3_location("file", extra, {}).directory == "/from/extra"
    assert l3_location("file", {"file_storage_path": "/d"}, {}).directory == "/d"
    loc = l3_location("file", None, {})
    assert loc.directory == DEFAULT_FILE_DIR and loc.scheduler_driven and loc.source == "default"
    assert loc.backend == "file" and loc.enabled
    assert l3_location(None, None, {OWN: "/own"}).backend == "file"


MC = {"master_server_address": "127.0.0.1:50051", "protocol": "tcp"}


@pytest.mark.parametrize("extra", [MC, json.dumps(MC)])
def test_mooncake_needs_no_directory(extra):
    loc = l3_location("mooncake", extra, {})
    assert loc.backend == "mooncake" and loc.enabled and loc.scheduler_driven
    assert loc.directory is None
    assert loc.source == "hicache_storage_backend_extra_config"
    assert loc.extra_config == MC


def test_mooncake_ignores_the_file_store_settings():
    env = {OWN: "/own", SG: "/sg"}
    loc = l3_location("mooncake", {**MC, "file_storage_path": "/d"}, env)
    assert loc.backend == "mooncake" and loc.directory is None


@pytest.mark.parametrize("extra", [None, "", "{}", {"master_server_address": ""}, {"master_server_address": 5},
                                   {"client_server_address": "127.0.0.1:50052"}])
def test_mooncake_without_a_master_is_refused_naming_the_flag(extra):
    with pytest.raises(ValueError, match=r"--hicache-storage-backend mooncake .* needs master_server_address"):
        l3_location("mooncake", extra, {})


@pytest.mark.parametrize("backend", ["hf3fs", "nixl", "dynamic", "File", "Mooncake", "mooncake_store"])
def test_other_backends_are_refused_naming_the_flag(backend):
    with pytest.raises(ValueError, match=r"--hicache-storage-backend '%s'.*use one of file, mooncake" % backend):
        l3_location(backend, None, {})


@pytest.mark.parametrize("backend", ["file", "mooncake"])
@pytest.mark.parametrize("extra", ["{not json", "[1, 2]", '{"file_storage_path": 3}'])
def test_bad_extra_config_is_refused(backend, extra):
    if backend == "mooncake" and "file_storage_path" in extra:
        extra = '{"master_server_address": 3}'
    with pytest.raises(ValueError, match="extra_config|file_storage_path|needs master_server_address"):
        l3_location(backend, extra, {})
