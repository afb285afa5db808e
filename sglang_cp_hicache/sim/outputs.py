"""Check the files a run will write (``--json``, ``--plot``) before it starts.

A run takes seconds to minutes; finding out at the end that its summary
cannot be written loses it. Each path must name a file (not a directory) in
an existing directory where this process can create it, or an existing file
it can write to. The check opens nothing it keeps and leaves no file behind.
"""

from __future__ import annotations

import errno
import os
import tempfile
from typing import Mapping, Optional

__all__ = ["OutputPathError", "check_output_path", "check_output_paths"]


class OutputPathError(ValueError):
    """An output path the run could not write; ``str()`` names flag and path."""


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)


def check_output_path(flag: str, path: str) -> None:
    """Raise :class:`OutputPathError` unless the run can write ``path``."""
    if not isinstance(path, str) or not path:
        raise OutputPathError(f"{flag}: expected a file path, got {path!r}")
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise OutputPathError(f"{flag} {path}: is a directory, expected a file path")
    parent = os.path.dirname(full)
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise OutputPathError(f"{flag} {path}: the directory {parent} {what}")
    try:
        if os.path.lexists(full):
            # write access to what is there, without truncating it or blocking on a FIFO
            fd = os.open(full, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
            os.close(fd)
        else:
            fd, probe = tempfile.mkstemp(dir=parent, prefix=".sglang-cp-hicache-probe-")
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        reason = "nothing reads from this FIFO" if exc.errno == errno.ENXIO else _why(exc)
        raise OutputPathError(f"{flag} {path}: cannot write there: {reason}") from None


def check_output_paths(paths: Mapping[str, Optional[str]]) -> None:
    """Check every ``{flag: path}`` given (None: not requested); two flags may
    not name the same file."""
    seen: dict[str, str] = {}
    for flag, path in paths.items():
        if path is None:
            continue
        check_output_path(flag, path)
        key = os.path.realpath(path)
        if key in seen:
            raise OutputPathError(f"{seen[key]} and {flag} name the same file: {path}")
        seen[key] = flag
