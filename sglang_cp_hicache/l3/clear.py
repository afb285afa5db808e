"""Clearing one deployment's L3: SGLang's ``clear_hicache_storage`` under CP.

SGLang's own file backend empties the whole directory on every rank. Under
CP a directory (or a Mooncake store) is shared by design: deployments of
any CP size, of either release, and of other models write into it. So a
clear removes exactly the objects of this rank's two namespaces (KV and
DSA indexer) -- the pages this deployment reads and writes, shared with any
deployment of the same model and configuration -- and nothing else.

Every rank clears all of its namespaces' objects, not a share of them:

* a rank first waits for its own writes queued before the clear (bounded
  by the longest L3 deadline), then removes; so every object any rank of
  the deployment wrote before the clear is removed by its writer's own
  pass at the latest, whatever order the ranks run in;
* removals race harmlessly (an object already gone is not an error), and
  one rank failing does not leave a share of the namespace behind;
* every rank answers the same (cleared, or not and why) in the normal case,
  since each one's pass covers the whole namespace.

A reader -- this deployment's or another's -- only ever misses: an object
is removed whole (``unlink``; a reader that opened it still reads it whole)
or not at all. Temporary files of writers still writing are left alone
(their writes land after the clear, as any write issued before it may).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from sglang_cp_hicache.l3.keys import ROOT_PARENT, split_page_key
from sglang_cp_hicache.l3.safe_files import iter_subdirs
from sglang_cp_hicache.l3.store import FilePageStore

__all__ = ["ClearReport", "NamespaceClearable", "clear_file_namespaces", "clear_namespaces"]

logger = logging.getLogger(__name__)

#: The suffix of a file store's object files.
_OBJECT_SUFFIX = ".bin"


@dataclass(frozen=True)
class ClearReport:
    """What one rank's clear did: objects it removed (others may have been
    removed by peers at the same time) and what it could not remove or
    list; ``detail`` says why when it failed."""

    removed: int = 0
    errors: int = 0
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.errors == 0


@runtime_checkable
class NamespaceClearable(Protocol):
    """A store that removes every object of some namespaces itself."""

    def clear_namespaces(self, digests: Sequence[str]) -> ClearReport:
        ...


def _digests(digests: object) -> frozenset[str]:
    if isinstance(digests, str) or not isinstance(digests, Sequence) or not digests:
        raise TypeError(f"digests must be a non-empty list of namespace digests, got {digests!r}")
    for i, digest in enumerate(digests):
        try:  # a digest is what follows the page hash in a key
            split_page_key("key", "0" * 64 + "_" + str(digest) + "_" + ROOT_PARENT)
        except ValueError:
            raise ValueError(f"digests[{i}] must be a namespace digest (lowercase hex), got {digest!r}") from None
    return frozenset(digests)


def clear_namespaces(store: Any, digests: Sequence[str]) -> ClearReport:
    """Remove every object of the namespaces ``digests`` from ``store``: its
    own ``clear_namespaces`` when it has one, a walk of a file store's
    directory otherwise. Never raises on I/O (errors are counted)."""
    wanted = _digests(digests)
    if isinstance(store, NamespaceClearable):
        return store.clear_namespaces(sorted(wanted))
    if isinstance(store, FilePageStore):
        return clear_file_namespaces(store, sorted(wanted))
    raise TypeError(f"a {type(store).__name__} cannot clear namespaces (no clear_namespaces method)")


def clear_file_namespaces(store: FilePageStore, digests: Sequence[str]) -> ClearReport:
    """Remove a file store's objects of the namespaces ``digests``: every
    file whose name is a page key of one of them and that sits where the
    store keeps that key (``store.path_of``)."""
    wanted = _digests(digests)
    root = os.fspath(store.directory)
    removed = errors = 0
    problems: list[str] = []
    try:
        for sub, fd in iter_subdirs(root):  # each opened without following a link: removals stay inside
            done, failed = _clear_subdir(fd, sub, f"{root}/{sub}", store, wanted, problems)
            removed, errors = removed + done, errors + failed
    except OSError as err:
        return ClearReport(removed, errors + 1, f"cannot list {store.directory}: {err}")
    return ClearReport(removed, errors, "; ".join(problems))


def _clear_subdir(fd: int, sub: str, where: str, store: FilePageStore, wanted: frozenset[str],
                  problems: list[str]) -> tuple[int, int]:
    """Remove the wanted objects of one subdirectory (open as ``fd``);
    returns (removed, errors)."""
    removed = errors = 0
    try:
        names = [e.name for e in os.scandir(fd)]
    except OSError as err:
        problems.append(f"cannot list {where}: {err}")
        return 0, 1
    for name in names:
        key = _own_key(name, wanted)
        if key is None or store.path_of(key).parent.name != sub:
            continue
        try:
            os.unlink(name, dir_fd=fd)
            removed += 1
        except FileNotFoundError:
            pass  # a peer (or another deployment of this namespace) removed it first
        except OSError as err:
            errors += 1
            if len(problems) < 3:
                problems.append(f"cannot remove {where}/{name}: {err}")
    return removed, errors


def _own_key(name: str, wanted: frozenset[str]) -> str | None:
    """The page key an object file named ``name`` holds, if it is one of ``wanted``'s."""
    if not name.endswith(_OBJECT_SUFFIX):
        return None
    key = name[: -len(_OBJECT_SUFFIX)]
    try:
        _, digest, _ = split_page_key("name", key)
    except ValueError:
        return None
    return key if digest in wanted else None
