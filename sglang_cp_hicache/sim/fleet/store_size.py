"""How big a fleet's file L3 is while it runs: page objects and their bytes
on disk (as :mod:`..l3_usage` counts them), over every directory in use."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

from sglang_cp_hicache.sim.l3_usage import stored_objects

__all__ = ["StoreSample", "store_size"]


@dataclass(frozen=True)
class StoreSample:
    requests: int  # requests released when it was taken
    seconds: float  # into the replay
    objects: int
    bytes: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def store_size(directories: Iterable[str], requests: int, seconds: float) -> StoreSample:
    """The objects and bytes under every directory (the fleet's one store, or each deployment's)."""
    objects = size = 0
    for directory in directories:
        o, b = stored_objects(Path(directory))
        objects, size = objects + o, size + b
    return StoreSample(requests, round(seconds, 3), objects, size)
