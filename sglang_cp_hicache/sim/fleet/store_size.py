"""How big a file L3 store is: object count and bytes on disk, sampled while a fleet runs."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Iterable

__all__ = ["StoreSample", "store_size"]


@dataclass(frozen=True)
class StoreSample:
    requests: int  # requests released when it was taken
    seconds: float  # into the replay
    objects: int
    bytes: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _walk(directory: str) -> tuple[int, int]:
    objects = size = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:  # not created yet, or gone
        return 0, 0
    for entry in entries:
        if entry.name.startswith("."):
            continue  # temporary files being written, manifests, the store's own state
        try:
            if entry.is_dir(follow_symlinks=False):
                o, b = _walk(entry.path)
                objects, size = objects + o, size + b
            elif entry.is_file(follow_symlinks=False):
                objects += 1
                size += entry.stat(follow_symlinks=False).st_size
        except OSError:  # removed while we looked (the store's own eviction)
            continue
    return objects, size


def store_size(directories: Iterable[str], requests: int, seconds: float) -> StoreSample:
    """The objects and bytes under every directory (the fleet's one store, or each deployment's)."""
    objects = size = 0
    for directory in directories:
        o, b = _walk(directory)
        objects, size = objects + o, size + b
    return StoreSample(requests, round(seconds, 3), objects, size)
