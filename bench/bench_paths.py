"""Where the benchmarks write: a run told ``--out`` writes there; a run not
told writes a fresh ``<stem>_<UTC time><ext>`` under ``build/bench-results``
(git-ignored), so a committed result in ``bench/results`` is replaced only by
naming it with ``--out``.

The benchmarks run as ``python bench/<name>.py``, which puts this folder on
``sys.path``; the tests load them with this folder on ``sys.path`` too
(``tests/helpers/bench_scripts.py``).
"""

from __future__ import annotations

import datetime
import os

__all__ = ["RUNS", "new_out_path", "out_path"]

#: ``build/bench-results`` of this checkout
RUNS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "bench-results")


def new_out_path(stem: str, ext: str = "") -> str:
    """A path under :data:`RUNS` that no file has yet: ``<stem>_<UTC time><ext>``,
    with ``_1``, ``_2``, ... added to the time when the second already has one."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path, n = os.path.join(RUNS, f"{stem}_{stamp}{ext}"), 1
    while os.path.exists(path):
        path, n = os.path.join(RUNS, f"{stem}_{stamp}_{n}{ext}"), n + 1
    return path


def out_path(out: str | None, stem: str, ext: str) -> str:
    """``out`` when given, else :func:`new_out_path` with its folder created."""
    if out is not None:
        return out
    os.makedirs(RUNS, exist_ok=True)
    return new_out_path(stem, ext)
