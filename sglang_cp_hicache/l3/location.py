"""Where a CP cache's L3 lives, from the server's flags and the settings --
one rule for both SGLang releases.

A user switches L3 on the way SGLang documents it, ``--hicache-storage-backend
file``; under CP the library then serves that tier itself (its checked,
topology-free page objects, each owner writing and reading its own pages),
in the directory SGLang's file backend would use:

1. ``SGLANG_CP_HICACHE_L3_DIR`` when set (it also switches L3 on without the
   flag, for direct use of the cache: the simulator, tests);
2. else ``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR`` (SGLang's variable);
3. else ``file_storage_path`` of ``--hicache-storage-backend-extra-config``;
4. else ``/tmp/hicache`` (SGLang's default).

``--hicache-storage-backend mooncake`` is served the same way on a Mooncake
distributed store (``sglang_cp_hicache.l3_backends``): no directory; the
store's settings come from ``--hicache-storage-backend-extra-config`` (SGLang's
keys, ``master_server_address`` required) and are checked when it opens.

Any other backend is refused under CP: 3FS, NIXL, ... through SGLang's own
storage classes key objects by the writer's rank and would be handed
rank-local host slots.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from sglang_cp_hicache.settings import L3_DIR, SGLANG_FILE_DIR, read

__all__ = ["DEFAULT_FILE_DIR", "L3Location", "SUPPORTED_BACKENDS", "l3_location"]

#: SGLang's file backend's default directory (both releases).
DEFAULT_FILE_DIR = "/tmp/hicache"
#: ``--hicache-storage-backend`` values a CP cache can serve.
SUPPORTED_BACKENDS = ("file", "mooncake")


@dataclass(frozen=True)
class L3Location:
    """The L3 a CP cache should open.

    ``backend``: the store that holds it, ``"file"`` or ``"mooncake"``;
    ``directory``: the file store's directory (None for ``"file"``: no L3;
    always None for ``"mooncake"``); ``scheduler_driven``: SGLang's scheduler
    prefetches from it (the storage flag was passed; False: only direct calls
    read it); ``extra_config``: the parsed
    ``--hicache-storage-backend-extra-config`` (the Mooncake store's settings).
    """

    directory: Optional[str]
    scheduler_driven: bool
    source: str  # which rule chose the directory or store, for the start-up log
    backend: str = "file"
    extra_config: Mapping[str, Any] = field(default_factory=dict, hash=False)

    @property
    def enabled(self) -> bool:
        """Whether there is an L3 to open at all."""
        return self.backend != "file" or self.directory is not None


def _extra_config(extra: Union[None, str, Mapping[str, Any]]) -> Mapping[str, Any]:
    if extra is None or extra == "":
        return {}
    if isinstance(extra, Mapping):
        return extra
    try:
        parsed = json.loads(extra)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"hicache_storage_backend_extra_config is not JSON: {extra!r} ({exc})") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"hicache_storage_backend_extra_config must be a JSON object, got {extra!r}")
    return parsed


def _mooncake_location(extra: Mapping[str, Any]) -> L3Location:
    """A Mooncake L3: no directory (the file-store settings do not apply);
    its master must be named, since a CP cache never guesses where it is."""
    master = extra.get("master_server_address")
    if not isinstance(master, str) or not master.strip():
        raise ValueError(
            "--hicache-storage-backend mooncake under CP shared KV (sglang-cp-hicache) needs "
            "master_server_address (host:port) in --hicache-storage-backend-extra-config, "
            f"got {master!r}"
        )
    return L3Location(None, True, "hicache_storage_backend_extra_config", "mooncake", dict(extra))


def l3_location(
    storage_backend: Optional[str],
    extra_config: Union[None, str, Mapping[str, Any]] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> L3Location:
    """The L3 for a CP cache given ``--hicache-storage-backend`` and its
    extra config; raises ValueError naming the flag for a backend a CP cache
    cannot serve (nothing is created here)."""
    own = read(L3_DIR, environ)
    if storage_backend is None:
        return L3Location(own or None, False, L3_DIR.name if own else "off")
    if storage_backend not in SUPPORTED_BACKENDS:
        raise ValueError(
            f"--hicache-storage-backend {storage_backend!r} is not supported under CP shared KV "
            f"(sglang-cp-hicache): use one of {', '.join(SUPPORTED_BACKENDS)}; its objects would be "
            "keyed by the writer's rank and filled from rank-local host slots"
        )
    if storage_backend == "mooncake":
        return _mooncake_location(_extra_config(extra_config))
    if own:
        return L3Location(own, True, L3_DIR.name)
    sglang_dir = read(SGLANG_FILE_DIR, environ)
    if sglang_dir:
        return L3Location(sglang_dir, True, SGLANG_FILE_DIR.name)
    path = _extra_config(extra_config).get("file_storage_path")
    if path:
        if not isinstance(path, str):
            raise ValueError(f"file_storage_path in hicache_storage_backend_extra_config must be a string, got {path!r}")
        return L3Location(path, True, "file_storage_path")
    return L3Location(DEFAULT_FILE_DIR, True, "default")
