"""Check the files a run will write (``--json``, ``--plot``) before it starts.

A run takes seconds to minutes; finding out at the end that its summary
cannot be written loses it. Each path must name a file (not a directory) in
an existing directory where this process can create it, or an existing file
it can write to, and no two paths (outputs, or an output and the trace the
run reads) may name one file. The check opens nothing it keeps and leaves no
file behind.
"""

from __future__ import annotations

import errno
import os
import tempfile
from typing import Mapping, Optional

__all__ = ["OutputPathError", "check_output_path", "check_output_paths", "same_file"]


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


def same_file(a: str, b: str) -> bool:
    """Whether two paths name one file: the same inode when both exist
    (symlinks and hard links included), else the same resolved path."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return os.path.realpath(a) == os.path.realpath(b)


def check_output_paths(
    paths: Mapping[str, Optional[str]], inputs: Optional[Mapping[str, Optional[str]]] = None
) -> None:
    """Check every ``{flag: path}`` given (None: not requested); no two
    flags may name one file, and no output may name an input (``inputs``,
    e.g. ``{"--trace": path}``): writing it would destroy what the run reads."""
    seen: list[tuple[str, str]] = [(flag, path) for flag, path in (inputs or {}).items() if path is not None]
    for flag, path in paths.items():
        if path is None:
            continue
        for other_flag, other in seen:
            if isinstance(path, str) and path and same_file(path, other):
                raise OutputPathError(f"{other_flag} and {flag} name the same file: {path}")
        check_output_path(flag, path)
        seen.append((flag, path))
