"""Where L3 objects live: a storage-agnostic interface and a file store.

A store moves opaque blobs by page key; it neither builds nor trusts them
(readers verify every blob with ``envelope.unpack``; writers decide whether
an object already there is sound and may be kept, :func:`~.pages.store_owned`).
Any backend that can answer the three calls of :class:`PageStore` serves the
library.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol, Union, runtime_checkable

from sglang_cp_hicache.l3.capacity import CapacityConfig, DirectoryCapacity
from sglang_cp_hicache.l3.keys import check_page_key

__all__ = ["FilePageStore", "OpenObject", "PageStore", "SizeMismatch", "TMP_SUFFIX", "preadv_all", "writev_all"]

logger = logging.getLogger(__name__)

Blob = Union[bytes, bytearray, memoryview]

#: Temporary files (a write not yet renamed into place) end with this; no
#: reader ever opens one.
TMP_SUFFIX = ".tmp"
#: A temporary file untouched this long belongs to a writer that died (a
#: page is written in milliseconds to seconds): it is removed.
STALE_TMP_S = 600.0
#: How often a writing store looks for such files (besides at start-up).
SWEEP_EVERY_S = 600.0
#: Buffers one preadv/writev call takes (Linux's IOV_MAX).
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


@dataclass(frozen=True)
class SizeMismatch:
    """An object whose stored size is not the one the reader expects; its
    bytes were not read (a reader never loads more than one page's object)."""

    stored_bytes: int


@runtime_checkable
class PageStore(Protocol):
    """Batch calls by page key; one result per key, in order."""

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether an object is stored under each key (unverified)."""
        ...

    def get(self, keys: Sequence[str], sizes: Optional[Sequence[int]] = None) -> list[bytes | SizeMismatch | None]:
        """Each key's object, ``None`` where there is none. ``sizes``: the
        byte size each object must have; one of another size comes back as
        :class:`SizeMismatch` without its bytes being read."""
        ...

    def put(self, keys: Sequence[str], blobs: Sequence[Blob]) -> list[bool]:
        """Store each blob under its key, replacing what is there (atomically:
        a reader sees the old object or the new one); False where the write
        failed."""
        ...


def _advance(views: list[memoryview], done: int) -> list[memoryview]:
    """``views`` with their first ``done`` bytes consumed."""
    out = []
    for view in views:
        if done >= len(view):
            done -= len(view)
            continue
        out.append(view[done:])
        done = 0
    return out


def preadv_all(fd: int, views: Sequence[memoryview], offset: int = 0, *, cached_only: bool = False) -> int:
    """Fill ``views`` from ``fd`` at ``offset`` (scatter reads, retried on a
    short read); returns the bytes read (fewer only at end of file).
    ``cached_only``: from the page cache alone (``RWF_NOWAIT``): raises
    BlockingIOError, or returns short, where a byte is not cached."""
    if not views:
        return 0
    flags = os.RWF_NOWAIT if cached_only else 0
    total = os.preadv(fd, views[:_IOV_MAX], offset, flags)  # the usual case: this one call fills every view
    if total == 0 or (len(views) <= _IOV_MAX and total == sum(map(len, views))):
        return total
    pending = _advance(list(views), total)
    while pending:
        got = os.preadv(fd, pending[:_IOV_MAX], offset + total, flags)
        if got == 0:
            break
        total += got
        pending = _advance(pending, got)
    return total


def writev_all(fd: int, views: Sequence[memoryview]) -> int:
    """Write every byte of ``views`` to ``fd`` (gather writes, retried on a
    short write); returns the bytes written."""
    pending = [v for v in views if len(v)]
    total = 0
    while pending:
        done = os.writev(fd, pending[:_IOV_MAX])
        total += done
        pending = _advance(pending, done)
    return total


def _check_keys(keys: object) -> list[str]:
    if isinstance(keys, str) or not isinstance(keys, Sequence):
        raise TypeError(f"keys must be a list of page keys, got {type(keys).__name__}")
    return [check_page_key(f"keys[{i}]", key) for i, key in enumerate(keys)]


def check_sizes(sizes: object, count: int) -> list[Optional[int]]:
    """``sizes`` of :meth:`PageStore.get`: None, or one byte size per key."""
    if sizes is None:
        return [None] * count
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise TypeError(f"sizes must be a list of byte sizes, got {type(sizes).__name__}")
    if len(sizes) != count:
        raise ValueError(f"sizes must have one entry per key ({count}), got {len(sizes)}")
    for i, size in enumerate(sizes):
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"sizes[{i}] must be an int >= 0, got {size!r}")
    return list(sizes)


def _check_directory(directory: object) -> Path:
    """``directory`` as a Path, created if missing, proven writable by
    creating and removing a file in it: permission bits alone do not tell
    (root writes through 0o500; a read-only mount ignores them)."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a str or path, got {type(directory).__name__}")
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError as err:
        raise ValueError(f"directory {str(path)!r} exists and is not a directory") from err
    except OSError as err:
        raise ValueError(f"directory {str(path)!r} cannot be created: {err}") from err
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ValueError(f"directory {str(path)!r} is not writable: {err}") from err
    return path


class OpenObject:
    """One object of a :class:`FilePageStore`, open and of the expected size.

    :meth:`read` fills buffers from it; with ``cached_only`` it takes the
    bytes from the page cache alone (``preadv2(RWF_NOWAIT)``) and never
    waits on the device or the network: the read an L3 job may run while it
    holds its publish lock, straight into host rows. Close it (or use it as
    a context manager) when done.
    """

    def __init__(self, fd: int, size: int, path: str, capacity: Optional[DirectoryCapacity]) -> None:
        self.fd, self.size, self.path = fd, size, path
        self._capacity = capacity

    def read(self, views: Sequence[memoryview], *, cached_only: bool = False) -> Optional[int]:
        """Fill ``views`` from the object's start; returns the bytes read
        (fewer than the views hold only if the file shrank), or None on an
        I/O error. ``cached_only``: 0 unless every byte was in the page
        cache (the views may then hold part of the object)."""
        try:
            got = preadv_all(self.fd, views, cached_only=cached_only)
        except BlockingIOError:
            return 0
        except OSError as err:
            if cached_only and err.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                return 0  # this file system cannot tell: the caller reads the waiting way
            logger.warning("L3 file store: cannot read %s: %s", self.path, err)
            return None
        if got == self.size and self._capacity is not None:
            self._capacity.touch(Path(self.path))
        return 0 if cached_only and got < sum(map(len, views)) else got

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def __enter__(self) -> "OpenObject":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FilePageStore:
    """One file per object, ``{directory}/{key[:2]}/{key}.bin``.

    The two-hex fan-out (256 subdirectories, uniform since keys start with a
    SHA-256) keeps directories small. Writes go to a unique temporary file in
    the same subdirectory and are renamed into place (``os.replace``, atomic),
    so a reader sees a whole object or none, and concurrent writers of one
    key end with one whole object. ``fsync``: flush each object to disk
    before the rename (durability across power loss; readers verify either
    way). Temporary files of writers that died (untouched for
    :data:`STALE_TMP_S`) are removed when the store opens and, while it
    writes, every :data:`SWEEP_EVERY_S`. With ``capacity`` the directory is
    bounded (:mod:`.capacity`): every write reserves its bytes first, evicting
    chains from their ends, and every read marks the object used.
    """

    def __init__(
        self, directory: Union[str, os.PathLike], *, fsync: bool = False, capacity: Optional[CapacityConfig] = None
    ) -> None:
        if not isinstance(fsync, bool):
            raise TypeError(f"fsync must be a bool, got {type(fsync).__name__}")
        if capacity is not None and not isinstance(capacity, CapacityConfig):
            raise TypeError(f"capacity must be a CapacityConfig, got {type(capacity).__name__}")
        self.directory = _check_directory(directory)
        self._root = os.fspath(self.directory)
        self.fsync = fsync
        # The bound (max_size / min_free_space), None: unbounded.
        self.capacity = DirectoryCapacity(self.directory, capacity) if capacity and capacity.bounded else None
        self.swept_files = 0
        self._sweep_lock = threading.Lock()
        self._last_sweep = 0.0
        self.sweep()

    def path_of(self, key: str) -> Path:
        """The file that holds ``key``'s object."""
        return Path(self._file_of(key))

    def _file_of(self, key: str) -> str:
        """:meth:`path_of` as a str (no Path objects built on the read path)."""
        check_page_key("key", key)
        return f"{self._root}/{key[:2]}/{key}.bin"

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [self.path_of(key).is_file() for key in _check_keys(keys)]

    def get(self, keys: Sequence[str], sizes: Optional[Sequence[int]] = None) -> list[bytes | SizeMismatch | None]:
        checked = _check_keys(keys)
        expected = check_sizes(sizes, len(checked))
        return [self._get_one(self.path_of(key), size) for key, size in zip(checked, expected)]

    def put(self, keys: Sequence[str], blobs: Sequence[Blob]) -> list[bool]:
        checked = _check_keys(keys)
        if isinstance(blobs, (bytes, bytearray, memoryview)) or not isinstance(blobs, Sequence):
            raise TypeError(f"blobs must be a list of bytes-like objects, got {type(blobs).__name__}")
        if len(blobs) != len(checked):
            raise ValueError(f"blobs must have one entry per key ({len(checked)}), got {len(blobs)}")
        views = []
        for i, blob in enumerate(blobs):
            if not isinstance(blob, (bytes, bytearray, memoryview)):
                raise TypeError(f"blobs[{i}] must be bytes-like, got {type(blob).__name__}")
            views.append(memoryview(blob).cast("B"))
        return [self.write_from(k, [v]) for k, v in zip(checked, views)]

    def read_into(self, key: str, size: int, views: Sequence[memoryview]) -> int | SizeMismatch | None:
        """Read ``key``'s object, which must be ``size`` bytes, straight into
        ``views`` (their lengths add up to ``size``) in one scatter read;
        None where there is no object. The size comes from the open file
        (fstat) before any byte is read: a huge (or sparse) file under a
        key's name costs nothing."""
        opened = self.open_object(key, size)
        if not isinstance(opened, OpenObject):
            return opened
        with opened:
            got = opened.read(views)
        return got if got == size or got is None else SizeMismatch(got)

    def open_object(self, key: str, size: int) -> "OpenObject | SizeMismatch | None":
        """``key``'s object opened for reading, if it is there and is
        ``size`` bytes (fstat: no byte read); None where there is none (or
        it cannot be opened: a miss, never a crash). Opening can wait on
        storage; :meth:`OpenObject.read` with ``cached_only`` never does."""
        path = self._file_of(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as err:  # unreadable counts as absent: a miss, never a crash
            logger.warning("L3 file store: cannot read %s: %s", path, err)
            return None
        try:
            stored = os.fstat(fd).st_size
        except OSError as err:
            os.close(fd)
            logger.warning("L3 file store: cannot read %s: %s", path, err)
            return None
        if stored != size:
            os.close(fd)
            return SizeMismatch(stored)
        return OpenObject(fd, size, path, self.capacity)

    def write_from(self, key: str, views: Sequence[memoryview]) -> bool:
        """Store the concatenation of ``views`` under ``key`` in one gather
        write (no joined copy), renamed into place whole; False where the
        write failed."""
        path = self.path_of(key)
        size = sum(len(v) for v in views)
        reserved = None
        if self.capacity is not None:
            reserved = self.capacity.reserve(path.name, size)
            if reserved is None:
                logger.warning("L3 file store: no room for %s under the directory's bound", key)
                return False
        ok = self._put_one(path, views)
        if self.capacity is not None:
            self.capacity.done(path.name, reserved, ok)
        if time.monotonic() - self._last_sweep > SWEEP_EVERY_S:
            self.sweep()
        return ok

    def _get_one(self, path: Path, size: Optional[int]) -> bytearray | SizeMismatch | None:
        try:
            with open(path, "rb", buffering=0) as f:
                stored = os.fstat(f.fileno()).st_size
                if size is not None and stored != size:
                    return SizeMismatch(stored)
                data = bytearray(stored)
                got = preadv_all(f.fileno(), [memoryview(data)])
                return data if got == stored else SizeMismatch(got)
        except FileNotFoundError:
            return None
        except OSError as err:  # unreadable counts as absent: a miss, never a crash
            logger.warning("L3 file store: cannot read %s: %s", path, err)
            return None

    def sweep(self, max_age_s: float = STALE_TMP_S) -> int:
        """Remove temporary files untouched for ``max_age_s`` seconds (their
        writers died mid-write); returns how many."""
        if not self._sweep_lock.acquire(blocking=False):
            return 0  # another thread sweeps right now
        removed = 0
        try:
            self._last_sweep = time.monotonic()
            cutoff = time.time() - max_age_s
            for sub in os.scandir(self.directory):
                if not sub.is_dir(follow_symlinks=False):
                    continue
                for entry in os.scandir(sub.path):
                    if not entry.name.endswith(TMP_SUFFIX):
                        continue
                    try:
                        if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                            os.unlink(entry.path)
                            removed += 1
                    except OSError:
                        pass  # gone already, or another deployment's to remove
        except OSError as err:
            logger.warning("L3 file store: cannot sweep %s: %s", self.directory, err)
        finally:
            self._sweep_lock.release()
        if removed:
            self.swept_files += removed
            logger.info("L3 file store: removed %d temporary file(s) of dead writers in %s", removed, self.directory)
        return removed

    def _put_one(self, path: Path, views: Sequence[memoryview]) -> bool:
        tmp = path.with_name(
            f".{path.name}.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex}{TMP_SUFFIX}"
        )
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        try:
            try:
                fd = os.open(tmp, flags, 0o644)
            except FileNotFoundError:  # the key's subdirectory is not there yet (or was cleared)
                path.parent.mkdir(exist_ok=True)
                fd = os.open(tmp, flags, 0o644)
            try:
                writev_all(fd, views)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            return True
        except OSError as err:
            logger.warning("L3 file store: cannot write %s: %s", path, err)
            try:
                tmp.unlink()
            except OSError:
                pass
            return False
