"""Where L3 objects live: a storage-agnostic interface and a file store.

A store moves opaque blobs by page key; it neither builds nor trusts them
(readers verify every blob with ``envelope.unpack``; writers decide whether
an object already there is sound and may be kept, :func:`~.pages.store_verified`).
Any backend that can answer the three calls of :class:`PageStore` serves the
library.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol, Union, runtime_checkable

from sglang_cp_hicache.l3.capacity import CapacityConfig, DirectoryCapacity, is_capacity_tmp
from sglang_cp_hicache.l3.keys import check_page_key
from sglang_cp_hicache.l3.safe_files import READ_FLAGS, create_exclusive, iter_subdirs, open_regular, open_subdir

__all__ = [
    "FilePageStore", "OpenObject", "PageStore", "SizeMismatch", "TMP_SUFFIX", "check_blobs", "check_keys", "check_sizes",
    "preadv_all", "writev_all",
]

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


def check_keys(keys: object) -> list[str]:
    """``keys`` of every :class:`PageStore` call: a list of page keys."""
    if isinstance(keys, str) or not isinstance(keys, Sequence):
        raise TypeError(f"keys must be a list of page keys, got {type(keys).__name__}")
    return [check_page_key(f"keys[{i}]", key) for i, key in enumerate(keys)]


def check_blobs(blobs: object, count: int) -> list[memoryview]:
    """``blobs`` of :meth:`PageStore.put`: one bytes-like object per key, as byte views."""
    if isinstance(blobs, (bytes, bytearray, memoryview)) or not isinstance(blobs, Sequence):
        raise TypeError(f"blobs must be a list of bytes-like objects, got {type(blobs).__name__}")
    if len(blobs) != count:
        raise ValueError(f"blobs must have one entry per key ({count}), got {len(blobs)}")
    views = []
    for i, blob in enumerate(blobs):
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise TypeError(f"blobs[{i}] must be bytes-like, got {type(blob).__name__}")
        views.append(memoryview(blob).cast("B"))
    return views


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
    (root writes through 0o500; a read-only mount ignores them). A
    world-writable directory without the sticky bit is refused."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a str or path, got {type(directory).__name__}")
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        mode = path.stat().st_mode
    except FileExistsError as err:
        raise ValueError(f"directory {str(path)!r} exists and is not a directory") from err
    except OSError as err:
        raise ValueError(f"directory {str(path)!r} cannot be created: {err}") from err
    if not stat.S_ISDIR(mode):
        raise ValueError(f"directory {str(path)!r} exists and is not a directory")
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        raise ValueError(
            f"directory {str(path)!r} is world-writable without the sticky bit (mode {stat.S_IMODE(mode):o}): "
            "anyone can delete or replace other users' files in it, so the tier's lock, state and objects are "
            "not safe there; use a private or group directory (e.g. chmod 2770), or chmod +t it"
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ValueError(f"directory {str(path)!r} is not writable: {err}") from err
    return path


def _in_shared_temp_dir(path: Path) -> bool:
    """Whether ``path`` lies below the system temp dir or another
    world-writable directory (``/var/tmp``, ``/dev/shm``) with no directory
    on the way that is this account's alone: any local user could have
    created it first, or can fill it."""
    try:
        real, temp = path.resolve(), Path(tempfile.gettempdir()).resolve()
    except OSError:
        return False
    exposed, euid = False, os.geteuid()
    for step in (*reversed(real.parents), real):
        try:
            st = step.stat()
        except OSError:
            return exposed
        if step == temp or st.st_mode & stat.S_IWOTH:
            exposed = True
        elif exposed and st.st_uid == euid and not st.st_mode & 0o077:
            exposed = False  # private to this account: no one else created or reaches what is below
    return exposed


def _warn_if_in_temp_dir(path: Path) -> None:
    if _in_shared_temp_dir(path):
        logger.warning(
            "L3 file store: %s is in the system temp dir or another world-writable directory (SGLang's default "
            "is /tmp/hicache): other local users "
            "can pre-create it or fill it, and the server would use what they left there; choose a private "
            "directory with SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, file_storage_path of "
            "--hicache-storage-backend-extra-config or SGLANG_CP_HICACHE_L3_DIR", path)


def _subdir_mode(root_mode: int) -> int:
    """A key subdirectory is never more open than the directory itself
    (a umask of 0 must not make world-writable subdirectories of a group
    one); it keeps the sticky bit of a sticky one."""
    return (stat.S_IMODE(root_mode) & 0o777 | 0o700) | (root_mode & stat.S_ISVTX)


def _open_for_read(path: str) -> Optional[tuple[int, os.stat_result]]:
    """``path`` opened for reading with its fstat (no link followed, no wait
    on a FIFO, nothing but a regular file); None where there is no object or
    it cannot be used: a miss, never a crash (logged)."""
    try:
        return open_regular(path, READ_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as err:  # unreadable, a link (ELOOP), a FIFO or a directory
        logger.warning("L3 file store: cannot read %s: %s", path, err)
        return None


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
            self._capacity.touch(self.fd)
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
        _warn_if_in_temp_dir(self.directory)
        self._root = os.fspath(self.directory)
        self._subdir_mode = _subdir_mode(self.directory.stat().st_mode)
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
        return [self._is_object(self._file_of(key)) for key in check_keys(keys)]

    @staticmethod
    def _is_object(path: str) -> bool:
        """A regular file (not a link to one: it is never read)."""
        try:
            return stat.S_ISREG(os.stat(path, follow_symlinks=False).st_mode)
        except OSError:
            return False

    def get(self, keys: Sequence[str], sizes: Optional[Sequence[int]] = None) -> list[bytes | SizeMismatch | None]:
        checked = check_keys(keys)
        expected = check_sizes(sizes, len(checked))
        return [self._get_one(self.path_of(key), size) for key, size in zip(checked, expected)]

    def put(self, keys: Sequence[str], blobs: Sequence[Blob]) -> list[bool]:
        checked = check_keys(keys)
        return [self.write_from(k, [v]) for k, v in zip(checked, check_blobs(blobs, len(checked)))]

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
        opened = _open_for_read(path)
        if opened is None:
            return None
        fd, st = opened
        if st.st_size != size:
            os.close(fd)
            return SizeMismatch(st.st_size)
        return OpenObject(fd, size, path, self.capacity)

    def write_from(self, key: str, views: Sequence[memoryview]) -> bool:
        """Store the concatenation of ``views`` under ``key`` in one gather
        write (no joined copy), renamed into place whole; False where the
        write failed."""
        path = self.path_of(key)
        size = sum(len(v) for v in views)
        reserved = None
        if self.capacity is not None:
            try:
                reserved = self.capacity.reserve(path.name, size)
            except OSError as err:  # the lock or state was tampered with: this write fails, the server goes on
                logger.warning("L3 file store: cannot write %s: %s", key, err)
                return False
            if reserved is None:
                logger.warning("L3 file store: no room for %s under the directory's bound", key)
                return False
        ok = self._put_one(path, views)
        if self.capacity is not None:
            try:
                self.capacity.done(path.name, reserved, ok)
            except OSError as err:  # the registration lapses (STALE_PENDING_S); the write itself stands
                logger.warning("L3 file store: cannot record the write of %s: %s", key, err)
        if time.monotonic() - self._last_sweep > SWEEP_EVERY_S:
            self.sweep()
        return ok

    def _get_one(self, path: Path, size: Optional[int]) -> bytearray | SizeMismatch | None:
        opened = _open_for_read(os.fspath(path))
        if opened is None:
            return None
        fd, st = opened
        try:
            if size is not None and st.st_size != size:
                return SizeMismatch(st.st_size)
            data = bytearray(st.st_size)
            got = preadv_all(fd, [memoryview(data)])
            return data if got == st.st_size else SizeMismatch(got)
        except OSError as err:
            logger.warning("L3 file store: cannot read %s: %s", path, err)
            return None
        finally:
            os.close(fd)

    def sweep(self, max_age_s: float = STALE_TMP_S) -> int:
        """Remove temporary files untouched for ``max_age_s`` seconds (their
        writers died mid-write): objects' in the key subdirectories, the
        capacity state's in the directory; returns how many."""
        if not self._sweep_lock.acquire(blocking=False):
            return 0  # another thread sweeps right now
        removed = 0
        try:
            self._last_sweep = time.monotonic()
            cutoff = time.time() - max_age_s
            root_fd = os.open(self._root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                removed += _sweep_in(root_fd, is_capacity_tmp, cutoff)
            finally:
                os.close(root_fd)
            for _, fd in iter_subdirs(self._root):
                removed += _sweep_in(fd, lambda name: name.endswith(TMP_SUFFIX), cutoff)
        except OSError as err:
            logger.warning("L3 file store: cannot sweep %s: %s", self.directory, err)
        finally:
            self._sweep_lock.release()
        if removed:
            self.swept_files += removed
            logger.info("L3 file store: removed %d temporary file(s) of dead writers in %s", removed, self.directory)
        return removed

    def _put_one(self, path: Path, views: Sequence[memoryview]) -> bool:
        # Every step is relative to the key's subdirectory opened without
        # following a link: a subdirectory swapped for one refuses the write
        # (ENOTDIR) instead of sending it elsewhere.
        tmp = None
        try:
            sub = open_subdir(self._root, path.parent.name, create=True, mode=self._subdir_mode)
        except OSError as err:
            logger.warning("L3 file store: cannot write %s: %s", path, err)
            return False
        try:
            fd, tmp = create_exclusive("", f".{path.name}.{os.getpid()}.", TMP_SUFFIX, dir_fd=sub)
            try:
                writev_all(fd, views)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path.name, src_dir_fd=sub, dst_dir_fd=sub)
            return True
        except OSError as err:
            logger.warning("L3 file store: cannot write %s: %s", path, err)
            if tmp is not None:
                try:
                    os.unlink(tmp, dir_fd=sub)
                except OSError:
                    pass
            return False
        finally:
            os.close(sub)


def _sweep_in(dir_fd: int, is_tmp: Callable[[str], bool], cutoff: float) -> int:
    """Remove the temporary files in ``dir_fd`` last changed before
    ``cutoff`` (a link is removed, never followed); returns how many."""
    removed = 0
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            if not is_tmp(entry.name):
                continue
            try:
                if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                    os.unlink(entry.name, dir_fd=dir_fd)
                    removed += 1
            except OSError:
                pass  # gone already, or another deployment's to remove
    return removed
