"""Which backend a copy runs on: one rule, :func:`select_backend`, applied
per call to the device its device buffers live on; :func:`run_counted` runs
a checked copy there and counts it (both doors, :mod:`.transfer` and
:mod:`.bound`, copy through it).

========================= ============================== ======================
device buffers on         ``TRITON_INTERPRET`` (now)     backend
========================= ============================== ======================
CUDA                      (ignored)                      ``"triton"``
CPU                       ``1`` / ``true`` / ``on``      ``"triton-interpret"``
CPU (or anything else)    unset / ``0``                  ``"reference"``
========================= ============================== ======================
"""

from __future__ import annotations

import torch
import triton

from . import _triton_launch as _triton
from . import reference as _reference
from ._copies import CheckedCopy
from ._launch_spec import PoolPart
from ._stats import record

__all__ = ["BACKENDS", "run_counted", "select_backend"]

BACKENDS = ("triton", "triton-interpret", "reference")


def _interpret_requested() -> bool:
    # Triton's own parsing of TRITON_INTERPRET, read now (not at import).
    return bool(triton.knobs.runtime.interpret)


def select_backend(device: torch.device | str) -> str:
    """The backend a copy whose device buffers live on ``device`` will use."""
    device = torch.device(device)
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu" and _interpret_requested():
        return "triton-interpret"
    return "reference"


def run_counted(copy: CheckedCopy, part: PoolPart | None = None, /) -> None:
    """``copy`` on the backend for its device buffers' device, counted. The
    Triton backend launches ``part`` where a bound pool resolved it, else
    resolves the launch for this call."""
    backend = select_backend(copy.pool.device)
    if backend == "reference":
        _reference.run(copy)
    elif part is None:
        _triton.run(copy)
    else:
        _triton.run_bound(part, copy.device_locs, copy.host_locs, copy.placement)
    record(copy.counter, backend, copy.placement, copy.host_locs)
