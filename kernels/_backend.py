"""Which backend a copy runs on, decided per call.

========================= ============================== ======================
device buffers on         ``TRITON_INTERPRET`` (now)     backend
========================= ============================== ======================
CUDA                      (ignored)                      ``"triton"``
CPU                       ``1`` / ``true`` / ``on``      ``"triton-interpret"``
CPU (or anything else)    unset / ``0``                  ``"reference"``
========================= ============================== ======================
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton

__all__ = ["BACKENDS", "backend_of", "select_backend"]

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


def backend_of(buffers: object) -> str:
    """Backend for a copy given its device buffer(s): one tensor or a list of
    per-layer tensors. Malformed buffers go to the reference, whose checks
    then raise their usual error."""
    if isinstance(buffers, torch.Tensor):
        return select_backend(buffers.device)
    if isinstance(buffers, Sequence) and buffers and isinstance(buffers[0], torch.Tensor):
        return select_backend(buffers[0].device)
    return "reference"
