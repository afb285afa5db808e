"""Every environment variable this library reads: name, default, valid
values, meaning -- in one place.

A value is read when it is used (not at import), trimmed and lower-cased; an
empty value means the default. A free-form setting (no ``choices``, e.g. a
directory) is trimmed only, never lower-cased. A value outside the valid ones raises
``ValueError`` naming the variable and listing the valid values: a misspelt
setting never falls back silently. The sizes, ratios and flags of SGLang's
file and Mooncake backends are parsed as SGLang parses them
(:mod:`sglang_cp_hicache.sizes`). Both adapters and the simulator call
:func:`check_all` before a cache is built, so a bad value stops start-up
rather than a later copy or one rank's store; a ``SGLANG_CP_HICACHE_*`` name
that is none of ours gets a warning naming the closest one
(:func:`unknown_names`), never an error.

``python -m sglang_cp_hicache settings`` prints the settings that are set
(``--all``: every one) with the values in force.
"""

from __future__ import annotations

import difflib
import logging
import os
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from sglang_cp_hicache import sizes

__all__ = [
    "ALLOW_ANY_SGLANG", "COPY", "DEBUG", "FILE_EVICTION_RATIO", "FILE_MAX_SIZE", "FILE_MIN_FREE", "HOST_BALANCE",
    "HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME", "HOST_TAIL", "L3_DIR", "L3_EVICTION",
    "L3_KEY_FILE", "L3_MODEL_ID", "L3_THREADS", "MOONCAKE_SETTINGS", "OTHER_NAMES", "SETTINGS", "SGLANG_FILE_DIR",
    "SGLANG_PLUGINS", "Setting", "check_all", "check_value", "describe", "enabled", "log_unknown_names", "read",
    "read_int", "unknown_names",
]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    """One environment variable: ``choices`` are its valid (lower-case)
    values; empty ``choices``: any text (a path), kept as written, or with
    ``integer`` a whole number >= 1."""

    name: str
    default: str
    choices: tuple[str, ...]
    meaning: str
    integer: bool = False

    @property
    def is_flag(self) -> bool:
        return self.choices == _TRUE + _FALSE

    @property
    def is_free_form(self) -> bool:
        return not self.choices and not self.integer


COPY = Setting(
    "SGLANG_CP_HICACHE_COPY",
    "library",
    ("library", "upstream"),
    "SGLang 0.5.23: copy path of the KV-sharded DSA HiCache. library: this "
    "library's kernels and bookkeeping; upstream: SGLang's own, untouched.",
)
HOST_BALANCE = Setting(
    "SGLANG_CP_HICACHE_HOST_BALANCE",
    "exact",
    ("exact", "greedy"),
    "SGLang 0.5.18: exact evicts a device leaf for the rank holding the fewest "
    "host slots when it has no free device page (host shares within one page "
    "of 1/N); greedy never does (shares drift a few pages). Same on every rank.",
)
HOST_TAIL = Setting(
    "SGLANG_CP_HICACHE_HOST_TAIL",
    "covering",
    ("covering", "shortest", "whole"),
    "SGLang 0.5.23, library stack: how much of a host leaf a backup's host "
    "room evicts when the leaf's own pages make the run fit. covering: the "
    "shortest tail that does, when the prefix left holds a page of every "
    "owner class, else the whole leaf; shortest: the shortest tail always; "
    "whole: the whole leaf. Same on every rank (agreed at start-up).",
)
DEBUG = Setting(
    "SGLANG_CP_HICACHE_DEBUG",
    "0",
    _TRUE + _FALSE,
    "Extra checks that read device memory on the host (syncs, on purpose): "
    "copy indices checked against the pools on CUDA too, CPU page mirrors "
    "compared with the device locs.",
)
ALLOW_ANY_SGLANG = Setting(
    "SGLANG_CP_HICACHE_ALLOW_ANY_SGLANG",
    "0",
    _TRUE + _FALSE,
    "Run an adapter on an SGLang release other than the one it was written "
    "against (0.5.18 / 0.5.23); the start-up hook check still runs.",
)

L3_DIR = Setting(
    "SGLANG_CP_HICACHE_L3_DIR",
    "",
    (),
    "Directory of the L3 (storage) tier of a CP cache; empty: the directory "
    "SGLang's file backend would use when --hicache-storage-backend file is "
    "passed, else no L3. Every rank names one shared directory; pages are "
    "keyed by content and namespace, so deployments of any CP size share it.",
)
L3_THREADS = Setting(
    "SGLANG_CP_HICACHE_L3_THREADS",
    "4",
    (),
    "L3 I/O threads per CP rank for reads, and as many for writes (a whole "
    "number >= 1). A thread stuck past its operation's deadline is replaced "
    "by a spare (at most as many spares as threads), so one hung read never "
    "holds up later ones.",
    integer=True,
)
L3_MODEL_ID = Setting(
    "SGLANG_CP_HICACHE_L3_MODEL_ID",
    "",
    (),
    "Replaces the weights fingerprint in the L3 namespace (real path and "
    "content fingerprint of the checkpoint, or its Hub commit). Set the same text "
    "only on deployments whose checkpoints are byte-identical but sit at "
    "different paths; the revision, quantization, dtypes and model config "
    "still enter the namespace. Empty: the fingerprint.",
)
L3_KEY_FILE = Setting(
    "SGLANG_CP_HICACHE_L3_KEY_FILE",
    "",
    (),
    "A file holding the deployment's L3 secret (at least 32 bytes, owned by "
    "the server's account, mode 600 or 400): every L3 object then carries a "
    "keyed BLAKE3 MAC, and an object whose MAC does not hold is refused, so "
    "nobody without the secret can plant pages in a shared L3. Every rank of "
    "every deployment sharing the L3 names the same secret. Empty: objects "
    "carry a checksum only (damage is caught, forgery is not).",
)
L3_EVICTION = Setting(
    "SGLANG_CP_HICACHE_L3_EVICTION",
    "lru-leaves",
    ("lru-leaves", "random-chains"),
    "How a bounded file L3 directory makes room: lru-leaves evicts the least "
    "recently used page that no stored page follows (a chain goes from its "
    "end); random-chains evicts a random chain's branch (for comparisons only).",
)
FILE_MAX_SIZE = Setting(
    "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE",
    "",
    (),
    "SGLang's own variable, read (never set) by the library: the bound of a "
    "file L3 directory (200G, 64Gi or bytes, as SGLang reads it) when the extra config names no "
    "max_size; empty: unbounded.",
)
FILE_MIN_FREE = Setting(
    "SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE",
    "",
    (),
    "SGLang's own variable, read (never set): free space a file L3 directory's "
    "file system keeps (10G, 8Gi or bytes; the extra config's min_free_space wins); empty: none.",
)
FILE_EVICTION_RATIO = Setting(
    "SGLANG_HICACHE_FILE_BACKEND_EVICTION_RATIO",
    "",
    (),
    "SGLang's own variable, read (never set): a full directory is evicted down "
    "to this share of max_size (a number in (0, 1]; the extra config's eviction_ratio wins); empty: 0.9.",
)
HF_HUB_CACHE = Setting(
    "HF_HUB_CACHE",
    "",
    (),
    "Hugging Face's own variable, read (never set) by the library: where the "
    "Hub cache lives, to name a Hub model in the L3 namespace by its commit. "
    "Empty: HUGGINGFACE_HUB_CACHE, else HF_HOME/hub.",
)
HF_HOME = Setting(
    "HF_HOME",
    "",
    (),
    "Hugging Face's own variable, read (never set): its home, holding hub/ "
    "(see HF_HUB_CACHE). Empty: XDG_CACHE_HOME/huggingface.",
)
HUGGINGFACE_HUB_CACHE = Setting(
    "HUGGINGFACE_HUB_CACHE",
    "",
    (),
    "Hugging Face's legacy variable, read (never set): the Hub cache when "
    "HF_HUB_CACHE is empty. Empty: HF_HOME/hub.",
)
XDG_CACHE_HOME = Setting(
    "XDG_CACHE_HOME",
    "",
    (),
    "The XDG base directory variable, read (never set): holds huggingface/ "
    "when HF_HOME is empty (as huggingface_hub reads it). Empty: ~/.cache.",
)
SGLANG_FILE_DIR = Setting(
    "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR",
    "",
    (),
    "SGLang's own variable, read by the library only under CP with "
    "--hicache-storage-backend file: the L3 directory when "
    "SGLANG_CP_HICACHE_L3_DIR is empty (as SGLang's file backend uses it).",
)

SGLANG_PLUGINS = Setting(
    "SGLANG_PLUGINS",
    "",
    (),
    "SGLang's own allow-list of plugin names (comma-separated); empty loads "
    "every installed plugin. A list without cp_hicache (SGLang 0.5.18) or "
    "cp_hicache_0523 (SGLang 0.5.23) runs that release without this library: "
    "0.5.23 then serves upstream's copy path, 0.5.18 refuses "
    "--radix-cache-backend cp-hicache as unregistered.",
)


def _mooncake(name: str, meaning: str) -> Setting:
    """A variable of SGLang's Mooncake backend or of Mooncake's SGLang guide,
    read (never set) by the library for ``--hicache-storage-backend
    mooncake`` only, as SGLang reads it; its default is SGLang's."""
    return Setting(name, "", (), f"SGLang's / Mooncake's own variable, read (never set) for "
                   f"--hicache-storage-backend mooncake when neither the extra config nor "
                   f"SGLANG_HICACHE_MOONCAKE_CONFIG_PATH names a master: {meaning}")


MOONCAKE_CONFIG_PATH = Setting(
    "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH",
    "",
    (),
    "SGLang's own variable, read (never set) for --hicache-storage-backend mooncake when the extra "
    "config names no master: a JSON file of the Mooncake store's settings (SGLang's keys; "
    "master_server_address required under CP).",
)
MOONCAKE_MASTER = _mooncake("MOONCAKE_MASTER", "host:port of mooncake_master.")
MOONCAKE_CLIENT = _mooncake("MOONCAKE_CLIENT", "a standalone Mooncake client's address (refused under CP: "
                                               "each rank opens its own client, so a master is needed).")
MOONCAKE_LOCAL_HOSTNAME = _mooncake("MOONCAKE_LOCAL_HOSTNAME", "this rank's address as other clients reach it "
                                    "(SGLang 0.5.23: also over the extra config / file's local_hostname); "
                                    "empty: LOCAL_HOSTNAME, else localhost.")
LOCAL_HOSTNAME = _mooncake("LOCAL_HOSTNAME", "the legacy name of MOONCAKE_LOCAL_HOSTNAME.")
MOONCAKE_METADATA_SERVER = _mooncake("MOONCAKE_TE_META_DATA_SERVER", "the transfer engine's metadata server; "
                                     "empty: P2PHANDSHAKE.")
MOONCAKE_SEGMENT_SIZE = _mooncake("MOONCAKE_GLOBAL_SEGMENT_SIZE", "host memory lent to the store per TP group "
                                  "(4gb or bytes; each rank lends its share, as SGLang does); empty: 4gb.")
MOONCAKE_PROTOCOL = _mooncake("MOONCAKE_PROTOCOL", "rdma or tcp (SGLang 0.5.23: also when the extra config / "
                              "file names none); empty: rdma.")
MOONCAKE_DEVICE = _mooncake("MOONCAKE_DEVICE", "RDMA device(s), or a JSON map from TP rank to device; empty: auto.")
MOONCAKE_TENANT_ID = _mooncake("MOONCAKE_TENANT_ID", "the Mooncake tenant; empty: default.")
MOONCAKE_STANDALONE_STORAGE = _mooncake("MOONCAKE_STANDALONE_STORAGE", "true: a standalone store (refused "
                                        "under CP).")
MOONCAKE_SSD_OFFLOAD = _mooncake("MOONCAKE_ENABLE_SSD_OFFLOAD", "true: the client offloads to SSD.")
MOONCAKE_SSD_PATH = _mooncake("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", "the SSD offload directory (each rank "
                              "uses its own subdirectory rank_<tp rank>).")
#: The Mooncake variables, in SGLang's reading order.
MOONCAKE_SETTINGS: tuple[Setting, ...] = (
    MOONCAKE_CONFIG_PATH, MOONCAKE_MASTER, MOONCAKE_CLIENT, MOONCAKE_LOCAL_HOSTNAME, LOCAL_HOSTNAME,
    MOONCAKE_METADATA_SERVER, MOONCAKE_SEGMENT_SIZE, MOONCAKE_PROTOCOL, MOONCAKE_DEVICE, MOONCAKE_TENANT_ID,
    MOONCAKE_STANDALONE_STORAGE, MOONCAKE_SSD_OFFLOAD, MOONCAKE_SSD_PATH,
)

#: Every setting, in the order the table shows them.
SETTINGS: tuple[Setting, ...] = (
    COPY, HOST_BALANCE, HOST_TAIL, DEBUG, ALLOW_ANY_SGLANG, L3_DIR, L3_THREADS, L3_MODEL_ID, L3_KEY_FILE, L3_EVICTION,
    SGLANG_FILE_DIR, FILE_MAX_SIZE, FILE_MIN_FREE, FILE_EVICTION_RATIO, HF_HUB_CACHE, HF_HOME, HUGGINGFACE_HUB_CACHE,
    XDG_CACHE_HOME, SGLANG_PLUGINS,
    *MOONCAKE_SETTINGS,
)


def read(setting: Setting, environ: Optional[Mapping[str, str]] = None) -> str:
    """The value of ``setting`` in force (lower-case), or ValueError naming
    the variable and its valid values."""
    env = os.environ if environ is None else environ
    raw = env.get(setting.name, "")
    if setting.is_free_form:  # a path: case matters
        return raw.strip() or setting.default
    if setting.integer:
        value = raw.strip() or setting.default
        if not value.isdigit() or int(value) < 1:
            raise ValueError(
                f"{setting.name}={raw!r} is not valid; use a whole number >= 1 (default {setting.default})"
            )
        return str(int(value))
    value = raw.strip().lower() or setting.default
    if value not in setting.choices:
        raise ValueError(
            f"{setting.name}={raw!r} is not valid; use one of: {', '.join(setting.choices)} "
            f"(default {setting.default})"
        )
    return value


def read_int(setting: Setting, environ: Optional[Mapping[str, str]] = None) -> int:
    """An integer setting's value."""
    if not setting.integer:
        raise TypeError(f"{setting.name} is not an integer setting; use read()")
    return int(read(setting, environ))


def enabled(setting: Setting, environ: Optional[Mapping[str, str]] = None) -> bool:
    """A flag setting's value as a bool."""
    if not setting.is_flag:
        raise TypeError(f"{setting.name} is not a flag; use read()")
    return read(setting, environ) in _TRUE


#: Free-form settings whose text SGLang parses: the parser (SGLang's rules,
#: stdlib only) and the forms an error names. Checked by :func:`check_value`.
_PARSED: dict[str, tuple[Callable[[str, object], object], str]] = {
    FILE_MAX_SIZE.name: (sizes.parse_file_size, sizes.FILE_SIZE_FORMS),
    FILE_MIN_FREE.name: (sizes.parse_file_size, sizes.FILE_SIZE_FORMS),
    FILE_EVICTION_RATIO.name: (sizes.parse_eviction_ratio, sizes.RATIO_FORMS),
    MOONCAKE_SEGMENT_SIZE.name: (sizes.parse_mooncake_size, sizes.MOONCAKE_SIZE_FORMS),
    MOONCAKE_STANDALONE_STORAGE.name: (sizes.parse_mooncake_flag, sizes.MOONCAKE_FLAG_FORMS),
    MOONCAKE_SSD_OFFLOAD.name: (sizes.parse_mooncake_flag, sizes.MOONCAKE_FLAG_FORMS),
}
#: SGLANG_CP_HICACHE_* names the package reads outside this table: the
#: simulator's failure-injection test hook (sim/config.py FAIL_ENV).
OTHER_NAMES: tuple[str, ...] = ("SGLANG_CP_HICACHE_SIM_FAIL_RANK",)
_PREFIX = "SGLANG_CP_HICACHE_"


def check_value(setting: Setting, environ: Optional[Mapping[str, str]] = None) -> str:
    """:func:`read`, and for a size, ratio or flag SGLang parses, that it
    parses as SGLang parses it: ValueError naming the variable and SGLang's
    forms, so a bad value stops start-up before any rank opens a store."""
    value = read(setting, environ)
    parsed = _PARSED.get(setting.name)
    if parsed is not None and value:
        parse, forms = parsed
        try:
            parse(setting.name, value)
        except (TypeError, ValueError):
            raise ValueError(f"{setting.name}={value!r} is not valid; use {forms}") from None
    return value


def check_all(environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """Read and parse every setting (raises on the first invalid one);
    returns name -> value."""
    return {s.name: check_value(s, environ) for s in SETTINGS}


def unknown_names(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """One warning per ``SGLANG_CP_HICACHE_*`` variable that is set but is
    no setting of this library (a misspelling reads as unset), naming the
    closest valid name when there is one."""
    env = os.environ if environ is None else environ
    known = [s.name for s in SETTINGS if s.name.startswith(_PREFIX)] + list(OTHER_NAMES)
    warnings = []
    for name in sorted(n for n in env if n.startswith(_PREFIX) and n not in known):
        # Compared without the shared prefix, which would make every name look close.
        close = difflib.get_close_matches(name[len(_PREFIX):], [k[len(_PREFIX):] for k in known], n=1, cutoff=0.6)
        hint = (f"; did you mean {_PREFIX}{close[0]}?" if close
                else "; python -m sglang_cp_hicache settings --all lists them")
        warnings.append(f"{name} is not a setting of sglang-cp-hicache and is ignored{hint}")
    return warnings


_logged: set[str] = set()  # names already warned about in this process


def log_unknown_names(log: logging.Logger, environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """Log each :func:`unknown_names` warning as a WARNING once per process
    (a cache build may repeat; the warning need not); returns those logged now."""
    fresh = [w for w in unknown_names(environ) if w not in _logged]
    for warning in fresh:
        _logged.add(warning)
        log.warning("sglang-cp-hicache: %s", warning)
    return fresh


def _line(s: Setting, env: Mapping[str, str]) -> str:
    try:
        now = check_value(s, env)
    except ValueError:
        now = "INVALID: " + env.get(s.name, "")
    valid = (
        "0/1, true/false, yes/no, on/off" if s.is_flag
        else "a whole number >= 1" if s.integer
        else "|".join(s.choices) or (_PARSED[s.name][1] if s.name in _PARSED else "any text")
    )
    return f"{s.name}={now}  (valid: {valid}; default {s.default})\n    {s.meaning}"


def describe(environ: Optional[Mapping[str, str]] = None, everything: bool = True) -> str:
    """A plain-text table: variable, value in force (or the error), default,
    meaning; ``everything=False``: only the settings that are set (a
    non-blank value), and a line saying how many are left at their defaults."""
    env = os.environ if environ is None else environ
    shown = [s for s in SETTINGS if everything or env.get(s.name, "").strip()]
    lines = [_line(s, env) for s in shown]
    if not everything:
        if not shown:
            lines.append("no setting is set")
        lines.append(f"({len(SETTINGS) - len(shown)} other settings at their defaults; --all shows every one)")
    return "\n".join(lines)
