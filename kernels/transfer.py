"""Picks the page-copy backend: Triton on CUDA, the Triton interpreter when
``TRITON_INTERPRET=1``, the plain-torch reference otherwise.

Every copy function here has the signature of its ``kernels.reference`` twin
and the same semantics; the backend is chosen per call from the device of the
device buffers and the environment at that moment:

========================= ============================== ==================
device buffers on         ``TRITON_INTERPRET``           backend
========================= ============================== ==================
CUDA                      (ignored)                      ``"triton"``
CPU                       ``1`` / ``true`` / ``on``      ``"triton-interpret"``
CPU (or anything else)    unset / ``0``                  ``"reference"``
========================= ============================== ==================
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton

from sglang_cp_hicache.kernels import cp_page_copy as _triton
from sglang_cp_hicache.kernels import reference as _reference
from sglang_cp_hicache.kernels.cp_page_copy import warmup
from sglang_cp_hicache.layout import CpSharedKVLayout

__all__ = [
    "BACKENDS",
    "backup_indexer_all_layers",
    "backup_kv_all_layers",
    "load_indexer_one_layer",
    "load_kv_one_layer",
    "select_backend",
    "warmup",
]

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


def _device_of(buffers: object) -> torch.device | None:
    if isinstance(buffers, torch.Tensor):
        return buffers.device
    if isinstance(buffers, Sequence) and buffers and isinstance(buffers[0], torch.Tensor):
        return buffers[0].device
    return None  # malformed: let the reference raise its usual error


def _pick(buffers: object, triton_fn, reference_fn):
    device = _device_of(buffers)
    if device is None or select_backend(device) == "reference":
        return reference_fn
    return triton_fn


def backup_kv_all_layers(
    device_kv: Sequence[torch.Tensor],
    host_kv: torch.Tensor,
    host_layout: str,
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    layout: CpSharedKVLayout,
) -> None:
    """D2H: every layer's owned KV pages -> host slots."""
    fn = _pick(device_kv, _triton.backup_kv_all_layers, _reference.backup_kv_all_layers_reference)
    fn(device_kv, host_kv, host_layout, device_locs, host_locs, layout)


def load_kv_one_layer(
    device_kv_layer: torch.Tensor,
    host_kv: torch.Tensor,
    host_layout: str,
    layer_id: int,
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    layout: CpSharedKVLayout,
) -> None:
    """H2D: one layer's host slots -> owned physical KV pages."""
    fn = _pick(device_kv_layer, _triton.load_kv_one_layer, _reference.load_kv_one_layer_reference)
    fn(device_kv_layer, host_kv, host_layout, layer_id, device_locs, host_locs, layout)


def backup_indexer_all_layers(
    device_index: Sequence[torch.Tensor],
    host_index: torch.Tensor,
    host_layout: str,
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    layout: CpSharedKVLayout,
) -> None:
    """D2H: every layer's owned indexer pages -> host pages."""
    fn = _pick(
        device_index, _triton.backup_indexer_all_layers, _reference.backup_indexer_all_layers_reference
    )
    fn(device_index, host_index, host_layout, device_locs, host_locs, layout)


def load_indexer_one_layer(
    device_index_layer: torch.Tensor,
    host_index: torch.Tensor,
    host_layout: str,
    layer_id: int,
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    layout: CpSharedKVLayout,
) -> None:
    """H2D: one layer's host indexer pages -> owned physical device pages."""
    fn = _pick(
        device_index_layer, _triton.load_indexer_one_layer, _reference.load_indexer_one_layer_reference
    )
    fn(device_index_layer, host_index, host_layout, layer_id, device_locs, host_locs, layout)
