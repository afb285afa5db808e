"""Launchers of the CP page-copy kernel (see :mod:`._kernel` for how it works).

Four public launchers, one per operation, each with the signature of its
:mod:`.reference` twin plus two keyword-only tuning arguments:

* ``backup_kv_all_layers`` / ``backup_indexer_all_layers`` -- D2H, every layer,
  one launch;
* ``load_kv_one_layer`` / ``load_indexer_one_layer`` -- H2D, one layer, one
  launch (layer-wise overlap with the forward pass).

They validate every argument, check the index values whenever that is free
(indices on the CPU, or debug mode), return before launching on empty
batches, and launch on the device buffers' current CUDA stream without a
device-to-host sync. CPU tensors run under Triton's interpreter; those
launches are serialised process-wide, because the interpreter patches
``triton.language`` globally while a kernel runs.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Sequence

import torch
import triton

from sglang_cp_hicache.kernels import _checks, _twin
from sglang_cp_hicache.kernels._checks import HostGeometry
from sglang_cp_hicache.kernels._kernel import (
    BYTES_PER_THREAD,
    COUNT_PAGES,
    DEFAULT_BLOCK_BYTES,
    DEFAULT_NUM_CTAS,
    MAX_TILE_PAGES,
    VECTOR_BYTES,
    WALK_PAGES,
)
from sglang_cp_hicache.placement import CpPlacement

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_NUM_CTAS",
    "INTERPRETER_LOCK",
    "backup_indexer_all_layers",
    "backup_kv_all_layers",
    "load_indexer_one_layer",
    "load_kv_one_layer",
]

#: Held by every interpreted launch. Triton's interpreter swaps
#: ``triton.language`` functions for its own while a kernel runs and restores
#: them afterwards; two threads interleaving that corrupt each other
#: (``InterpreterError('Did you forget to add @triton.jit ?')``).
INTERPRETER_LOCK = threading.Lock()

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


# ----------------------------------------------------------------------------- launch plumbing
@dataclass(frozen=True)
class _WordPlan:
    word_bytes: int
    vec: int  # words per 16 bytes if every address is 16-byte aligned, else 1

    @property
    def dtype(self) -> torch.dtype:
        return _WORD_DTYPES[self.word_bytes]

    @property
    def unit_bytes(self) -> int:
        return self.word_bytes * self.vec


def _word_plan(row_bytes: int, byte_strides: Sequence[int], addresses: Sequence[int]) -> _WordPlan:
    """Widest word and vector the row size, strides and base addresses allow."""
    g = row_bytes
    for v in (*byte_strides, *addresses):
        g = math.gcd(g, int(v))
    align = g & -g if g else VECTOR_BYTES  # largest power of two dividing all of them
    align = min(align, VECTOR_BYTES)
    word = min(align, 8)
    return _WordPlan(word, align // word)


@dataclass(frozen=True)
class _TileShape:
    """A tile is ``pages`` units of ``words`` words (both powers of two)."""

    pages: int
    words: int


def _tile_shape(page_words: int, word_bytes: int, block_bytes: int) -> _TileShape:
    """The tile of at most ``block_bytes`` that carries the most page words.

    A page of ``page_words`` words takes ``ceil(page_words / words)`` units,
    the last one partly masked; a tile carries ``pages * page_words / chunks``
    useful words. Ties go to the wider unit (less selection work). E.g. with
    int64 words and 32 KiB tiles: 8,448-byte indexer pages -> 16 x 256 words
    (5 units per page, 82 % useful), 41,984-byte fp8 KV pages -> 16 x 256
    (21 units, 98 %), 73,728-byte bf16 KV pages -> 4 x 1024 (exact).
    """
    block_words = max(1, block_bytes // word_bytes)
    words = min(block_words, triton.next_power_of_2(page_words))
    floor = max(1, block_words // MAX_TILE_PAGES)
    best, best_pages, best_chunks = None, 0, 1
    while True:
        pages = min(MAX_TILE_PAGES, max(1, block_words // words))
        chunks = -(-page_words // words)
        if best is None or pages * best_chunks > best_pages * chunks:
            best, best_pages, best_chunks = words, pages, chunks
        if words <= floor:
            break
        words //= 2
    return _TileShape(best_pages, best)


def _num_warps(tile_words: int, word_bytes: int) -> int:
    return max(1, min(8, tile_words * word_bytes // (32 * BYTES_PER_THREAD)))


_PTR_TABLES: dict[tuple, torch.Tensor] = {}
_PTR_TABLES_MAX = 64
_PTR_TABLES_LOCK = threading.Lock()


def _device_ptr_table(layers: Sequence[torch.Tensor]) -> torch.Tensor:
    """int64 table of the layers' addresses, on their device.

    Cached by address: pool buffers live for the whole process, and building
    the table on CUDA is an H2D copy we only want to pay once (it goes through
    pinned memory with non_blocking=True, so even the first one does not sync).
    """
    device = layers[0].device
    ptrs = tuple(t.data_ptr() for t in layers)
    if device.type != "cuda":
        return torch.tensor(ptrs, dtype=torch.int64)
    key = (device, ptrs)
    with _PTR_TABLES_LOCK:
        table = _PTR_TABLES.get(key)
        if table is None:
            staged = torch.tensor(ptrs, dtype=torch.int64).pin_memory()
            table = staged.to(device, non_blocking=True)
            if len(_PTR_TABLES) >= _PTR_TABLES_MAX:
                _PTR_TABLES.pop(next(iter(_PTR_TABLES)))
            _PTR_TABLES[key] = table
    return table


def _check_host_buffer(name: str, host: torch.Tensor, device: torch.device) -> None:
    if host.stride(-1) != 1:
        raise ValueError(f"{name} rows must be dense (stride(-1) == 1), got strides {host.stride()}")
    if device.type == "cuda":
        if host.device.type != "cpu" or not host.is_pinned():
            raise ValueError(
                f"{name} must be a pinned CPU tensor when the device buffers are on {device} "
                f"(got {'pinned ' if host.device.type == 'cpu' and host.is_pinned() else ''}"
                f"{host.device} memory); pageable memory cannot be read by the kernel"
            )
    elif host.device != device:
        raise ValueError(f"{name} is on {host.device} but the device buffers are on {device}")


def _check_device_buffer(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}")


def _check_index_tensor(name: str, locs: torch.Tensor, device: torch.device) -> None:
    if locs.device != device:
        raise ValueError(f"{name} is on {locs.device} but the device buffers are on {device}")
    if not locs.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_num_ctas(num_ctas: int | None, block_bytes: int | None) -> tuple[int, int]:
    num_ctas = DEFAULT_NUM_CTAS if num_ctas is None else num_ctas
    block_bytes = DEFAULT_BLOCK_BYTES if block_bytes is None else block_bytes
    if isinstance(num_ctas, bool) or not isinstance(num_ctas, int) or num_ctas < 1:
        raise ValueError(f"num_ctas must be a positive int, got {num_ctas!r}")
    if (
        isinstance(block_bytes, bool) or not isinstance(block_bytes, int)
        or block_bytes < VECTOR_BYTES or block_bytes & (block_bytes - 1)
    ):
        raise ValueError(f"block_bytes must be a power of two >= {VECTOR_BYTES}, got {block_bytes!r}")
    return num_ctas, block_bytes


@dataclass(frozen=True)
class _Launch:
    """Everything one kernel launch needs, after validation."""

    dev_layers: tuple[torch.Tensor, ...]  # all layers (table) or the one layer
    dev_ptr_table: bool
    host: torch.Tensor
    geom: HostGeometry
    layer_base: int
    dev_num_pages: int
    to_host: bool


@dataclass(frozen=True)
class _Spec:
    """One launch, fully resolved: kernel arguments, constexprs, grid."""

    args: tuple
    meta: dict
    grid: tuple[int, int]
    device: torch.device


def _specialise(
    plan: _Launch,
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    layout: CpPlacement,
    num_ctas: int,
    block_bytes: int,
) -> _Spec:
    geom = plan.geom
    elem = plan.host.element_size()
    row_bytes = geom.row_elems * elem
    words = _word_plan(
        row_bytes,
        (geom.page_stride * elem, geom.layer_stride * elem, geom.row_stride * elem),
        (plan.host.data_ptr(), *(t.data_ptr() for t in plan.dev_layers)),
    )
    unit = words.unit_bytes
    row_words = row_bytes // words.word_bytes
    tile = _tile_shape(geom.rows_per_page * row_words, words.word_bytes, block_bytes)
    host_w = plan.host.view(words.dtype)
    if plan.dev_ptr_table:
        dev_arg = _device_ptr_table(plan.dev_layers)
    else:
        dev_arg = plan.dev_layers[0].view(words.dtype)
    num_layers = len(plan.dev_layers)

    # Persistent-style grid: at most num_ctas programs; pages split first,
    # then layers, so a one-page backup of 61 layers still uses every CTA.
    num_pages = device_locs.numel() // layout.page_size
    grid_pages = max(1, min(num_pages, num_ctas))
    pages_per_program = triton.cdiv(num_pages, grid_pages)
    grid_pages = max(1, triton.cdiv(num_pages, pages_per_program))
    grid_layers = min(num_layers, max(1, num_ctas // grid_pages))
    layers_per_program = triton.cdiv(num_layers, grid_layers)
    grid_layers = triton.cdiv(num_layers, layers_per_program)

    args = (
        dev_arg, host_w, device_locs, host_locs,
        num_pages, host_locs.numel() // layout.page_size, plan.dev_num_pages, geom.num_pages,
        plan.layer_base, num_layers, pages_per_program, layers_per_program,
        geom.page_stride * elem // unit, geom.layer_stride * elem // unit, geom.row_stride * elem // unit,
        layout.cp_size, layout.cp_rank,
    )
    meta = dict(
        PAGE_SIZE=layout.page_size,
        ROWS=geom.rows_per_page,
        ROW=row_words,
        VEC=words.vec,
        ALIGN_BYTES=words.unit_bytes,
        TILE_PAGES=tile.pages,
        TILE_WORDS=tile.words,
        COUNT_PAGES=COUNT_PAGES,
        WALK_PAGES=WALK_PAGES,
        HOST_ROWS_DENSE=geom.rows_per_page == 1 or geom.row_stride == geom.row_elems,
        DEV_PTR_TABLE=plan.dev_ptr_table,
        TO_HOST=plan.to_host,
        num_warps=_num_warps(tile.pages * tile.words, words.word_bytes),
    )
    return _Spec(args, meta, (grid_pages, grid_layers), plan.dev_layers[0].device)


def _use_interpreter(device: torch.device) -> bool:
    """CPU tensors run under the interpreter, CUDA tensors always compiled.

    The interpreter is never used on CUDA tensors, whatever TRITON_INTERPRET
    says: backups reach device layers through raw addresses in a table, which
    the interpreter would dereference on the CPU.
    """
    return device.type != "cuda"


def _launch(
    plan: _Launch,
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    layout: CpPlacement,
    num_ctas: int,
    block_bytes: int,
) -> None:
    spec = _specialise(plan, device_locs, host_locs, layout, num_ctas, block_bytes)
    if _use_interpreter(spec.device):
        kernel = _twin.kernel_for(True)
        with INTERPRETER_LOCK:
            kernel[spec.grid](*spec.args, **spec.meta)
        return
    kernel = _twin.kernel_for(False)
    with torch.cuda.device(spec.device):
        kernel[spec.grid](*spec.args, **spec.meta)


# ----------------------------------------------------------------------------- argument checks
def _prepare(
    *,
    dev_name: str,
    dev: torch.Tensor,
    host_name: str,
    host: torch.Tensor,
    host_layout: str,
    layout: CpPlacement,
    kv: bool,
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    num_ctas: int | None,
    block_bytes: int | None,
) -> tuple[HostGeometry, int, int, int]:
    """Checks shared by all four launchers, given the first (or only) device
    layer; returns (host geometry, device pages per layer, num_ctas, block_bytes)."""
    if kv:
        geom = _checks.check_kv_call(dev_name, dev, host, host_layout, layout)
        dev_num_pages = dev.shape[0] // layout.page_size
    else:
        geom = _checks.check_index_call(dev_name, dev, host, host_layout)
        dev_num_pages = dev.shape[0]
    if dev.device.type not in ("cuda", "cpu"):
        raise ValueError(
            f"{dev_name} is on {dev.device}; the Triton kernels take cuda (compiled) "
            f"or cpu (Triton interpreter) tensors"
        )
    num_ctas, block_bytes = _check_num_ctas(num_ctas, block_bytes)
    _check_host_buffer(host_name, host, dev.device)
    _checks.check_locs("device_locs", device_locs, layout.page_size)
    _checks.check_locs("host_locs", host_locs, layout.page_size)
    _check_index_tensor("device_locs", device_locs, dev.device)
    _check_index_tensor("host_locs", host_locs, dev.device)
    _checks.check_lengths(device_locs, host_locs)
    return geom, dev_num_pages, num_ctas, block_bytes


def _check_indices(device_locs, host_locs, layout, dev_num_pages, host_num_pages) -> None:
    """Check the index values whenever that is free: indices on the CPU
    (both backends do) or debug mode. CUDA indices are not read without debug
    mode (that would be a sync); the kernel then skips any page outside the
    buffers (negative locations included) instead of writing it."""
    if device_locs.device.type == "cpu" or _checks.debug_enabled():
        _checks.check_indices(device_locs, host_locs, layout, dev_num_pages, host_num_pages)


def _check_layers_fit(dev_name: str, layers: Sequence[torch.Tensor], host_name: str, geom: HostGeometry) -> None:
    if len(layers) > geom.num_layers:
        raise ValueError(
            f"{dev_name} has {len(layers)} layers but {host_name} holds only {geom.num_layers}"
        )
    for i, t in enumerate(layers):
        _check_device_buffer(f"{dev_name}[{i}]", t)


# ----------------------------------------------------------------------------- public launchers
def _backup_all_layers(
    dev_name: str, device_layers, host_name: str, host: torch.Tensor, host_layout: str,
    device_locs: torch.Tensor, host_locs: torch.Tensor, layout: CpPlacement,
    *, kv: bool, num_ctas: int | None, block_bytes: int | None,
) -> None:
    """Shared body of the two backups (KV rows or indexer pages)."""
    layout = _checks.check_layout(layout)
    host_layout = _checks.check_host_layout(host_layout)
    layers = _checks.check_device_layers(dev_name, device_layers, ndim=3 if kv else 2)
    _checks.check_tensor(host_name, host)
    geom, dev_num_pages, num_ctas, block_bytes = _prepare(
        dev_name=f"{dev_name}[0]", dev=layers[0], host_name=host_name, host=host,
        host_layout=host_layout, layout=layout, kv=kv, device_locs=device_locs,
        host_locs=host_locs, num_ctas=num_ctas, block_bytes=block_bytes,
    )
    _check_layers_fit(dev_name, layers, host_name, geom)
    _check_indices(device_locs, host_locs, layout, dev_num_pages, geom.num_pages)
    if host_locs.numel() == 0:
        return
    plan = _Launch(tuple(layers), True, host, geom, 0, dev_num_pages, to_host=True)
    _launch(plan, device_locs, host_locs, layout, num_ctas, block_bytes)


def _load_one_layer(
    dev_name: str, device_layer, host_name: str, host: torch.Tensor, host_layout: str,
    layer_id: int, device_locs: torch.Tensor, host_locs: torch.Tensor, layout: CpPlacement,
    *, kv: bool, num_ctas: int | None, block_bytes: int | None,
) -> None:
    """Shared body of the two loads (KV rows or indexer pages)."""
    layout = _checks.check_layout(layout)
    host_layout = _checks.check_host_layout(host_layout)
    dev = _checks.check_device_layer(dev_name, device_layer, ndim=3 if kv else 2)
    _checks.check_tensor(host_name, host)
    geom, dev_num_pages, num_ctas, block_bytes = _prepare(
        dev_name=dev_name, dev=dev, host_name=host_name, host=host,
        host_layout=host_layout, layout=layout, kv=kv, device_locs=device_locs,
        host_locs=host_locs, num_ctas=num_ctas, block_bytes=block_bytes,
    )
    _checks.check_layer_id("layer_id", layer_id, geom.num_layers)
    _check_device_buffer(dev_name, dev)
    _check_indices(device_locs, host_locs, layout, dev_num_pages, geom.num_pages)
    if host_locs.numel() == 0:
        return
    plan = _Launch((dev,), False, host, geom, layer_id, dev_num_pages, to_host=False)
    _launch(plan, device_locs, host_locs, layout, num_ctas, block_bytes)


def backup_kv_all_layers(
    device_kv: Sequence[torch.Tensor],
    host_kv: torch.Tensor,
    host_layout: str,
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    layout: CpPlacement,
    *,
    num_ctas: int | None = None,
    block_bytes: int | None = None,
) -> None:
    """D2H: every layer's owned KV pages -> host slots. One launch, no sync."""
    _backup_all_layers("device_kv", device_kv, "host_kv", host_kv, host_layout, device_locs,
                       host_locs, layout, kv=True, num_ctas=num_ctas, block_bytes=block_bytes)


def load_kv_one_layer(
    device_kv_layer: torch.Tensor,
    host_kv: torch.Tensor,
    host_layout: str,
    layer_id: int,
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    layout: CpPlacement,
    *,
    num_ctas: int | None = None,
    block_bytes: int | None = None,
) -> None:
    """H2D: one layer's host slots -> owned physical KV pages. One launch, no sync."""
    _load_one_layer("device_kv_layer", device_kv_layer, "host_kv", host_kv, host_layout, layer_id,
                    device_locs, host_locs, layout, kv=True, num_ctas=num_ctas, block_bytes=block_bytes)


def backup_indexer_all_layers(
    device_index: Sequence[torch.Tensor],
    host_index: torch.Tensor,
    host_layout: str,
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    layout: CpPlacement,
    *,
    num_ctas: int | None = None,
    block_bytes: int | None = None,
) -> None:
    """D2H: every layer's owned indexer pages -> host pages. One launch, no sync."""
    _backup_all_layers("device_index", device_index, "host_index", host_index, host_layout,
                       device_locs, host_locs, layout, kv=False, num_ctas=num_ctas,
                       block_bytes=block_bytes)


def load_indexer_one_layer(
    device_index_layer: torch.Tensor,
    host_index: torch.Tensor,
    host_layout: str,
    layer_id: int,
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    layout: CpPlacement,
    *,
    num_ctas: int | None = None,
    block_bytes: int | None = None,
) -> None:
    """H2D: one layer's host indexer pages -> owned physical device pages. No sync."""
    _load_one_layer("device_index_layer", device_index_layer, "host_index", host_index, host_layout,
                    layer_id, device_locs, host_locs, layout, kv=False, num_ctas=num_ctas,
                    block_bytes=block_bytes)
