"""Where the L3 lives: the flag, the settings and SGLang's file-backend rules."""

import pytest

from sglang_cp_hicache.l3.location import DEFAULT_FILE_DIR, l3_location

OWN = "SGLANG_CP_HICACHE_L3_DIR"
SG = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"


def test_no_flag_no_setting_is_off():
    loc = l3_location(None, None, {})
    assert loc.directory is None and not loc.scheduler_driven


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


@pytest.mark.parametrize("backend", ["mooncake", "hf3fs", "nixl", "dynamic", "File"])
def test_other_backends_are_refused_naming_the_flag(backend):
    with pytest.raises(ValueError, match=r"--hicache-storage-backend '%s'.*use one of file" % backend):
        l3_location(backend, None, {})


@pytest.mark.parametrize("extra", ["{not json", "[1, 2]", '{"file_storage_path": 3}'])
def test_bad_extra_config_is_refused(extra):
    with pytest.raises(ValueError, match="extra_config|file_storage_path"):
        l3_location("file", extra, {})
