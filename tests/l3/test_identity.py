"""The model in an L3 namespace names the model's bytes, never its alias."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_cp_hicache.l3.identity import ModelIdentity, identity_of_server_args, model_identity
from sglang_cp_hicache.settings import HF_HOME, HF_HUB_CACHE

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def checkpoint(root: Path, name: str, *, weights: bytes = b"w" * 64, config: dict | None = None) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config or {"architectures": ["DeepseekV32"], "rope_theta": 1e4}))
    (path / "model-00001-of-00001.safetensors").write_bytes(weights)
    return path


def args(model_path: str, **overrides) -> SimpleNamespace:
    fields = dict(model_path=model_path, served_model_name="prod-model", revision=None, quantization=None,
                  kv_cache_dtype="auto", dtype="auto", load_format="auto", json_model_override_args="{}")
    fields.update(overrides)
    return SimpleNamespace(**fields)


def test_the_served_name_never_enters_the_identity(tmp_path):
    path = checkpoint(tmp_path, "a")
    one = identity_of_server_args(args(str(path), served_model_name="alias-1"))
    two = identity_of_server_args(args(str(path), served_model_name="alias-2"))
    assert one == two and "alias" not in one.text()


def test_two_checkpoints_under_one_alias_differ(tmp_path):
    a, b = checkpoint(tmp_path, "a"), checkpoint(tmp_path, "b", weights=b"v" * 64)
    assert identity_of_server_args(args(str(a))) != identity_of_server_args(args(str(b)))


def test_a_latest_symlink_swapped_to_another_checkpoint_is_another_model(tmp_path):
    a, b = checkpoint(tmp_path, "a"), checkpoint(tmp_path, "b")
    link = tmp_path / "latest"
    link.symlink_to(a)
    before = identity_of_server_args(args(str(link)))
    assert before == identity_of_server_args(args(str(a)))  # a link to a checkpoint is that checkpoint
    link.unlink()
    link.symlink_to(b)
    assert identity_of_server_args(args(str(link))) != before


def test_a_checkpoint_rewritten_in_place_is_another_model(tmp_path):
    a = checkpoint(tmp_path, "a")
    before = identity_of_server_args(args(str(a)))
    weights = a / "model-00001-of-00001.safetensors"
    weights.write_bytes(b"x" * 64)  # same name, same size: another fine-tune
    os.utime(weights, ns=(1, 1))
    assert identity_of_server_args(args(str(a))) != before


@pytest.mark.parametrize("field,value", [
    ("revision", "v2"),
    ("quantization", "fp8"),
    ("kv_cache_dtype", "fp8_e4m3"),
    ("dtype", "float16"),
    ("load_format", "dummy"),
    ("json_model_override_args", '{"rope_scaling": {"type": "yarn", "factor": 4.0}}'),
])
def test_every_argument_that_changes_the_bytes_changes_the_identity(tmp_path, field, value):
    a = checkpoint(tmp_path, "a")
    assert identity_of_server_args(args(str(a), **{field: value})) != identity_of_server_args(args(str(a)))


def test_an_override_that_repeats_the_config_changes_nothing(tmp_path):
    a = checkpoint(tmp_path, "a", config={"rope_theta": 1e4})
    same = args(str(a), json_model_override_args='{"rope_theta": 10000.0}')
    assert identity_of_server_args(same) == identity_of_server_args(args(str(a)))


def test_one_hub_snapshot_under_two_aliases_and_paths_is_one_model(tmp_path, monkeypatch):
    """A Hub commit names the bytes exactly: the cache path, another mount of
    it, and the hub id all give the same identity."""
    hub = tmp_path / "hub"
    snap = checkpoint(hub / "models--deepseek-ai--DeepSeek-V3.2" / "snapshots", COMMIT)
    (hub / "models--deepseek-ai--DeepSeek-V3.2" / "refs").mkdir()
    (hub / "models--deepseek-ai--DeepSeek-V3.2" / "refs" / "main").write_text(COMMIT)
    mount = tmp_path / "mnt"
    mount.symlink_to(hub)
    monkeypatch.setenv(HF_HUB_CACHE.name, str(hub))
    by_path = identity_of_server_args(args(str(snap), served_model_name="a"))
    by_mount = identity_of_server_args(args(str(mount / snap.relative_to(hub)), served_model_name="b"))
    by_id = identity_of_server_args(args("deepseek-ai/DeepSeek-V3.2"))
    assert by_path == by_mount == by_id
    assert by_path.weights == f"hf:deepseek-ai/DeepSeek-V3.2@{COMMIT}"
    # HF_HOME/hub when HF_HUB_CACHE is unset
    monkeypatch.delenv(HF_HUB_CACHE.name)
    monkeypatch.setenv(HF_HOME.name, str(tmp_path))
    assert identity_of_server_args(args("deepseek-ai/DeepSeek-V3.2")) == by_id


def test_a_hub_id_not_in_the_cache_is_named_with_its_revision(tmp_path, monkeypatch):
    monkeypatch.setenv(HF_HUB_CACHE.name, str(tmp_path / "empty"))
    one = identity_of_server_args(args("org/model"))
    assert one.weights == "name:org/model"
    assert identity_of_server_args(args("org/model", revision="v2")) != one


def test_the_operators_id_replaces_only_the_weights_fingerprint(tmp_path):
    a, b = checkpoint(tmp_path, "a"), checkpoint(tmp_path, "b")
    one = identity_of_server_args(args(str(a)), override="ds-v32-0901")
    assert one == identity_of_server_args(args(str(b)), override="ds-v32-0901")
    assert one.weights == "override:ds-v32-0901"
    assert one != identity_of_server_args(args(str(b), quantization="fp8"), override="ds-v32-0901")


def test_text_is_canonical_and_short_names_the_fields(tmp_path):
    a = checkpoint(tmp_path, "a")
    ident = identity_of_server_args(args(str(a), quantization="fp8"))
    assert json.loads(ident.text())["quantization"] == "fp8"
    assert ident.text() == model_identity(str(a), quantization="fp8", kv_cache_dtype="auto", dtype="auto",
                                          load_format="auto", json_model_override_args="{}").text()
    assert ident.short().startswith(f"dir:{os.path.realpath(a)}#") and "quantization=fp8" in ident.short()
    assert isinstance(ModelIdentity("name:x").text(), str)


@pytest.mark.parametrize("bad,match", [
    (args(""), "model-path"),
    (args("/x", json_model_override_args="[1]"), "json_model_override_args must be a JSON object"),
    (args("/x", json_model_override_args="{"), "json_model_override_args is not JSON"),
])
def test_bad_arguments_are_refused_naming_them(bad, match):
    with pytest.raises(ValueError, match=match):
        identity_of_server_args(bad)
