"""Which backend a copy runs on: one rule, :func:`select_backend`, applied
per call to the device its device buffers live on.

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

__all__ = ["BACKENDS", "select_backend"]

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
