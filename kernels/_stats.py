"""Copy counters, shared by the four copies of :mod:`.transfer` and the bound
copies of :mod:`.bound` (process-wide: threaded ranks add up)."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

import torch

from sglang_cp_hicache.placement import CpPlacement

__all__ = ["CopyStats", "copy_stats", "record", "reset_copy_stats"]


@dataclass(frozen=True)
class CopyStats:
    """Copies made since the last :func:`reset_copy_stats`.

    ``pages_copied`` counts the owned pages of each call (``len(host_locs) //
    page_size``, known on the host without reading device memory); a backup
    of L layers counts each page once. ``backend`` and ``cp_size`` are the
    last call's (None before the first).
    """

    backend: str | None = None
    kv_backup_calls: int = 0
    kv_load_calls: int = 0
    indexer_backup_calls: int = 0
    indexer_load_calls: int = 0
    cp_size: int | None = None
    pages_copied: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


_STATS_LOCK = threading.Lock()
_stats = CopyStats()


def copy_stats() -> CopyStats:
    """A snapshot of the copy counters."""
    with _STATS_LOCK:
        return _stats


def reset_copy_stats() -> None:
    global _stats
    with _STATS_LOCK:
        _stats = CopyStats()


def record(counter: str, backend: str, placement: CpPlacement, host_locs: torch.Tensor) -> None:
    """Count one successful call: ``counter`` is a ``*_calls`` field."""
    global _stats
    with _STATS_LOCK:
        s = _stats
        _stats = CopyStats(
            **{
                **asdict(s),
                counter: getattr(s, counter) + 1,
                "backend": backend,
                "cp_size": placement.cp_size,
                "pages_copied": s.pages_copied + host_locs.numel() // placement.page_size,
            }
        )
