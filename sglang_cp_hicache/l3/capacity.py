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
"""

from __future__ import annotations

import fcntl
import heapq
import json
import logging
import os
import random
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

from sglang_cp_hicache.l3.keys import DIGEST_CHARS, PAGE_HASH_CHARS, PARENT_CHARS, ROOT_PARENT
from sglang_cp_hicache.sizes import parse_eviction_ratio, parse_file_size

__all__ = ["CapacityConfig", "DirectoryCapacity", "EVICTION_POLICIES", "parse_size"]

logger = logging.getLogger(__name__)

EVICTION_POLICIES = ("lru-leaves", "random-chains")
#: A registration older than this belongs to a writer that died mid-write.
STALE_PENDING_S = 600.0
_STATE_FILE = ".l3-capacity"
_LOCK_FILE = ".l3-capacity.lock"
_NAME = re.compile(
    rf"^(?P<hash>[0-9a-f]{{{PAGE_HASH_CHARS}}})_(?P<digest>[0-9a-f]{{{DIGEST_CHARS}}})_"
    rf"(?P<parent>[0-9a-f]{{{PARENT_CHARS}}}|{ROOT_PARENT})\.bin$"
)


def parse_size(name: str, value: object) -> int:
    """A byte size exactly as SGLang's file backend reads it (see
    :func:`sglang_cp_hicache.sizes.parse_file_size`): an int, or text with an
    SI (``200G``, ``1.5T``) or IEC (``64Gi``) suffix, or bytes; None / empty
    / 0: no bound. A value SGLang would not read is refused naming ``name``
    and SGLang's forms."""
    return parse_file_size(name, value)


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
            max_size=parse_size("max_size", pick("max_size", "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE")),
            min_free_space=parse_size("min_free_space",
                                      pick("min_free_space", "SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE")),
            eviction_ratio=ratio, policy=policy,
        )


@dataclass
class _State:
    """The shared state: bytes in use, and the objects being written
    (name -> [bytes, parent, registered at])."""

    used: int = 0
    pending: dict[str, list] = field(default_factory=dict)


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
        total = self._file_system_bytes()
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
        with self._locked():
            state = self._read_state()
            self._rescan(state)
            self._make_room(state, 0)
            self._write_state(state)

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
            try:
                old = (self.directory / name[:2] / name).stat().st_size
            except OSError:
                old = 0
            need = size - old
            state = self._read_state()
            if not self._fits(state.used, need):
                self._make_room(state, need)
            if not self._fits(state.used, need):
                self._write_state(state)
                self.refused_writes += 1
                return None
            state.used += need
            state.pending[name] = [need, parent, time.time()]
            self._write_state(state)
        return need

    def done(self, name: str, reserved: int, ok: bool) -> None:
        """The write of ``name`` is over: stored (``ok``) or failed (its
        reservation given back)."""
        with self._locked():
            state = self._read_state()
            state.pending.pop(name, None)
            if not ok:
                state.used -= reserved
            self._write_state(state)

    def touch(self, path: Path) -> None:
        """A read or a kept write: the object is recently used."""
        try:
            os.utime(path)
        except OSError:
            pass  # evicted meanwhile: nothing to keep

    def used_bytes(self) -> int:
        """The bytes in use, as every writer counts them."""
        with self._locked():
            return self._read_state().used

    # ---- the shared state -------------------------------------------------------------
    def _locked(self) -> "_Locked":
        return _Locked(self)

    def _read_state(self) -> _State:
        try:
            raw = json.loads((self.directory / _STATE_FILE).read_text())
            state = _State(int(raw["used"]), {str(k): list(v) for k, v in raw["pending"].items()})
        except (OSError, ValueError, KeyError, TypeError):
            state = _State()
            self._rescan(state)  # missing or torn (a writer died mid-write): count again
        now = time.time()
        for name, (_, _, at) in list(state.pending.items()):
            if now - at > STALE_PENDING_S:  # its writer died: its bytes are counted by a rescan, if any
                del state.pending[name]
        return state

    def _write_state(self, state: _State) -> None:
        tmp = self.directory / f"{_STATE_FILE}.{os.getpid()}.{threading.get_ident()}"
        tmp.write_text(json.dumps({"used": max(0, state.used), "pending": state.pending}))
        os.replace(tmp, self.directory / _STATE_FILE)

    def _fits(self, used: int, need: int) -> bool:
        cap, min_free = self.config.max_size, self.config.min_free_space
        if cap and used + need > cap:
            return False
        return not (min_free and self._free_bytes() - max(need, 0) < min_free)

    def _free_bytes(self) -> int:
        st = os.statvfs(self.directory)
        return st.f_bavail * st.f_frsize

    def _file_system_bytes(self) -> int:
        st = os.statvfs(self.directory)
        return st.f_blocks * st.f_frsize

    # ---- eviction (under the lock) ------------------------------------------------------
    def _rescan(self, state: _State) -> dict[str, _Page]:
        """The directory's pages; the count set from them and what is being written."""
        pages = self._pages()
        state.used = sum(p.size for p in pages.values()) + sum(v[0] for v in state.pending.values())
        return pages

    def _make_room(self, state: _State, need: int) -> None:
        """Evict leaves until ``need`` more bytes fit at the eviction ratio
        of the cap and above the free-space floor."""
        pages = self._rescan(state)
        cap = self.config.max_size
        target = int(cap * self.config.eviction_ratio) if cap else None
        children: Counter[str] = Counter(p.parent for p in pages.values())
        children.update(v[1] for v in state.pending.values())
        by_prefix: dict[str, list[str]] = {}
        for h in pages:
            by_prefix.setdefault(h[:PARENT_CHARS], []).append(h)

        def full() -> bool:
            return (target is not None and state.used + need > target) or not self._fits(state.used, need)

        def evict(page: str) -> None:
            for name in pages.pop(page).names:
                state.used -= self._unlink(name)

        def parent_page(page: str) -> Optional[str]:
            parent = pages[page].parent
            return None if parent == ROOT_PARENT else next(iter(sorted(by_prefix.get(parent, ()))), None)

        if self.config.policy == "random-chains":
            while full():
                leaves = sorted(h for h in pages if children[h[:PARENT_CHARS]] == 0)
                if not leaves:
                    break
                page = self._random.choice(leaves)
                while page is not None and full():
                    up = parent_page(page)
                    children[pages[page].parent] -= 1
                    evict(page)
                    page = up if up is not None and children[up[:PARENT_CHARS]] == 0 else None
            return
        heap = [(p.mtime, h) for h, p in pages.items() if children[h[:PARENT_CHARS]] == 0]
        heapq.heapify(heap)
        while heap and full():
            _, page = heapq.heappop(heap)
            up = parent_page(page)
            children[pages[page].parent] -= 1
            evict(page)
            if up is not None and up in pages and children[up[:PARENT_CHARS]] == 0:
                heapq.heappush(heap, (pages[up].mtime, up))  # a leaf now: in line to go

    def _unlink(self, name: str) -> int:
        path = self.directory / name[:2] / name
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return 0
        except OSError as err:
            logger.warning("L3 file store: cannot evict %s: %s", path, err)
            return 0
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
        for sub in os.scandir(self.directory):
            if not sub.is_dir(follow_symlinks=False) or sub.name.startswith("."):
                continue
            for entry in os.scandir(sub.path):
                if _NAME.match(entry.name) is None:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # evicted meanwhile
                yield entry.name, st.st_size, st.st_mtime


class _Locked:
    """The capacity's threading mutex and the directory-wide flock, together."""

    def __init__(self, capacity: DirectoryCapacity) -> None:
        self.capacity = capacity
        self.fd = -1

    def __enter__(self) -> "_Locked":
        self.capacity._mutex.acquire()
        try:
            self.fd = os.open(self.capacity.directory / _LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            if self.fd >= 0:
                os.close(self.fd)
            self.capacity._mutex.release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
        finally:
            self.capacity._mutex.release()
