"""The L3 the parsed launch arguments name (:func:`~sglang_cp_hicache.l3.location.l3_location`,
the rule both adapters use): a file directory that exists or can be
created, belongs to this account or its group, is not open to every
account, and has room for ``max_size``; or a Mooncake master that accepts a
TCP connection; the key file, and the model as the L3 namespace names it. Nothing is created or written except one probe file, made
and removed in an existing directory (as the store itself probes it).
"""

from __future__ import annotations

import grp
import os
import pwd
import socket
import stat
import tempfile
from pathlib import Path
from typing import Any, Optional

from sglang_cp_hicache import settings
from sglang_cp_hicache.l3.location import L3Location, l3_location
from sglang_cp_hicache.preflight.report import FAIL, OK, WARN, Finding

__all__ = ["MASTER_TIMEOUT_S", "directory_findings", "l3_findings", "master_findings"]

#: How long the Mooncake master gets to accept a TCP connection.
MASTER_TIMEOUT_S = 2.0
_WHAT = "L3 directory"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _named(kind: str, number: int) -> str:
    """An account (``uid``) or group (``gid``) by name and number; the number alone where it has no name."""
    try:
        name = pwd.getpwuid(number).pw_name if kind == "uid" else grp.getgrgid(number).gr_name
    except KeyError:
        return f"{kind} {number}"
    return f"{name} ({kind} {number})"


def _existing_ancestor(path: Path) -> Path:
    """The nearest part of ``path`` that exists (``path`` itself if it does)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _missing(path: Path, where: str) -> Finding:
    """A directory still to be made: the nearest existing part must be a
    directory this account can create entries in."""
    base = _existing_ancestor(path)
    if not base.is_dir():
        return Finding(FAIL, _WHAT, f"{path} ({where}) cannot be created: {base} is not a directory; "
                                    "point the L3 at a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        return Finding(FAIL, _WHAT, f"{path} ({where}) cannot be created: this account "
                                    f"({_named('uid', os.geteuid())}) may not write in {base}; create it for the "
                                    "serving account or pick another")
    return Finding(OK, _WHAT, f"{path} ({where}) does not exist yet; the first rank creates it in {base}")


def _owner(path: Path, st: os.stat_result) -> Optional[Finding]:
    mine = st.st_uid == os.geteuid() or st.st_gid == os.getegid() or st.st_gid in os.getgroups()
    if mine:
        return None
    return Finding(FAIL, _WHAT, f"{path} is owned by {_named('uid', st.st_uid)} and group {_named('gid', st.st_gid)}, "
                                f"neither this account ({_named('uid', os.geteuid())}) nor its groups: another "
                                "account controls every object in it; chown it to the serving account or group")


def _mode(path: Path, st: os.stat_result) -> Optional[Finding]:
    mode = stat.S_IMODE(st.st_mode)
    if not mode & stat.S_IWOTH:
        return None
    if not mode & stat.S_ISVTX:
        return Finding(FAIL, _WHAT, f"{path} is world-writable without the sticky bit (mode {mode:04o}): any "
                                    "account can delete or replace the cache's objects; chmod o-w it (or +t)")
    keyed = bool(settings.read(settings.L3_KEY_FILE))
    return Finding(WARN, _WHAT, f"{path} is world-writable (mode {mode:04o}, sticky): any account can add "
                                "objects" + ("; the L3 key refuses forged ones" if keyed else
                                             f"; chmod o-w it, or set {settings.L3_KEY_FILE.name}"))


def _writable(path: Path) -> Optional[Finding]:
    try:  # permission bits alone do not tell (root, read-only mounts): as the store probes it
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return Finding(FAIL, _WHAT, f"{path} is not writable by this account: {exc}; fix its permissions or mount")
    return None


def _existing(path: Path, where: str) -> Finding:
    if not path.is_dir():
        return Finding(FAIL, _WHAT, f"{path} ({where}) exists and is not a directory; point the L3 at a directory")
    st = path.stat()
    problem = _owner(path, st) or _mode(path, st) or _writable(path)
    if problem is not None:
        return problem
    return Finding(OK, _WHAT, f"{path} ({where}): a directory of {_named('uid', st.st_uid)}, mode "
                              f"{stat.S_IMODE(st.st_mode):04o}, writable")


def _space(path: Path, extra_config: Any) -> Finding:
    from sglang_cp_hicache.l3_backends import file_capacity

    what = "L3 space"
    try:
        cap = file_capacity(extra_config)  # the store's own reading of max_size / min_free_space
    except ValueError as exc:
        return Finding(FAIL, what, f"{exc}; fix it in the extra config or SGLang's file-backend variables")
    base = _existing_ancestor(path)
    st = os.statvfs(base)
    free = st.f_bavail * st.f_frsize
    if not cap.bounded:
        return Finding(WARN, what, f"{_gib(free)} free under {base}, and no max_size or min_free_space: the L3 grows "
                                   "until the file system is full; set max_size (extra config or "
                                   f"{settings.FILE_MAX_SIZE.name})")
    if cap.max_size and cap.max_size > free:
        return Finding(WARN, what, f"max_size {_gib(cap.max_size)} is more than the {_gib(free)} free under {base}: "
                                   "the file system fills first; lower max_size or set min_free_space")
    if cap.min_free_space and free <= cap.min_free_space:
        return Finding(WARN, what, f"{_gib(free)} free under {base}, not above min_free_space "
                                   f"{_gib(cap.min_free_space)}: every write evicts first; free space or lower it")
    bound = ", ".join(f"{k} {_gib(v)}" for k, v in (("max_size", cap.max_size),
                                                     ("min_free_space", cap.min_free_space)) if v)
    return Finding(OK, what, f"{_gib(free)} free under {base}; {bound}")


def directory_findings(location: L3Location) -> list[Finding]:
    """A file L3's directory: usable, safe, with room."""
    path = Path(os.path.abspath(location.directory or ""))
    found = _existing(path, location.source) if path.exists() else _missing(path, location.source)
    if found.level == FAIL:
        return [found]
    return [found, _space(path, location.extra_config)]


def master_findings(master: str) -> list[Finding]:
    """A TCP connection to the Mooncake master ``host:port``, nothing more."""
    what = "Mooncake master"
    host, _, port = master.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=MASTER_TIMEOUT_S):
            pass
    except (OSError, ValueError) as exc:
        return [Finding(FAIL, what, f"{master} does not accept a TCP connection within {MASTER_TIMEOUT_S:.0f} s "
                                    f"({exc}); start mooncake_master there or fix master_server_address")]
    return [Finding(OK, what, f"{master} accepts TCP connections")]


def _mooncake(args: Any, release: Optional[str]) -> list[Finding]:
    from sglang_cp_hicache.l3_backends import SGLangRules, sglang_mooncake_config

    tp = args.tp_size if isinstance(args.tp_size, int) and args.tp_size > 0 else 1
    ranks = tp * (args.pp_size if release == "0.5.23" else 1)
    try:  # the store's own reading of its settings, for this server's rank 0
        config = sglang_mooncake_config(args.hicache_storage_backend_extra_config,
                                        SGLangRules(release or "0.5.23", segment_ranks=ranks))
    except (TypeError, ValueError) as exc:
        return [Finding(FAIL, "Mooncake settings", f"{exc}")]
    return master_findings(config.master_server_address)


def _key() -> Finding:
    from sglang_cp_hicache.l3.auth import seal_from_settings

    try:
        seal = seal_from_settings()
    except ValueError as exc:
        return Finding(FAIL, "L3 key", f"{exc}")
    if seal.scheme == "xxh3-64":
        return Finding(OK, "L3 key", f"none ({settings.L3_KEY_FILE.name} unset): objects are checked for damage, "
                                     "not forgery")
    return Finding(OK, "L3 key", "keyed (every object carries a keyed BLAKE3 MAC)")


def _model(args: Any) -> Finding:
    """The model as the L3 namespace names it (local files only, as at start-up)."""
    from sglang_cp_hicache.l3.identity import identity_of_server_args

    what = "L3 model identity"
    try:
        identity = identity_of_server_args(args, settings.read(settings.L3_MODEL_ID) or None)
    except ValueError as exc:  # a Hub model SGLang downloads at launch is named then; said, not failed
        return Finding(WARN, what, f"not resolvable from local files now: {exc}")
    return Finding(OK, what, f"{identity.weights[:80]}")


def l3_findings(args: Any, release: Optional[str], refused_above: bool = False) -> list[Finding]:
    """The L3 of the parsed launch arguments ``args``; ``refused_above``: an
    adapter's line already fails a backend or extra config ``l3_location`` refuses."""
    try:
        location = l3_location(args.hicache_storage_backend, args.hicache_storage_backend_extra_config)
    except ValueError as exc:
        if refused_above:  # said once, by the adapter's line
            return [Finding(WARN, "L3", "not checked: its backend or extra config is refused (see above)")]
        return [Finding(FAIL, "L3", f"{exc}")]
    if not location.enabled:
        return [Finding(OK, "L3", "off (no --hicache-storage-backend)")]
    if location.backend == "mooncake":
        return _mooncake(args, release) + [_key(), _model(args)]
    return directory_findings(location) + [_key(), _model(args)]
