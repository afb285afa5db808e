"""Files in a shared L3 directory, made and opened without following links.

Whoever can write the directory is treated as hostile: they can plant a
symbolic link, a FIFO or a device under any name the tier uses, or swap a
key's subdirectory for a link. So:

* every file the tier creates is made exclusively under a random name
  (``O_CREAT | O_EXCL | O_NOFOLLOW``) and renamed into place: a rename
  replaces a link planted at the final name, it never writes through it;
* every file it opens is opened with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO
  opens at once instead of blocking) and used only if ``fstat`` says it is
  a regular file;
* a key's subdirectory is opened with ``O_DIRECTORY | O_NOFOLLOW`` and
  entries are created, listed and removed relative to that descriptor, so
  a subdirectory swapped for a link never redirects a write or an unlink.

Files are created ``0o666`` and directories ``0o777`` less the umask (the
kernel applies it, or a default ACL where one is set): accounts sharing a
group directory (setgid, umask ``002``) share the tier.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from typing import Iterator

__all__ = [
    "CREATE_FLAGS", "DIR_FLAGS", "FILE_MODE", "READ_FLAGS", "create_exclusive", "iter_subdirs", "open_regular",
    "open_subdir", "write_all",
]

#: Opening an existing file to read: no link followed, no wait on a FIFO.
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: Creating a file: only a new one, never through a link.
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: Opening a directory to work in: never through a link.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: New files: read-write for all, less the umask (the kernel applies it).
FILE_MODE = 0o666


def not_regular(path: str, mode: int) -> OSError:
    """The error for ``path`` found to be something other than a regular file."""
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "not a regular file"
    return OSError(errno.EINVAL, f"{path} is {kind}: refused (only regular files are used in an L3 directory)")


def open_regular(path: str, flags: int = READ_FLAGS, mode: int = FILE_MODE) -> tuple[int, os.stat_result]:
    """``path`` opened without following a link, with its fstat; raises
    OSError for anything but a regular file (the descriptor then closed)."""
    fd = os.open(path, flags, mode)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise not_regular(path, st.st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def create_exclusive(directory: str, prefix: str, suffix: str = "", *, dir_fd: int | None = None) -> tuple[int, str]:
    """A new file ``{prefix}{random}{suffix}`` in ``directory`` (or
    relative to ``dir_fd``), open for writing; returns its descriptor and
    name. The name cannot be predicted, and the create fails rather than
    follow a link."""
    while True:
        name = f"{prefix}{secrets.token_hex(8)}{suffix}"
        path = name if dir_fd is not None else f"{directory}/{name}"
        try:
            return os.open(path, CREATE_FLAGS, FILE_MODE, dir_fd=dir_fd), name
        except FileExistsError:
            continue  # a 64-bit collision, or a name planted in advance: draw again


def write_all(fd: int, data: bytes) -> None:
    """Every byte of ``data`` written to ``fd`` (retried on a short write)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def open_subdir(root: str, name: str, *, create: bool = False, mode: int = 0o777) -> int:
    """``root/name`` opened as a directory, never through a link (ENOTDIR
    where it is one); made with ``mode`` (less the umask) if ``create`` and
    missing."""
    path = f"{root}/{name}"
    try:
        return os.open(path, DIR_FLAGS)
    except FileNotFoundError:
        if not create:
            raise
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass  # a peer made it meanwhile
    return os.open(path, DIR_FLAGS)


def iter_subdirs(root: str) -> Iterator[tuple[str, int]]:
    """Each real subdirectory of ``root`` (links skipped) as (name, open
    descriptor); the descriptor is closed when the iteration moves on."""
    with os.scandir(root) as entries:
        names = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
    for name in names:
        try:
            fd = open_subdir(root, name)
        except OSError:
            continue  # removed, or swapped for a link, meanwhile
        try:
            yield name, fd
        finally:
            os.close(fd)
