"""How many bytes a file L3 directory holds, and the most it held while a
simulator run wrote to it: what ``SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE``
bounds. The store's own state files (``.l3-*``) and the runs' writer
manifests (:data:`~sglang_cp_hicache.sim.l3_writers.MANIFEST_DIR`) do not
count."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from sglang_cp_hicache.sim.l3_writers import MANIFEST_DIR

__all__ = ["peak_stored_bytes", "stored_bytes", "stored_objects"]


def stored_bytes(directory: Path) -> int:
    """The bytes of the page objects under ``directory`` now."""
    return stored_objects(directory)[1]


def stored_objects(directory: Path) -> tuple[int, int]:
    """How many page object files ``directory`` holds now, and their bytes."""
    count = total = 0
    for path in directory.rglob("*"):
        try:
            if path.is_file() and not path.name.startswith(".l3-") and MANIFEST_DIR not in path.parts:
                total += path.stat().st_size
                count += 1
        except FileNotFoundError:
            pass  # evicted while being measured
    return count, total


def peak_stored_bytes(proc: subprocess.Popen, directory: Path, interval_s: float = 0.02) -> int:
    """The most :func:`stored_bytes` seen, every ``interval_s``, until ``proc`` ends."""
    peak = 0
    while proc.poll() is None:
        if directory.exists():
            peak = max(peak, stored_bytes(directory))
        time.sleep(interval_s)
    return peak
