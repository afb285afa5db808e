"""The model in an L3 namespace names the model's bytes, never its alias."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_cp_hicache.l3 import fingerprint
from sglang_cp_hicache.l3.identity import ModelIdentity, identity_of_server_args, model_identity
from sglang_cp_hicache.settings import HF_HOME, HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE, L3_MODEL_ID, XDG_CACHE_HOME

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
REPO = "deepseek-ai/DeepSeek-V3.2"


@pytest.fixture(autouse=True)
def hermetic(monkeypatch, tmp_path):
    """No Hugging Face / XDG variable or home of this machine, no fingerprint
    cached by an earlier test."""
    for setting in (HF_HUB_CACHE, HF_HOME, HUGGINGFACE_HUB_CACHE, XDG_CACHE_HOME, L3_MODEL_ID):
        monkeypatch.delenv(setting.name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    fingerprint.forget_cached()


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


# ---- Hub snapshots: found where SGLang / huggingface_hub look, or refused ----

def hub_repo(cache: Path, refs: dict[str, str], repo: str = REPO) -> None:
    """A hub cache holding ``repo`` at every commit ``refs`` names."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    for commit in sorted(set(refs.values())):
        checkpoint(folder / "snapshots", commit, weights=commit.encode())
    (folder / "refs").mkdir()
    for ref, commit in refs.items():
        (folder / "refs" / ref).write_text(commit)


def cache_at(where: str, root: Path, monkeypatch) -> tuple[Path, dict]:
    """The hub cache directory SGLang reads for ``where``, and the server
    arguments naming it."""
    if where == "XDG_CACHE_HOME":
        monkeypatch.setenv(XDG_CACHE_HOME.name, str(root / "xdg"))
        return root / "xdg" / "huggingface" / "hub", {}
    if where == "HUGGINGFACE_HUB_CACHE":
        monkeypatch.setenv(HUGGINGFACE_HUB_CACHE.name, str(root / "legacy"))
        return root / "legacy", {}
    if where == "HF_HOME":
        monkeypatch.setenv(HF_HOME.name, str(root / "hf-home"))
        return root / "hf-home" / "hub", {}
    if where == "download_dir":
        return root / "downloads", {"download_dir": str(root / "downloads")}
    assert where == "home"
    return root / "home" / ".cache" / "huggingface" / "hub", {}


@pytest.mark.parametrize("where", ["XDG_CACHE_HOME", "HUGGINGFACE_HUB_CACHE", "download_dir", "HF_HOME", "home"])
def test_two_commits_of_one_repo_in_a_cache_sglang_reads_are_two_models(tmp_path, monkeypatch, where):
    cache, extra = cache_at(where, tmp_path, monkeypatch)
    hub_repo(cache, {"main": COMMIT, "v2": OTHER_COMMIT})
    main = identity_of_server_args(args(REPO, **extra))
    v2 = identity_of_server_args(args(REPO, revision="v2", **extra))
    pinned = identity_of_server_args(args(REPO, revision=OTHER_COMMIT, **extra))
    assert main.weights == f"hf:{REPO}@{COMMIT}"
    assert v2.weights == f"hf:{REPO}@{OTHER_COMMIT}" and v2 == pinned
    assert main != v2


def test_the_hub_cache_variables_rank_as_huggingface_hub_ranks_them(tmp_path, monkeypatch):
    commits = {where: str(n) * 40 for n, where in enumerate(["XDG_CACHE_HOME", "HF_HOME", "HUGGINGFACE_HUB_CACHE"])}
    for where, commit in commits.items():  # lowest first: each later variable wins over the ones before
        cache, _ = cache_at(where, tmp_path, monkeypatch)
        hub_repo(cache, {"main": commit})
        assert identity_of_server_args(args(REPO)).weights == f"hf:{REPO}@{commit}", where
    hub_repo(tmp_path / "hub", {"main": OTHER_COMMIT})
    monkeypatch.setenv(HF_HUB_CACHE.name, str(tmp_path / "hub"))
    assert identity_of_server_args(args(REPO)).weights == f"hf:{REPO}@{OTHER_COMMIT}"


def test_the_download_dir_comes_first_then_the_hub_cache_as_sglang_looks(tmp_path, monkeypatch):
    hub_repo(tmp_path / "downloads", {"main": COMMIT})
    hub_repo(tmp_path / "hub", {"main": OTHER_COMMIT})
    monkeypatch.setenv(HF_HUB_CACHE.name, str(tmp_path / "hub"))
    assert identity_of_server_args(args(REPO, download_dir=str(tmp_path / "downloads"))).weights.endswith(COMMIT)
    assert identity_of_server_args(args(REPO, download_dir=str(tmp_path / "empty"))).weights.endswith(OTHER_COMMIT)
    assert identity_of_server_args(args(REPO)).weights.endswith(OTHER_COMMIT)


def test_a_legacy_hub_id_without_an_org_is_named_by_its_commit_by_id_and_by_path(tmp_path, monkeypatch):
    hub_repo(tmp_path / "hub", {"main": COMMIT}, repo="gpt2")
    monkeypatch.setenv(HF_HUB_CACHE.name, str(tmp_path / "hub"))
    by_id = identity_of_server_args(args("gpt2"))
    assert by_id.weights == f"hf:gpt2@{COMMIT}"
    assert identity_of_server_args(args(str(tmp_path / "hub" / "models--gpt2" / "snapshots" / COMMIT))) == by_id


@pytest.mark.parametrize("model,revision", [
    ("org/model", None),  # no snapshot of the repo anywhere
    (REPO, "v3"),  # the repo is cached, but no ref names v3
    (REPO, "f" * 40),  # a commit the cache does not hold
    ("gpt2", None),  # a legacy id without an org
])
def test_a_hub_id_without_a_cached_commit_is_refused_naming_where_it_looked(tmp_path, monkeypatch, model, revision):
    """Never a bare name: two commits of one repo would share pages."""
    hub_repo(tmp_path / "hub", {"main": COMMIT})
    monkeypatch.setenv(HF_HUB_CACHE.name, str(tmp_path / "hub"))
    with pytest.raises(ValueError) as refused:
        identity_of_server_args(args(model, revision=revision, download_dir=str(tmp_path / "downloads")))
    text = str(refused.value)
    assert repr(model) in text and L3_MODEL_ID.name in text
    assert f"{tmp_path / 'downloads'} (--download-dir)" in text and f"{tmp_path / 'hub'} ({HF_HUB_CACHE.name})" in text
    assert f"revision {revision or 'main'}" in text


def test_a_path_that_is_nothing_here_is_refused_and_an_override_names_it(tmp_path):
    missing = str(tmp_path / "no" / "such" / "checkpoint")
    with pytest.raises(ValueError, match=f"--model-path {missing!r}.*{L3_MODEL_ID.name}"):
        identity_of_server_args(args(missing))
    named = identity_of_server_args(args("org/model", revision="v2"), override="ds-v32-0901")
    assert named.weights == "override:ds-v32-0901" and named.revision == "v2"
    assert identity_of_server_args(args(missing), override="ds-v32-0901").weights == "override:ds-v32-0901"


# ---- Local checkpoints: named by their content, in a bounded read ----

SHARD = "model-00001-of-00001.safetensors"
SHARD_SIZE = 256 * 1024 * 1024  # sparse: only the header and the patched bytes take space
PAD = 150 * 1024  # header metadata before the tensors: they sit past the first sampled block


def safetensors_header(tensor: str) -> bytes:
    """An 8-byte length and a JSON header whose tensor name lies past the
    first sampled block."""
    header = {"__metadata__": {"pad": "x" * PAD}, tensor: {"dtype": "BF16", "shape": [1024], "data_offsets": [0, 2048]}}
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text


def sparse_shard(path: Path, header: bytes, patches: dict[int, bytes], mtime_ns: int | None = None) -> None:
    """A ``SHARD_SIZE`` shard written as rsync -a writes it: a new file
    renamed over ``path``, its mtime set (``mtime_ns``)."""
    staging = path.with_name(path.name + ".partial")
    with open(staging, "wb") as f:
        f.write(header)
        f.truncate(SHARD_SIZE)
        for offset, data in patches.items():
            f.seek(offset)
            f.write(data)
    if mtime_ns is not None:
        os.utime(staging, ns=(mtime_ns, mtime_ns))
    os.replace(staging, path)


def sampled(offset: int) -> bool:
    return any(start <= offset < start + fingerprint.BLOCK for start in fingerprint.sample_offsets(SHARD_SIZE))


@pytest.fixture
def big(tmp_path) -> Path:
    path = checkpoint(tmp_path, "ckpt")
    sparse_shard(path / SHARD, safetensors_header("layers.0.w"), {})
    return path


def rewritten(path: Path, header: bytes, patches: dict[int, bytes]) -> None:
    """Another checkpoint at ``path`` with every name, size and mtime kept."""
    mtime = (path / SHARD).stat().st_mtime_ns
    sparse_shard(path / SHARD, header, patches, mtime_ns=mtime)
    assert (path / SHARD).stat().st_mtime_ns == mtime and (path / SHARD).stat().st_size == SHARD_SIZE


def test_a_fine_tune_differing_in_the_safetensors_header_only_is_another_model(big):
    before = identity_of_server_args(args(str(big)))
    header = safetensors_header("layers.1.w")  # as long as the base's, another tensor
    assert len(header) == len(safetensors_header("layers.0.w"))
    differs = next(i for i, (x, y) in enumerate(zip(header, safetensors_header("layers.0.w"))) if x != y)
    assert not sampled(differs)  # only the header read finds it
    rewritten(big, header, {})
    assert identity_of_server_args(args(str(big))) != before


def test_a_fine_tune_differing_only_in_a_sampled_block_is_another_model(big):
    before = identity_of_server_args(args(str(big)))
    offset = fingerprint.sample_offsets(SHARD_SIZE)[7] + 10
    rewritten(big, safetensors_header("layers.0.w"), {offset: b"\x01"})
    assert identity_of_server_args(args(str(big))) != before


def test_bytes_changed_only_between_samples_are_the_documented_limit(big, monkeypatch):
    """Each weight file costs one bounded read (the header and SAMPLES
    blocks), so bytes changed between the samples, with the size and mtime
    kept, go unseen: the module doc says so and names the override."""
    read: list[int] = []
    pread = os.pread

    def counting(fd: int, length: int, offset: int) -> bytes:
        data = pread(fd, length, offset)
        read.append(len(data))
        return data

    monkeypatch.setattr(os, "pread", counting)
    shard = fingerprint.file_fingerprint(big / SHARD)
    header = len(safetensors_header("layers.0.w"))
    assert sum(read) == shard.bytes_read == header + fingerprint.SAMPLES * fingerprint.BLOCK
    assert len(read) == 2 + fingerprint.SAMPLES
    before = identity_of_server_args(args(str(big)))
    offset = fingerprint.sample_offsets(SHARD_SIZE)[7] + fingerprint.BLOCK + 4096
    assert not sampled(offset)
    rewritten(big, safetensors_header("layers.0.w"), {offset: b"\x01"})
    assert identity_of_server_args(args(str(big))) == before
    assert "SGLANG_CP_HICACHE_L3_MODEL_ID" in (fingerprint.__doc__ or "")


def test_a_copy_keeping_the_bytes_and_mtimes_has_the_same_fingerprint(tmp_path):
    import shutil
    original = checkpoint(tmp_path, "a", weights=safetensors_header("layers.0.w") + bytes(4096))
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)  # copy2 keeps the mtimes
    assert fingerprint.directory_fingerprint(copy) == fingerprint.directory_fingerprint(original)
    assert identity_of_server_args(args(str(copy))) != identity_of_server_args(args(str(original)))  # another path


def test_a_cached_fingerprint_is_read_again_when_its_file_is_replaced(big):
    first = fingerprint.file_fingerprint(big / SHARD)
    assert fingerprint.file_fingerprint(big / SHARD) is first  # the stat key matched: no second read
    rewritten(big, safetensors_header("layers.2.w"), {})
    assert fingerprint.file_fingerprint(big / SHARD).digest != first.digest


def test_a_single_file_model_is_named_by_its_real_path_and_content(tmp_path):
    gguf = tmp_path / "model-Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF" + bytes(4096))
    link = tmp_path / "current.gguf"
    link.symlink_to(gguf)
    one = identity_of_server_args(args(str(gguf)))
    assert one.weights.startswith(f"file:{os.path.realpath(gguf)}#") and len(one.weights.split("#")[1]) == 32
    assert identity_of_server_args(args(str(link))) == one
    mtime = gguf.stat().st_mtime_ns
    staging = tmp_path / "staging"
    staging.write_bytes(b"GGUF" + bytes(4095) + b"\x01")  # another quantisation, same size and mtime
    os.utime(staging, ns=(mtime, mtime))
    os.replace(staging, gguf)
    assert identity_of_server_args(args(str(gguf))) != one


@pytest.mark.parametrize("size,expected", [
    (0, [0]),
    (fingerprint.SAMPLES * fingerprint.BLOCK, [0]),
    (SHARD_SIZE, None),
])
def test_samples_span_the_file_from_its_first_to_its_last_block(size, expected):
    offsets = fingerprint.sample_offsets(size)
    if expected is not None:
        assert offsets == expected
        return
    assert len(offsets) == fingerprint.SAMPLES and offsets[0] == 0 and offsets[-1] == size - fingerprint.BLOCK
    assert offsets == sorted(set(offsets))
    with pytest.raises(ValueError, match="size"):
        fingerprint.sample_offsets(-1)
