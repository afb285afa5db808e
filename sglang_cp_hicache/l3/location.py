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
store's settings come from where SGLang reads them (:func:`mooncake_form`):
``--hicache-storage-backend-extra-config`` when it names a master, else the
JSON file ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH`` names, else ``MOONCAKE_MASTER``
and the other ``MOONCAKE_*`` variables; a master is required, and the values
are checked when the store opens.

Any other backend is refused under CP: 3FS, NIXL, ... through SGLang's own
storage classes key objects by the writer's rank and would be handed
rank-local host slots.

The extra config is read as SGLang reads it: a JSON object, or ``@path`` to
a ``.json``, ``.toml`` or ``.yaml`` file. Its ``prefetch_timeout_base``,
``prefetch_timeout_per_ki_token`` and ``prefetch_timeout_max`` (SGLang's
prefetch timeout settings, same defaults) give every L3 operation its
deadline (:class:`L3Timeouts`), with ``SGLANG_CP_HICACHE_L3_DIR`` alone too.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from sglang_cp_hicache.settings import (
    L3_DIR, MOONCAKE_CLIENT, MOONCAKE_CONFIG_PATH, MOONCAKE_MASTER, SGLANG_FILE_DIR, read,
)

__all__ = [
    "DEFAULT_FILE_DIR", "MOONCAKE_FORMS", "L3Location", "L3Timeouts", "SUPPORTED_BACKENDS", "l3_location",
    "mooncake_form", "parse_extra_config",
]

#: SGLang's file backend's default directory (both releases).
DEFAULT_FILE_DIR = "/tmp/hicache"
#: Keys of the extra config that are SGLang's prefetch settings, not a store's.
SGLANG_PREFETCH_KEYS = ("prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
                        "prefetch_timeout_max", "hicache_storage_pass_prefix_keys")
#: ``--hicache-storage-backend`` values a CP cache can serve.
SUPPORTED_BACKENDS = ("file", "mooncake")


#: No L3 operation may be given longer than a day: a deadline is a wait, and
#: threads cannot wait past ``threading.TIMEOUT_MAX`` (an infinite or huge one raised).
MAX_TIMEOUT_S = 86400.0


@dataclass(frozen=True)
class L3Timeouts:
    """The deadline of an L3 operation on ``tokens`` tokens:
    ``min(max_s, base_s + per_ki_token_s * tokens / 1024)`` seconds -- SGLang's
    linear prefetch timeout, with its defaults. Past it a rank gives up on
    the operation: a read answers "miss from here", a write is dropped."""

    base_s: float = 2.0
    per_ki_token_s: float = 0.1
    max_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("base_s", "per_ki_token_s", "max_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_TIMEOUT_S:
                raise ValueError(f"{name} must be a number of seconds in [0, {MAX_TIMEOUT_S:.0f}], got {value!r}")
        if self.max_s <= 0:
            raise ValueError(f"max_s must be > 0, got {self.max_s!r}")

    def for_tokens(self, tokens: int) -> float:
        return max(1e-3, min(self.max_s, self.base_s + self.per_ki_token_s * tokens / 1024))

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any], defaults: Optional["L3Timeouts"] = None) -> "L3Timeouts":
        """From SGLang's keys in the extra config; ``defaults`` (the release's
        own, else SGLang 0.5.18's) where absent."""
        base = defaults if defaults is not None else cls()
        values = {"base_s": base.base_s, "per_ki_token_s": base.per_ki_token_s, "max_s": base.max_s}
        for key, name in (("prefetch_timeout_base", "base_s"), ("prefetch_timeout_per_ki_token", "per_ki_token_s"),
                          ("prefetch_timeout_max", "max_s")):
            if key in extra:
                value = extra[key]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_TIMEOUT_S:
                    raise ValueError(f"{key} in hicache_storage_backend_extra_config must be a number of seconds "
                                     f"in [0, {MAX_TIMEOUT_S:.0f}], got {value!r}")
                values[name] = float(value)
        try:
            return cls(**values)
        except ValueError as exc:
            raise ValueError(f"hicache_storage_backend_extra_config: {exc}") from None


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
    timeouts: L3Timeouts = field(default_factory=L3Timeouts)

    @property
    def enabled(self) -> bool:
        """Whether there is an L3 to open at all."""
        return self.backend != "file" or self.directory is not None


def _read_config_file(path: str) -> Any:
    """The object in an ``@path`` extra config file, read by its extension as
    SGLang reads it (.json, .toml, .yaml / .yml, any case)."""
    what = f"hicache_storage_backend_extra_config @{path}"
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".json", ".toml", ".yaml", ".yml"):
        raise ValueError(f"{what}: unsupported file type {ext!r} (use .json, .toml or .yaml)")
    errors: tuple[type[BaseException], ...] = (OSError, ValueError)  # JSON and TOML errors are ValueErrors
    if ext == ".json":
        load, mode = json.load, "r"
    elif ext == ".toml":
        import tomllib

        load, mode = tomllib.load, "rb"
    else:
        try:
            import yaml
        except ImportError:
            raise ValueError(f"{what}: reading YAML needs PyYAML (pip install pyyaml)") from None
        load, mode, errors = yaml.safe_load, "r", errors + (yaml.YAMLError,)
    try:
        with open(path, mode) as f:
            return load(f)
    except errors as exc:
        raise ValueError(f"{what}: cannot read it: {exc}") from None


def parse_extra_config(extra: Union[None, str, Mapping[str, Any]]) -> Mapping[str, Any]:
    """``--hicache-storage-backend-extra-config`` as SGLang reads it: a JSON
    object, or ``@path`` to a .json / .toml / .yaml file holding one."""
    if extra is None or extra == "":
        return {}
    if isinstance(extra, Mapping):
        return extra
    if not isinstance(extra, str):
        raise ValueError(f"hicache_storage_backend_extra_config must be a JSON object, got {extra!r}")
    if extra.startswith("@"):
        parsed = _read_config_file(extra[1:])
    else:
        try:
            parsed = json.loads(extra)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"hicache_storage_backend_extra_config is not JSON: {extra!r} ({exc})") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"hicache_storage_backend_extra_config must be a JSON object, got {extra!r}")
    return parsed


#: Where a Mooncake store's settings come from (SGLang's ``MooncakeStoreConfig`` order).
MOONCAKE_FORMS = ("hicache_storage_backend_extra_config", MOONCAKE_CONFIG_PATH.name, "environment")


def mooncake_form(extra: Mapping[str, Any], environ: Optional[Mapping[str, str]] = None) -> str:
    """Which form names a Mooncake store's settings, in SGLang's order: the
    extra config when it names a master or a client, else the JSON file
    ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH`` names when set, else the
    environment (``MOONCAKE_MASTER``, ...)."""
    if extra.get("master_server_address") is not None or extra.get("client_server_address") is not None:
        return MOONCAKE_FORMS[0]
    if read(MOONCAKE_CONFIG_PATH, environ):
        return MOONCAKE_FORMS[1]
    return MOONCAKE_FORMS[2]


def _mooncake_location(extra: Mapping[str, Any], timeouts: L3Timeouts,
                       environ: Optional[Mapping[str, str]]) -> L3Location:
    """A Mooncake L3: no directory (the file-store settings do not apply);
    its master must be named (a CP cache never guesses where it is, and each
    rank opens its own client) in the form SGLang reads: the extra config,
    the file ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH`` names (checked when the
    store opens), or ``MOONCAKE_MASTER``."""
    form, master = mooncake_form(extra, environ), None
    if form == MOONCAKE_FORMS[0]:
        master = extra.get("master_server_address")
    elif form == MOONCAKE_FORMS[2]:
        master = read(MOONCAKE_MASTER, environ) or None
    if form != MOONCAKE_FORMS[1] and (not isinstance(master, str) or not master.strip()):
        where = ("--hicache-storage-backend-extra-config" if form == MOONCAKE_FORMS[0]
                 else f"{MOONCAKE_MASTER.name} (none in the extra config, {MOONCAKE_CONFIG_PATH.name} unset)")
        raise ValueError(
            "--hicache-storage-backend mooncake under CP shared KV (sglang-cp-hicache) needs "
            "master_server_address (host:port): in --hicache-storage-backend-extra-config, in the JSON file "
            f"{MOONCAKE_CONFIG_PATH.name} names, or as {MOONCAKE_MASTER.name}; a client-only store "
            f"(client_server_address / {MOONCAKE_CLIENT.name}) is not supported; got {master!r} from {where}"
        )
    source = {MOONCAKE_FORMS[2]: MOONCAKE_MASTER.name}.get(form, form)
    return L3Location(None, True, source, "mooncake", dict(extra), timeouts)


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
        timeouts = L3Timeouts.from_extra_config(parse_extra_config(extra_config))
        return L3Location(own or None, False, L3_DIR.name if own else "off", timeouts=timeouts)
    if storage_backend not in SUPPORTED_BACKENDS:
        raise ValueError(
            f"--hicache-storage-backend {storage_backend!r} is not supported under CP shared KV "
            f"(sglang-cp-hicache): use one of {', '.join(SUPPORTED_BACKENDS)}; its objects would be "
            "keyed by the writer's rank and filled from rank-local host slots"
        )
    extra = dict(parse_extra_config(extra_config))
    timeouts = L3Timeouts.from_extra_config(extra)
    for key in SGLANG_PREFETCH_KEYS:  # SGLang's own, as its backends never see them
        extra.pop(key, None)
    if storage_backend == "mooncake":
        return _mooncake_location(extra, timeouts, environ)
    if own:
        return L3Location(own, True, L3_DIR.name, "file", extra, timeouts)
    sglang_dir = read(SGLANG_FILE_DIR, environ)
    if sglang_dir:
        return L3Location(sglang_dir, True, SGLANG_FILE_DIR.name, "file", extra, timeouts)
    path = extra.get("file_storage_path")
    if path:
        if not isinstance(path, str):
            raise ValueError(f"file_storage_path in hicache_storage_backend_extra_config must be a string, got {path!r}")
        return L3Location(path, True, "file_storage_path", "file", extra, timeouts)
    return L3Location(DEFAULT_FILE_DIR, True, "default", "file", extra, timeouts)
