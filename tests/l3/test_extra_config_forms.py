"""``--hicache-storage-backend-extra-config`` in every form SGLang accepts
(a JSON object, ``@path`` to a .json / .toml / .yaml / .yml file), read as
the installed SGLang reads it -- checked against SGLang's own parser -- and
refused, naming the argument, wherever SGLang refuses it."""

from __future__ import annotations

import json

import pytest

from sglang_cp_hicache.l3.location import SGLANG_PREFETCH_KEYS, l3_location, parse_extra_config

CONFIG = {"file_storage_path": "/shared/l3", "prefetch_timeout_base": 3, "prefetch_threshold": 128,
          "master_server_address": "10.0.0.5:50051", "global_segment_size": "8gb", "nested": {"a": [1, 2]}}
TOML = '''file_storage_path = "/shared/l3"
prefetch_timeout_base = 3
prefetch_threshold = 128
master_server_address = "10.0.0.5:50051"
global_segment_size = "8gb"
[nested]
a = [1, 2]
'''
YAML = '''file_storage_path: /shared/l3
prefetch_timeout_base: 3
prefetch_threshold: 128
master_server_address: "10.0.0.5:50051"
global_segment_size: 8gb
nested:
  a: [1, 2]
'''


def sglang_parse(text: str) -> dict:
    """The installed SGLang's own reading of the flag (0.5.23's static
    parser, or 0.5.18's cache method), prefetch keys taken out as it does."""
    pytest.importorskip("sglang")
    from sglang_cp_hicache.testing.torchvision_standin import ensure_sglang_importable

    ensure_sglang_importable()
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    parse = getattr(HybridCacheController, "parse_storage_backend_extra_config", None)
    if parse is not None:
        return parse(text)[0]
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

    return HiRadixCache._parse_storage_backend_extra_config(None, text)[0]


def ours(text: str) -> dict:
    return {k: v for k, v in parse_extra_config(text).items() if k not in SGLANG_PREFETCH_KEYS}


@pytest.mark.parametrize("name, content", [
    ("c.json", json.dumps(CONFIG)), ("c.toml", TOML), ("c.yaml", YAML), ("c.yml", YAML), ("C.JSON", json.dumps(CONFIG)),
    ("c.Toml", TOML),
])
def test_a_config_file_reads_as_sglang_reads_it(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    assert parse_extra_config(f"@{path}") == CONFIG
    assert ours(f"@{path}") == sglang_parse(f"@{path}")


@pytest.mark.parametrize("text", [json.dumps(CONFIG), "{}", ""])
def test_a_json_object_reads_as_sglang_reads_it(text):
    assert ours(text) == sglang_parse(text)


def test_the_file_names_the_directory_and_the_deadlines(tmp_path):
    path = tmp_path / "hicache.yaml"
    path.write_text(YAML)
    loc = l3_location("file", f"@{path}", {})
    assert loc.directory == "/shared/l3" and loc.source == "file_storage_path"
    assert loc.timeouts.base_s == 3.0
    assert "prefetch_threshold" not in loc.extra_config  # SGLang's own keys never reach a store


@pytest.mark.parametrize("name, content", [
    ("missing.json", None), ("c.ini", "a = 1"), ("c.conf", None), ("bad.json", "{not json"),
    ("bad.toml", "a = "), ("bad.yaml", "a: [1, 2"), ("list.yaml", "- 1\n- 2\n"), ("empty.yaml", ""),
    ("scalar.json", "3"), ("null.json", "null"),
])
def test_a_file_sglang_refuses_is_refused_naming_the_argument(tmp_path, name, content):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=r"hicache_storage_backend_extra_config"):
        parse_extra_config(f"@{path}")
    with pytest.raises(Exception):  # SGLang stops too (its own error)
        result = sglang_parse(f"@{path}")
        result.pop("x", None)  # 0.5.18 / 0.5.23 pop their keys off whatever the file held


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "3", "null", " @file.json"])
def test_a_string_sglang_refuses_is_refused_naming_the_argument(text):
    with pytest.raises(ValueError, match=r"hicache_storage_backend_extra_config"):
        parse_extra_config(text)
    with pytest.raises(Exception):
        sglang_parse(text)
