"""Where L3 objects live: a storage-agnostic interface and a file store.

A store moves opaque blobs by page key; it neither builds nor trusts them
(readers verify every blob with ``envelope.unpack``). Any backend that can
answer the three calls of :class:`PageStore` serves the library.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, Union, runtime_checkable

from sglang_cp_hicache.l3.keys import check_page_key

__all__ = ["FilePageStore", "PageStore"]

logger = logging.getLogger(__name__)

Blob = Union[bytes, bytearray, memoryview]


@runtime_checkable
class PageStore(Protocol):
    """Batch calls by page key; one result per key, in order."""

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether an object is stored under each key (unverified)."""
        ...

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each key's object, ``None`` where there is none."""
        ...

    def put(self, keys: Sequence[str], blobs: Sequence[Blob]) -> list[bool]:
        """Store each blob under its key; False where the write failed."""
        ...


def _check_keys(keys: object) -> list[str]:
    if isinstance(keys, str) or not isinstance(keys, Sequence):
        raise TypeError(f"keys must be a list of page keys, got {type(keys).__name__}")
    return [check_page_key(f"keys[{i}]", key) for i, key in enumerate(keys)]


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


class FilePageStore:
    """One file per object, ``{directory}/{key[:2]}/{key}.bin``.

    The two-hex fan-out (256 subdirectories, uniform since keys start with a
    SHA-256) keeps directories small. Writes go to a unique temporary file in
    the same subdirectory and are renamed into place (``os.replace``, atomic),
    so a reader sees a whole object or none, and concurrent writers of one
    key end with one whole object. A key whose object already has the blob's
    size is skipped (pages are immutable by key); a different size (a
    truncated leftover) is replaced. ``fsync``: flush each object to disk
    before the rename (durability across power loss; readers verify either
    way).
    """

    def __init__(self, directory: Union[str, os.PathLike], *, fsync: bool = False) -> None:
        if not isinstance(fsync, bool):
            raise TypeError(f"fsync must be a bool, got {type(fsync).__name__}")
        self.directory = _check_directory(directory)
        self.fsync = fsync

    def path_of(self, key: str) -> Path:
        """The file that holds ``key``'s object."""
        check_page_key("key", key)
        return self.directory / key[:2] / f"{key}.bin"

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [self.path_of(key).is_file() for key in _check_keys(keys)]

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self._get_one(self.path_of(key)) for key in _check_keys(keys)]

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
        return [self._put_one(self.path_of(k), v) for k, v in zip(checked, views)]

    def _get_one(self, path: Path) -> bytes | None:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:  # unreadable counts as absent: a miss, never a crash
            logger.warning("L3 file store: cannot read %s: %s", path, err)
            return None

    def _put_one(self, path: Path, view: memoryview) -> bool:
        try:
            if path.stat().st_size == len(view):
                return True
        except FileNotFoundError:
            pass
        except OSError as err:
            logger.warning("L3 file store: cannot stat %s: %s", path, err)
            return False
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex}.tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(view)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
            return True
        except OSError as err:
            logger.warning("L3 file store: cannot write %s: %s", path, err)
            try:
                tmp.unlink()
            except OSError:
                pass
            return False
