"""A bound on a file L3 directory: SGLang's ``max_size`` and
``min_free_space``, held by every writer of the directory at once.

* **One state for all writers.** Every rank of every deployment writing the
  directory reserves a page's bytes before writing it, under an exclusive
  ``flock`` of ``DIR/.l3-capacity.lock``, in one shared state
  (``DIR/.l3-capacity``: the bytes in use and the objects being written). A
  reservation is made before its object exists, so the directory holds at
  most the cap plus the objects being written (one per writer thread); a
  failed write gives its reservation back.
* **Chains are evicted from their ends.** An object's key names its page
  and its parent (the page before it in its chain), so the names alone show
  the chains. When a write does not fit, the writer scans the directory
  (under the lock: every object is either stored or registered as being
  written, so the scan sees every link) and evicts only *leaves* -- pages
  no stored or registered object names as its parent -- least recently used
  first (file mtime: a read touches it), with every object of the page (KV
  and indexer, any namespace: the same tokens), until the directory is at
  ``eviction_ratio`` of the cap; evicting a leaf can make its parent a leaf.
  A chain is never cut in the middle while a tail could go.
* **Readers only ever miss.** An object is unlinked whole; a reader that
  opened it reads it whole, one that comes later finds nothing.
* **One bound per directory.** The state records the ``max_size`` and
  ``min_free_space`` it was made with; a writer asking another bound is
  refused at open (two bounds on one directory evict against each other).
* **Dead writers let go.** A registration names its writer (pid, host,
  boot, pid namespace): one whose writer is gone from this host is dropped
  when the state is read; another host's, after ``capacity_state.STALE_PENDING_S``.
* **Frees counted, not re-read.** Evicting for the free-space floor counts
  the bytes it unlinks (ZFS, btrfs and NFS show a free late) and evicts a
  margin of ``(1 - eviction_ratio) * min_free_space`` past the floor, so the
  next writes fit without a rescan.
* **Nothing through a link** (:mod:`.safe_files`): the state is written to
  a new file of a random name and renamed into place, the lock and state
  are opened without following a link and used only if regular files.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import heapq
import json
import logging
import os
import random
import re
import stat
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

from sglang_cp_hicache.l3.capacity_state import HOST, State, drop_dead_writers, parse_state
from sglang_cp_hicache.l3.keys import DIGEST_CHARS, PAGE_HASH_CHARS, PARENT_CHARS, ROOT_PARENT
from sglang_cp_hicache.l3.safe_files import (
    FILE_MODE, create_exclusive, iter_subdirs, open_regular, open_subdir, write_all,
)
from sglang_cp_hicache.sizes import parse_eviction_ratio, parse_file_size

__all__ = ["CAPACITY_TMP_PREFIX", "CapacityConfig", "DirectoryCapacity", "EVICTION_POLICIES", "is_capacity_tmp"]

logger = logging.getLogger(__name__)

EVICTION_POLICIES = ("lru-leaves", "random-chains")
#: How long bytes freed for the free-space floor are counted before the
#: file system shows them (ZFS commits within seconds, NFS caches a minute).
FLOOR_CREDIT_S = 60.0
_STATE_FILE = ".l3-capacity"
_LOCK_FILE = ".l3-capacity.lock"
#: The state's temporary files (random names): the store's sweep removes a dead writer's.
CAPACITY_TMP_PREFIX = ".l3-capacity.tmp."
_LEGACY_TMP = re.compile(r"^\.l3-capacity\.\d+\.\d+$")  # {pid}.{thread}: earlier releases'
#: A state file larger than this is not one (it is rebuilt, never read into memory).
_STATE_MAX_BYTES = 1 << 24
_NAME = re.compile(
    rf"^(?P<hash>[0-9a-f]{{{PAGE_HASH_CHARS}}})_(?P<digest>[0-9a-f]{{{DIGEST_CHARS}}})_"
    rf"(?P<parent>[0-9a-f]{{{PARENT_CHARS}}}|{ROOT_PARENT})\.bin$"
)


def is_capacity_tmp(name: str) -> bool:
    """Whether ``name`` is a temporary file of the shared state."""
    return name.startswith(CAPACITY_TMP_PREFIX) or _LEGACY_TMP.match(name) is not None


@dataclass(frozen=True)
class CapacityConfig:
    """``max_size`` / ``min_free_space`` in bytes (0: no bound);
    ``eviction_ratio``: a write that finds the directory full evicts down
    to this share of the cap (fewer, larger rounds), as SGLang's does;
    ``policy``: ``lru-leaves``, or ``random-chains`` for comparisons."""

    max_size: int = 0
    min_free_space: int = 0
    eviction_ratio: float = 0.9
    policy: str = "lru-leaves"

    @property
    def bounded(self) -> bool:
        return self.max_size > 0 or self.min_free_space > 0

    @classmethod
    def from_sources(cls, extra: Mapping[str, Any], environ: Mapping[str, str], policy: str) -> "CapacityConfig":
        """From the extra config (``max_size``, ``min_free_space``,
        ``eviction_ratio``), else SGLang's variables
        ``SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE`` / ``..._MIN_FREE_SPACE`` /
        ``..._EVICTION_RATIO`` (``environ``: their values as read)."""
        def pick(key: str, env: str) -> object:
            return extra[key] if extra.get(key) is not None else environ.get(env) or None

        ratio = parse_eviction_ratio("eviction_ratio", pick("eviction_ratio", "SGLANG_HICACHE_FILE_BACKEND_EVICTION_RATIO"))
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction policy must be one of {EVICTION_POLICIES}, got {policy!r}")
        return cls(
            max_size=parse_file_size("max_size", pick("max_size", "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE")),
            min_free_space=parse_file_size("min_free_space",
                                           pick("min_free_space", "SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE")),
            eviction_ratio=ratio, policy=policy,
        )


@dataclass
class _Page:
    names: list[str]
    parent: str
    size: int
    mtime: float


class DirectoryCapacity:
    """The bound of one file L3 directory, as one writer process holds it
    (see the module doc)."""

    def __init__(self, directory: Path, config: CapacityConfig) -> None:
        self.directory = directory
        self._root = os.fspath(directory)
        self.configured = config
        fs = os.statvfs(directory)
        total = fs.f_blocks * fs.f_frsize
        if config.max_size and total and config.max_size > total - config.min_free_space:
            logger.warning("L3 directory cap %d B is above what the file system holds (%d B); clamping",
                           config.max_size, total - config.min_free_space)
            config = replace(config, max_size=max(1, total - config.min_free_space))
        self.config = config
        self.evicted_objects = 0
        self.evicted_bytes = 0
        self.refused_writes = 0
        self._mutex = threading.Lock()  # a flock is per open file: this process's threads queue here
        self._random = random.Random(0)
        try:
            with self._locked():
                state = self._read_state()
                self._check_bound(state)
                self._make_room(state, 0)
                self._write_state(state)
        except OSError as err:
            raise ValueError(f"directory {self._root!r}: cannot use its capacity state: {err}") from err

    def _check_bound(self, state: State) -> None:
        """Refuse a bound other than the one the directory's state records."""
        mine = (self.configured.max_size, self.configured.min_free_space)
        if state.max_size is None or state.min_free_space is None:
            state.max_size, state.min_free_space = mine
            return
        if (state.max_size, state.min_free_space) != mine:
            raise ValueError(
                f"L3 directory {self._root!r} is bounded at max_size={state.max_size} B, "
                f"min_free_space={state.min_free_space} B by the servers writing it; this one asks "
                f"max_size={mine[0]} B, min_free_space={mine[1]} B. Every deployment writing one directory "
                "must use the same bound (SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE / _MIN_FREE_SPACE, or max_size / "
                "min_free_space in --hicache-storage-backend-extra-config); to change it, stop every server "
                f"writing the directory and remove {self._root}/{_STATE_FILE}"
            )

    # ---- writes ------------------------------------------------------------------------
    def reserve(self, name: str, size: int) -> Optional[int]:
        """Room for object ``name`` of ``size`` bytes (replacing what is under
        the name, if anything), evicting as needed; returns the bytes
        reserved (see :meth:`done`), or None if there is no room."""
        cap = self.config.max_size
        if cap and size > cap:
            self.refused_writes += 1
            return None
        found = _NAME.match(name)
        parent = found["parent"] if found is not None else ROOT_PARENT
        with self._locked():
            need = size - self._stored_size(name)
            state = self._read_state()
            if not self._fits(state, need):
                self._make_room(state, need)
            if not self._fits(state, need):
                self._write_state(state)
                self.refused_writes += 1
                return None
            state.used += need
            if state.floor is not None:
                state.floor[0] -= max(need, 0)
            state.pending[name] = [need, parent, time.time()]
            state.writers[name] = [os.getpid(), HOST]
            self._write_state(state)
        return need

    def done(self, name: str, reserved: int, ok: bool) -> None:
        """The write of ``name`` is over: stored (``ok``) or failed (its
        reservation given back)."""
        with self._locked():
            state = self._read_state()
            state.pending.pop(name, None)
            state.writers.pop(name, None)
            if not ok:
                state.used -= reserved
                if state.floor is not None:
                    state.floor[0] += max(reserved, 0)
            self._write_state(state)

    def touch(self, fd: int) -> None:
        """A read or a kept write: the object (open as ``fd``: no path
        looked up again) is recently used."""
        try:
            os.utime(fd)
        except OSError:
            pass  # not ours to touch: its recency is its writer's

    def used_bytes(self) -> int:
        """The bytes in use, as every writer counts them."""
        with self._locked():
            return self._read_state().used

    def _stored_size(self, name: str) -> int:
        """The size of the object now under ``name`` (0: none, or not a
        regular file); a count only, nothing is opened."""
        try:
            st = os.stat(f"{self._root}/{name[:2]}/{name}", follow_symlinks=False)
        except OSError:
            return 0
        return st.st_size if stat.S_ISREG(st.st_mode) else 0

    # ---- the shared state -------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The threading mutex and the directory-wide flock, together."""
        with self._mutex:
            fd = _open_lock(f"{self._root}/{_LOCK_FILE}")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def _read_state(self) -> State:
        """The shared state; rebuilt from the directory where it is missing,
        torn, or not a regular file."""
        try:
            fd, st = open_regular(f"{self._root}/{_STATE_FILE}")
            with os.fdopen(fd, "rb") as f:
                data = f.read(_STATE_MAX_BYTES + 1) if st.st_size <= _STATE_MAX_BYTES else b""
            state = parse_state(json.loads(data))
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
            state = State()
            self._rescan(state)  # missing or torn (a writer died mid-write): count again
            return state
        if drop_dead_writers(state):
            self._rescan(state)  # what a dead writer left (an object or none) is counted from the directory
        return state

    def _write_state(self, state: State) -> None:
        """Written to a new file of a random name, renamed into place: a
        link planted at any name is never written through."""
        body = json.dumps({
            "used": max(0, state.used), "pending": state.pending, "writers": state.writers, "floor": state.floor,
            "max_size": self.configured.max_size if state.max_size is None else state.max_size,
            "min_free_space": self.configured.min_free_space if state.min_free_space is None else state.min_free_space,
        }).encode()
        fd, tmp = create_exclusive(self._root, CAPACITY_TMP_PREFIX)
        try:
            try:
                write_all(fd, body)
            finally:
                os.close(fd)
            os.replace(f"{self._root}/{tmp}", f"{self._root}/{_STATE_FILE}")
        except BaseException:
            try:
                os.unlink(f"{self._root}/{tmp}")
            except OSError:
                pass
            raise

    def _fits(self, state: State, need: int) -> bool:
        cap, min_free = self.config.max_size, self.config.min_free_space
        if cap and state.used + need > cap:
            return False
        return not (min_free and self._free_estimate(state) - max(need, 0) < min_free)

    def _free_estimate(self, state: State) -> int:
        """Free bytes: what the file system shows, or more where it does not
        show recent frees yet (counted for :data:`FLOOR_CREDIT_S`)."""
        shown = self._free_bytes()
        floor = state.floor
        if floor is not None and floor[0] > shown and abs(time.time() - floor[1]) < FLOOR_CREDIT_S:
            return int(floor[0])
        state.floor = None  # shown by now (or too old to trust)
        return shown

    def _free_bytes(self) -> int:
        st = os.statvfs(self.directory)
        return st.f_bavail * st.f_frsize

    # ---- eviction (under the lock) ------------------------------------------------------
    def _rescan(self, state: State) -> dict[str, _Page]:
        """The directory's pages; the count set from them and what is being written."""
        pages = self._pages()
        state.used = sum(p.size for p in pages.values()) + sum(v[0] for v in state.pending.values())
        return pages

    def _make_room(self, state: State, need: int) -> None:
        """Evict leaves until ``need`` more bytes fit at the eviction ratio
        of the cap and the margin above the free-space floor. Free space is
        read once and the bytes unlinked are added to it: a file system
        that shows frees late must not make a round evict everything."""
        pages = self._rescan(state)
        cap, min_free, ratio = self.config.max_size, self.config.min_free_space, self.config.eviction_ratio
        target = int(cap * ratio) if cap else None
        floor = min_free + int(min_free * (1.0 - ratio)) + max(need, 0)
        start = self._free_estimate(state) if min_free else 0
        free = [start]
        children: Counter[str] = Counter(p.parent for p in pages.values())
        children.update(v[1] for v in state.pending.values())
        by_prefix: dict[str, list[str]] = {}
        for h in pages:
            by_prefix.setdefault(h[:PARENT_CHARS], []).append(h)

        def full() -> bool:
            return (target is not None and state.used + need > target) or (min_free > 0 and free[0] < floor)

        def evict(page: str) -> Optional[str]:
            """Unlink ``page``; returns its parent page (None at the root, or where it is gone)."""
            gone = pages.pop(page)
            children[gone.parent] -= 1
            for name in gone.names:
                freed = self._unlink(name)
                state.used -= freed
                free[0] += freed
            return None if gone.parent == ROOT_PARENT else next(iter(sorted(by_prefix.get(gone.parent, ()))), None)

        if self.config.policy == "random-chains":
            self._evict_random_chains(pages, children, full, evict)
        else:
            self._evict_lru_leaves(pages, children, full, evict)
        if min_free and free[0] > start:  # frees this round: credited until the file system shows them
            state.floor = [free[0], time.time()]

    def _evict_random_chains(self, pages: dict[str, _Page], children: Counter[str], full: Callable[[], bool],
                             evict: Callable[[str], Optional[str]]) -> None:
        while full():
            leaves = sorted(h for h in pages if children[h[:PARENT_CHARS]] == 0)
            if not leaves:
                break
            page = self._random.choice(leaves)
            while page is not None and full():
                up = evict(page)
                page = up if up is not None and children[up[:PARENT_CHARS]] == 0 else None

    def _evict_lru_leaves(self, pages: dict[str, _Page], children: Counter[str], full: Callable[[], bool],
                          evict: Callable[[str], Optional[str]]) -> None:
        heap = [(p.mtime, h) for h, p in pages.items() if children[h[:PARENT_CHARS]] == 0]
        heapq.heapify(heap)
        while heap and full():
            _, page = heapq.heappop(heap)
            up = evict(page)
            if up is not None and up in pages and children[up[:PARENT_CHARS]] == 0:
                heapq.heappush(heap, (pages[up].mtime, up))  # a leaf now: in line to go

    def _unlink(self, name: str) -> int:
        """Remove object ``name``, relative to its subdirectory opened
        without following a link; returns the bytes freed (0 for a link)."""
        try:
            sub = open_subdir(self._root, name[:2])
        except FileNotFoundError:
            return 0
        except OSError as err:
            logger.warning("L3 file store: cannot evict %s: %s", name, err)
            return 0
        try:
            st = os.stat(name, dir_fd=sub, follow_symlinks=False)
            os.unlink(name, dir_fd=sub)
        except FileNotFoundError:
            return 0
        except OSError as err:
            logger.warning("L3 file store: cannot evict %s/%s/%s: %s", self._root, name[:2], name, err)
            return 0
        finally:
            os.close(sub)
        size = st.st_size if stat.S_ISREG(st.st_mode) else 0
        self.evicted_objects += 1
        self.evicted_bytes += size
        return size

    def _pages(self) -> dict[str, _Page]:
        pages: dict[str, _Page] = {}
        for name, size, mtime in self._listing():
            found = _NAME.match(name)
            page = pages.get(found["hash"])
            if page is None:
                pages[found["hash"]] = _Page([name], found["parent"], size, mtime)
            else:
                page.names.append(name)
                page.size += size
                page.mtime = max(page.mtime, mtime)
        return pages

    def _listing(self) -> Iterator[tuple[str, int, float]]:
        for sub, fd in iter_subdirs(self._root):
            if sub.startswith("."):
                continue
            with os.scandir(fd) as entries:
                for entry in entries:
                    if _NAME.match(entry.name) is None:
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue  # evicted meanwhile
                    if stat.S_ISREG(st.st_mode):
                        yield entry.name, st.st_size, st.st_mtime


def _open_lock(path: str) -> int:
    """The lock file, created if missing (0o666 less the umask: accounts of
    one group share it), never through a link, and only a regular file
    (read-write: NFS grants an exclusive lock only to a writer)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd, _ = open_regular(path, flags, FILE_MODE)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, f"capacity lock {path} is a symbolic link: refused (a lock is never "
                                       "opened through a link; remove it)") from None
        raise
    return fd
