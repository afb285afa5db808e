"""The front door of the page copies: the four copies, each run on the
backend :func:`select_backend` picks for the device its device buffers live
on (compiled Triton for CUDA, Triton's interpreter for CPU under
``TRITON_INTERPRET=1``, the plain-torch reference otherwise; table in
:mod:`._backend`), counted (:func:`copy_stats`), and warmed up at server
start (:func:`warmup`).

Each copy checks every argument on every call, with the same argument errors
on every backend. A server copying between the same pools again and again
binds them once instead, through the other door, :mod:`.bound`
(:func:`~.bound.bind_kv_copies`, :func:`~.bound.bind_indexer_copies`): buffers checked at bind time, only the
index tensors per call, same backend rule and counters.

Interpreted launches are serialised process-wide by the launcher, so
threaded CP ranks can share the interpreter.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from . import _checks
from . import _triton_launch as _triton
from . import reference as _reference
from ._backend import BACKENDS, select_backend
from ._stats import CopyStats, copy_stats, record, reset_copy_stats
from .compile import WarmupReport, warmup
from sglang_cp_hicache.placement import CpPlacement

__all__ = [
    "BACKENDS",
    "CopyStats",
    "WarmupReport",
    "backup_indexer_all_layers",
    "backup_kv_all_layers",
    "copy_stats",
    "load_indexer_one_layer",
    "load_kv_one_layer",
    "reset_copy_stats",
    "select_backend",
    "warmup",
]


def _layers_device(name: str, layers: object, ndim: int) -> torch.device:
    # Malformed buffers fail here with the error either backend would raise.
    return _checks.check_device_layers(name, layers, ndim)[0].device


def _layer_device(name: str, layer: object, ndim: int) -> torch.device:
    return _checks.check_device_layer(name, layer, ndim).device


def _run(
    counter: str, device: torch.device, triton: Callable[..., None], reference: Callable[..., None],
    placement: CpPlacement, host_locs: torch.Tensor, *args: object,
) -> None:
    """One copy on the backend for ``device``, counted under ``counter``."""
    backend = select_backend(device)
    (reference if backend == "reference" else triton)(*args)
    record(counter, backend, placement, host_locs)


def backup_kv_all_layers(
    device_kv: Sequence[torch.Tensor],
    host_kv: torch.Tensor,
    host_layout: str,
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    placement: CpPlacement,
) -> None:
    """D2H: every layer's owned KV rows -> host slots.

    ``device_kv``: the per-layer ``(slots, 1, dim)`` device buffers;
    ``host_kv``: SGLang's host KV buffer in ``host_layout``; ``device_locs``:
    LOGICAL token locations of whole pages; ``host_locs``: host slots of the
    tokens of ``device_locs`` this rank owns, in order. Pages other ranks own
    are skipped.
    """
    _run("kv_backup_calls", _layers_device("device_kv", device_kv, 3), _triton.backup_kv_all_layers,
         _reference.backup_kv_all_layers_reference, placement, host_locs,
         device_kv, host_kv, host_layout, device_locs, host_locs, placement)


def load_kv_one_layer(
    device_kv_layer: torch.Tensor,
    host_kv: torch.Tensor,
    host_layout: str,
    layer_id: int,
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    placement: CpPlacement,
) -> None:
    """H2D: host layer ``layer_id``'s slots -> the owned physical KV rows of
    ``device_kv_layer`` (arguments as in :func:`backup_kv_all_layers`)."""
    _run("kv_load_calls", _layer_device("device_kv_layer", device_kv_layer, 3), _triton.load_kv_one_layer,
         _reference.load_kv_one_layer_reference, placement, host_locs,
         device_kv_layer, host_kv, host_layout, layer_id, device_locs, host_locs, placement)


def backup_indexer_all_layers(
    device_index: Sequence[torch.Tensor],
    host_index: torch.Tensor,
    host_layout: str,
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    placement: CpPlacement,
) -> None:
    """D2H: every layer's owned indexer pages -> host pages.

    ``device_index``: the per-layer ``(pages, page_bytes)`` uint8 device
    buffers; ``host_index``: SGLang's host indexer buffer in ``host_layout``;
    the locations as in :func:`backup_kv_all_layers` (page granular copy).
    """
    _run("indexer_backup_calls", _layers_device("device_index", device_index, 2),
         _triton.backup_indexer_all_layers, _reference.backup_indexer_all_layers_reference, placement, host_locs,
         device_index, host_index, host_layout, device_locs, host_locs, placement)


def load_indexer_one_layer(
    device_index_layer: torch.Tensor,
    host_index: torch.Tensor,
    host_layout: str,
    layer_id: int,
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    placement: CpPlacement,
) -> None:
    """H2D: host layer ``layer_id``'s indexer pages -> the owned physical
    pages of ``device_index_layer`` (arguments as in
    :func:`backup_indexer_all_layers`)."""
    _run("indexer_load_calls", _layer_device("device_index_layer", device_index_layer, 2),
         _triton.load_indexer_one_layer, _reference.load_indexer_one_layer_reference, placement, host_locs,
         device_index_layer, host_index, host_layout, layer_id, device_locs, host_locs, placement)
