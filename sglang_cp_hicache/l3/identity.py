"""The model in an L3 namespace: what names the model's bytes, never its alias.

Two deployments may share one L3 only if their pages hold the same bytes for
the same tokens. ``--served-model-name`` is an alias (SGLang fills it from the
path, and operators reuse one name across checkpoints), so it never enters
the namespace. What does (:class:`ModelIdentity`):

``weights``
    ``hf:{repo}@{commit}`` -- a Hugging Face Hub snapshot in a local cache
    (:func:`hub_caches`), whose commit names the bytes exactly;
    ``dir:{real path}#{fingerprint}`` / ``file:{real path}#{fingerprint}``
    -- any other local checkpoint, symlinks resolved, with the content
    fingerprint of :mod:`.fingerprint` (a checkpoint rewritten in place is
    another model); ``override:{text}`` -- ``SGLANG_CP_HICACHE_L3_MODEL_ID``,
    the operator vouching for byte-identical weights. Nothing else: any
    other model path is refused (``ValueError`` naming the path, the caches
    searched and the override) -- a bare name would let two checkpoints
    under one name restore each other's KV.
``revision``, ``quantization``, ``kv_cache_dtype``, ``dtype``, ``load_format``
    as the server was started (empty when unset);
``config``
    a digest of ``config.json`` with ``--json-model-override-args`` applied
    (rope scaling changes ``k_pe``), or of the overrides alone.

Only local files are read, never the network.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from sglang_cp_hicache.l3.fingerprint import directory_fingerprint, file_fingerprint
from sglang_cp_hicache.settings import HF_HOME, HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE, L3_MODEL_ID, XDG_CACHE_HOME, read

__all__ = ["HubCache", "ModelIdentity", "hub_caches", "identity_of_server_args", "model_identity"]

#: A hub cache's snapshot path: ``models--{repo with / as --}/snapshots/{commit}``.
_HUB_SNAPSHOT = re.compile(r"/models--(?P<repo>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})(?:/|$)")
#: A Hub repo id (``org/name`` or a legacy ``name``); the Hub forbids ``--`` and ``..`` in it.
_HUB_ID = re.compile(r"(?:[\w.-]+/)?[\w.-]+")
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class ModelIdentity:
    """What makes a model's KV bytes (see the module doc)."""

    weights: str
    revision: str = ""
    quantization: str = ""
    kv_cache_dtype: str = ""
    dtype: str = ""
    load_format: str = ""
    config: str = ""

    def text(self) -> str:
        """One canonical line (the namespace's ``model_id``)."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"), ensure_ascii=True)

    def short(self) -> str:
        """For the start-up log and agreement messages."""
        parts = [self.weights]
        for name in ("revision", "quantization", "kv_cache_dtype", "dtype", "load_format"):
            value = getattr(self, name)
            if value:
                parts.append(f"{name}={value}")
        parts.append(f"config={self.config}")
        return " ".join(parts)


def _text(value: object) -> str:
    if value is None:
        return ""
    return str(value).strip()


def _hub_snapshot(path: str) -> Optional[str]:
    found = _HUB_SNAPSHOT.search(path)
    if found is None:
        return None
    return f"hf:{found['repo'].replace('--', '/')}@{found['commit']}"


@dataclass(frozen=True)
class HubCache:
    """A directory holding Hub snapshots, and what named it (for messages)."""

    directory: str
    source: str


def _expand(path: str) -> str:
    return os.path.expandvars(os.path.expanduser(path))  # as huggingface_hub expands its variables


def _default_hub_cache() -> HubCache:
    """huggingface_hub's cache (its ``constants.HF_HUB_CACHE``): HF_HUB_CACHE,
    else the legacy HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, where HF_HOME
    defaults to $XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface."""
    for setting in (HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE):
        value = read(setting)
        if value:
            return HubCache(_expand(value), setting.name)
    home = read(HF_HOME)
    if home:
        return HubCache(os.path.join(_expand(home), "hub"), f"{HF_HOME.name}/hub")
    xdg = read(XDG_CACHE_HOME)
    if xdg:
        return HubCache(os.path.join(_expand(xdg), "huggingface", "hub"), f"{XDG_CACHE_HOME.name}/huggingface/hub")
    return HubCache(os.path.join(os.path.expanduser("~"), ".cache", "huggingface", "hub"), "~/.cache/huggingface/hub")


def hub_caches(download_dir: object = None) -> list[HubCache]:
    """Where SGLang finds a hub id's snapshot, in its order: ``--download-dir``
    (passed to huggingface_hub as ``cache_dir``), then huggingface_hub's own
    cache."""
    caches = []
    if _text(download_dir):
        # SGLang joins it as given; huggingface_hub expands only ~ in a cache_dir
        caches.append(HubCache(os.path.expanduser(_text(download_dir)), "--download-dir"))
    caches.append(_default_hub_cache())
    return caches


@dataclass(frozen=True)
class _HubSnapshot:
    directory: str
    repo: str
    commit: str

    @property
    def weights(self) -> str:
        return f"hf:{self.repo}@{self.commit}"


def _cached_hub_snapshot(repo: str, revision: str, caches: list[HubCache]) -> Optional[_HubSnapshot]:
    """The first local snapshot of hub id ``repo`` in ``caches`` (the
    caches' own refs only: no network). ``revision``: a commit, or a branch /
    tag the cache has a ref for (default main)."""
    folder = "models--" + repo.replace("/", "--")
    rev = revision or "main"
    for cache in caches:
        commit: Optional[str] = rev if _COMMIT.fullmatch(rev) else None
        if commit is None:
            try:
                commit = Path(cache.directory, folder, "refs", rev).read_text().strip()
            except (OSError, UnicodeDecodeError):
                continue
        snapshot = Path(cache.directory, folder, "snapshots", commit)
        if _COMMIT.fullmatch(commit) and snapshot.is_dir():
            return _HubSnapshot(str(snapshot), repo, commit)
    return None


def _is_hub_id(text: str) -> bool:
    return _HUB_ID.fullmatch(text) is not None and ".." not in text and "--" not in text


def _unnamed(model_path: str, revision: str, caches: list[HubCache]) -> ValueError:
    if _is_hub_id(model_path):
        where = ", ".join(f"{c.directory} ({c.source})" for c in caches)
        what = f"no snapshot of hub id {model_path!r} at revision {revision or 'main'} is in {where}"
    else:
        what = "it is no hub id either"
    return ValueError(
        f"L3 cannot name the model of --model-path {model_path!r} by its bytes: it is no local directory "
        f"or file, and {what}. Load the model from a local path or a cache SGLang uses (HF_HUB_CACHE, "
        f"HF_HOME, --download-dir), or set {L3_MODEL_ID.name} to a text naming exactly these weights "
        f"(deployments setting the same text share L3 pages)"
    )


def _config_digest(directory: Optional[str], overrides: Mapping[str, Any]) -> str:
    config: Any = None
    if directory is not None:
        try:
            config = json.loads(Path(directory, "config.json").read_text())
        except (OSError, ValueError):
            config = None
    if isinstance(config, dict):
        config = {**config, **overrides}  # SGLang applies the overrides key by key
        record = {"config": config}
    else:
        record = {"config": None, "overrides": dict(overrides)}
    text = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _overrides(value: object) -> Mapping[str, Any]:
    if value is None or value == "" or value == "{}":
        return {}
    if isinstance(value, Mapping):
        return value
    try:
        parsed = json.loads(str(value))
    except ValueError as exc:
        raise ValueError(f"json_model_override_args is not JSON: {value!r} ({exc})") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"json_model_override_args must be a JSON object, got {value!r}")
    return parsed


def model_identity(
    model_path: str, *, revision: object = None, quantization: object = None, kv_cache_dtype: object = None,
    dtype: object = None, load_format: object = None, json_model_override_args: object = None,
    download_dir: object = None, override: Optional[str] = None,
) -> ModelIdentity:
    """The identity of the model at ``model_path`` as the server was started
    with these arguments (reads only local files; see the module doc).
    ``download_dir``: SGLang's ``--download-dir``. ValueError when nothing
    local names the weights and no ``override`` is given."""
    if not isinstance(model_path, str) or not model_path.strip():
        raise ValueError(f"model_path must be a non-empty str, got {model_path!r}")
    overrides = _overrides(json_model_override_args)  # bad arguments first, before any file is read
    revision_text = _text(revision)
    directory: Optional[str] = None
    weights: Optional[str] = None
    # With an override the operator names the weights: nothing is read or refused for them.
    if os.path.isdir(model_path):
        directory = os.path.realpath(model_path)
        weights = _hub_snapshot(directory)
        if weights is None and not override:
            weights = f"dir:{directory}#{directory_fingerprint(directory)}"
    elif os.path.isfile(model_path):
        real = os.path.realpath(model_path)
        if not override:
            weights = f"file:{real}#{file_fingerprint(real).digest[:32]}"
    else:
        caches = hub_caches(download_dir)
        repo = model_path.strip()
        found = _cached_hub_snapshot(repo, revision_text, caches) if _is_hub_id(repo) else None
        if found is None and not override:
            raise _unnamed(repo, revision_text, caches)
        directory = found.directory if found else None
        weights = found.weights if found else None
    if override or weights is None:  # None only with an override
        weights = f"override:{override}"
    return ModelIdentity(
        weights=weights,
        revision="" if weights.startswith("hf:") else revision_text,  # a commit is exact already
        quantization=_text(quantization),
        kv_cache_dtype=_text(kv_cache_dtype),
        dtype=_text(dtype),
        load_format=_text(load_format),
        config=_config_digest(directory, overrides),
    )


def identity_of_server_args(server_args: Any, override: Optional[str] = None) -> ModelIdentity:
    """:func:`model_identity` from SGLang's ``ServerArgs`` (any release:
    only attributes both releases have are read)."""
    model_path = getattr(server_args, "model_path", None)
    if not model_path:
        raise ValueError("L3 needs the server's --model-path to name the model")
    # Each keyword of model_identity is the ServerArgs attribute of the same name.
    names = ("revision", "quantization", "kv_cache_dtype", "dtype", "load_format", "json_model_override_args",
             "download_dir")
    return model_identity(model_path, override=override, **{name: getattr(server_args, name, None) for name in names})
