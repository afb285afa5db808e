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

Any other backend is refused under CP: Mooncake, 3FS, NIXL, ... key objects
by the writer's rank and would be handed rank-local host slots.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from sglang_cp_hicache.settings import L3_DIR, SGLANG_FILE_DIR, read

__all__ = ["DEFAULT_FILE_DIR", "L3Location", "SUPPORTED_BACKENDS", "l3_location"]

#: SGLang's file backend's default directory (both releases).
DEFAULT_FILE_DIR = "/tmp/hicache"
#: ``--hicache-storage-backend`` values a CP cache can serve.
SUPPORTED_BACKENDS = ("file",)


@dataclass(frozen=True)
class L3Location:
    """The L3 a CP cache should open: ``directory`` (None: no L3) and
    ``scheduler_driven`` (SGLang's scheduler prefetches from it: the storage
    flag was passed; False: only direct calls read it)."""

    directory: Optional[str]
    scheduler_driven: bool
    source: str  # which rule chose the directory, for the start-up log


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
