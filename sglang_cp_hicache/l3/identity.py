"""The model in an L3 namespace: what names the model's bytes, never its alias.

Two deployments may share one L3 only if their pages hold the same bytes for
the same tokens. ``--served-model-name`` is an alias (SGLang fills it from the
path, and operators reuse one name across checkpoints), so it never enters
the namespace. What does (:class:`ModelIdentity`):

``weights``
    * ``hf:{repo}@{commit}`` -- a Hugging Face Hub snapshot (a local path
      inside a hub cache ``.../models--{org}--{name}/snapshots/{commit}``, or
      a hub id found in the local cache): the commit names the bytes exactly,
      so one checkpoint served under two aliases or mount paths shares;
    * ``dir:{real path}#{listing digest}`` -- any other local directory: its
      real path (symlinks resolved, so a ``latest`` link swapped to another
      checkpoint is another model) and a digest of the name, size and
      modification time of every weight file in it (a checkpoint rewritten in
      place is another model);
    * ``name:{model path}`` -- a path that is neither (nothing to fingerprint
      here: the name as given, with the revision beside it);
    * ``override:{text}`` -- ``SGLANG_CP_HICACHE_L3_MODEL_ID``: the operator
      vouches that deployments setting the same text serve byte-identical
      weights (the other fields still apply).
``revision``, ``quantization``, ``kv_cache_dtype``, ``dtype``, ``load_format``
    as the server was started (empty when unset);
``config``
    a digest of the model config as SGLang loads it: ``config.json`` of the
    checkpoint with ``--json-model-override-args`` applied (rope scaling
    changes ``k_pe``), or of the override args alone when no config is
    readable here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from sglang_cp_hicache.settings import HF_HOME, HF_HUB_CACHE, read

__all__ = ["ModelIdentity", "model_identity", "identity_of_server_args"]

#: Weight and index files whose listing fingerprints a local checkpoint.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json")
_HUB_SNAPSHOT = re.compile(r"/models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})(?:/|$)")


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
    return f"hf:{found['org']}/{found['name']}@{found['commit']}"


def _hub_cache_root() -> Path:
    """Where the Hugging Face Hub cache lives (its own variables, its default)."""
    explicit = read(HF_HUB_CACHE)
    if explicit:
        return Path(explicit)
    home = read(HF_HOME) or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def _cached_hub_dir(model_path: str, revision: str) -> Optional[str]:
    """The local snapshot directory of a hub id ``org/name``, if the hub
    cache holds it (no network: the cache's own refs only). ``revision``: a
    commit, or a branch / tag name the cache has a ref for (default main)."""
    parts = model_path.strip().split("/")
    if len(parts) != 2 or not all(parts) or any(p in (".", "..") for p in parts):
        return None
    repo = _hub_cache_root() / f"models--{parts[0]}--{parts[1]}"
    rev = revision or "main"
    commit = rev if re.fullmatch(r"[0-9a-f]{40}", rev) else None
    if commit is None:
        try:
            commit = (repo / "refs" / rev).read_text().strip()
        except OSError:
            return None
    snapshot = repo / "snapshots" / commit
    return str(snapshot) if snapshot.is_dir() else None


def _listing_digest(directory: Path) -> str:
    rows = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.name.endswith(_WEIGHT_SUFFIXES) and entry.is_file():
            st = entry.stat()
            rows.append(f"{entry.name}\t{st.st_size}\t{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()[:16]


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
    override: Optional[str] = None,
) -> ModelIdentity:
    """The identity of the model at ``model_path`` as the server was started
    with these arguments (reads only local files)."""
    if not isinstance(model_path, str) or not model_path.strip():
        raise ValueError(f"model_path must be a non-empty str, got {model_path!r}")
    revision_text = _text(revision)
    directory: Optional[str] = None
    if os.path.isdir(model_path):
        directory = os.path.realpath(model_path)
        weights = _hub_snapshot(directory) or f"dir:{directory}#{_listing_digest(Path(directory))}"
    else:
        directory = _cached_hub_dir(model_path, revision_text)
        hub = _hub_snapshot(os.path.realpath(directory)) if directory else None
        weights = hub or f"name:{model_path.strip()}"
    if override:
        weights = f"override:{override}"
    return ModelIdentity(
        weights=weights,
        revision="" if weights.startswith("hf:") else revision_text,  # a commit is exact already
        quantization=_text(quantization),
        kv_cache_dtype=_text(kv_cache_dtype),
        dtype=_text(dtype),
        load_format=_text(load_format),
        config=_config_digest(directory, _overrides(json_model_override_args)),
    )


def identity_of_server_args(server_args: Any, override: Optional[str] = None) -> ModelIdentity:
    """:func:`model_identity` from SGLang's ``ServerArgs`` (any release:
    only attributes both releases have are read)."""
    model_path = getattr(server_args, "model_path", None)
    if not model_path:
        raise ValueError("L3 needs the server's --model-path to name the model")
    return model_identity(
        model_path,
        revision=getattr(server_args, "revision", None),
        quantization=getattr(server_args, "quantization", None),
        kv_cache_dtype=getattr(server_args, "kv_cache_dtype", None),
        dtype=getattr(server_args, "dtype", None),
        load_format=getattr(server_args, "load_format", None),
        json_model_override_args=getattr(server_args, "json_model_override_args", None),
        override=override,
    )
