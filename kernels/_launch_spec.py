"""What one launch of the page-copy kernel needs, and the launch itself.

A launch is resolved in two steps:

* :func:`pool_part` -- everything the buffers fix (word width and vector,
  tile shape, strides in copy units, the constexprs): computed once per pool
  by a bound copy (:class:`~.bound.PoolCopies`), per call by the launchers;
* :func:`specialise` -- the grid and argument list of one call, from the
  index tensors and the placement.

CPU tensors run under Triton's interpreter, serialised process-wide by
:data:`INTERPRETER_LOCK`; CUDA tensors always run compiled.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Sequence

import torch
import triton

from . import _twin
from ._checks import HostGeometry
from ._kernel import (
    BYTES_PER_THREAD,
    COUNT_PAGES,
    MAX_TILE_PAGES,
    VECTOR_BYTES,
    WALK_PAGES,
)
from sglang_cp_hicache.placement import CpPlacement

__all__ = [
    "INTERPRETER_LOCK",
    "LaunchPlan",
    "PoolPart",
    "Spec",
    "TileShape",
    "WordPlan",
    "pool_part",
    "run",
    "specialise",
    "tile_shape",
    "word_plan",
]

#: Held by every interpreted launch. Triton's interpreter swaps
#: ``triton.language`` functions for its own while a kernel runs and restores
#: them afterwards; two threads interleaving that corrupt each other
#: (``InterpreterError('Did you forget to add @triton.jit ?')``).
INTERPRETER_LOCK = threading.Lock()

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@dataclass(frozen=True)
class WordPlan:
    word_bytes: int
    vec: int  # words per 16 bytes if every address is 16-byte aligned, else 1

    @property
    def dtype(self) -> torch.dtype:
        return _WORD_DTYPES[self.word_bytes]

    @property
    def unit_bytes(self) -> int:
        return self.word_bytes * self.vec


def word_plan(row_bytes: int, byte_strides: Sequence[int], addresses: Sequence[int]) -> WordPlan:
    """Widest word and vector the row size, strides and base addresses allow."""
    g = row_bytes
    for v in (*byte_strides, *addresses):
        g = math.gcd(g, int(v))
    align = g & -g if g else VECTOR_BYTES  # largest power of two dividing all of them
    align = min(align, VECTOR_BYTES)
    word = min(align, 8)
    return WordPlan(word, align // word)


@dataclass(frozen=True)
class TileShape:
    """A tile is ``pages`` units of ``words`` words (both powers of two)."""

    pages: int
    words: int


def tile_shape(page_words: int, word_bytes: int, block_bytes: int) -> TileShape:
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
    return TileShape(best_pages, best)


def _num_warps(tile_words: int, word_bytes: int) -> int:
    return max(1, min(8, tile_words * word_bytes // (32 * BYTES_PER_THREAD)))


_PTR_TABLES: dict[tuple, torch.Tensor] = {}
_PTR_TABLES_MAX = 64
_PTR_TABLES_LOCK = threading.Lock()


def _device_ptr_table(device: torch.device, ptrs: tuple[int, ...]) -> torch.Tensor:
    """int64 table of the layers' addresses, on their device.

    Cached by address: pool buffers live for the whole process, and building
    the table on CUDA is an H2D copy we only want to pay once (it goes through
    pinned memory with non_blocking=True, so even the first one does not sync).
    """
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


@dataclass(frozen=True)
class LaunchPlan:
    """One launch's buffers, after validation."""

    dev_layers: tuple[torch.Tensor, ...]  # all layers (table) or the one layer
    dev_ptr_table: bool
    host: torch.Tensor
    geom: HostGeometry
    layer_base: int
    dev_num_pages: int
    to_host: bool


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class PoolPart:
    """The part of a launch the buffers (and page size) fix: kernel buffers,
    sizes, host strides in copy units, constexprs."""

    device: torch.device
    dev_view: torch.Tensor | None  # the one layer as words (loads)
    dev_ptrs: tuple[int, ...]  # every layer's address (backups: a table)
    host_words: torch.Tensor
    num_layers: int
    layer_base: int
    dev_num_pages: int
    host_num_pages: int
    unit_strides: tuple[int, int, int]  # host page, layer, row
    meta: dict


def pool_part(plan: LaunchPlan, page_size: int, block_bytes: int) -> PoolPart:
    geom = plan.geom
    elem = plan.host.element_size()
    row_bytes = geom.row_elems * elem
    words = word_plan(
        row_bytes,
        (geom.page_stride * elem, geom.layer_stride * elem, geom.row_stride * elem),
        (plan.host.data_ptr(), *(t.data_ptr() for t in plan.dev_layers)),
    )
    unit = words.unit_bytes
    row_words = row_bytes // words.word_bytes
    tile = tile_shape(geom.rows_per_page * row_words, words.word_bytes, block_bytes)
    meta = dict(
        PAGE_SIZE=page_size,
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
    return PoolPart(
        device=plan.dev_layers[0].device,
        dev_view=None if plan.dev_ptr_table else plan.dev_layers[0].view(words.dtype),
        dev_ptrs=tuple(t.data_ptr() for t in plan.dev_layers),
        host_words=plan.host.view(words.dtype),
        num_layers=len(plan.dev_layers),
        layer_base=plan.layer_base,
        dev_num_pages=plan.dev_num_pages,
        host_num_pages=geom.num_pages,
        unit_strides=(geom.page_stride * elem // unit, geom.layer_stride * elem // unit,
                      geom.row_stride * elem // unit),
        meta=meta,
    )


@dataclass(frozen=True)
class Spec:
    """One launch, fully resolved: kernel arguments, constexprs, grid."""

    args: tuple
    meta: dict
    grid: tuple[int, int]
    device: torch.device


def specialise(
    part: PoolPart, device_locs: torch.Tensor, host_locs: torch.Tensor, placement: CpPlacement, num_ctas: int
) -> Spec:
    # Persistent-style grid: at most num_ctas programs; pages split first,
    # then layers, so a one-page backup of 61 layers still uses every CTA.
    num_pages = device_locs.numel() // placement.page_size
    grid_pages = max(1, min(num_pages, num_ctas))
    pages_per_program = triton.cdiv(num_pages, grid_pages)
    grid_pages = max(1, triton.cdiv(num_pages, pages_per_program))
    grid_layers = min(part.num_layers, max(1, num_ctas // grid_pages))
    layers_per_program = triton.cdiv(part.num_layers, grid_layers)
    grid_layers = triton.cdiv(part.num_layers, layers_per_program)
    dev_arg = part.dev_view if part.dev_view is not None else _device_ptr_table(part.device, part.dev_ptrs)
    args = (
        dev_arg, part.host_words, device_locs, host_locs,
        num_pages, host_locs.numel() // placement.page_size, part.dev_num_pages, part.host_num_pages,
        part.layer_base, part.num_layers, pages_per_program, layers_per_program,
        *part.unit_strides,
        placement.cp_size, placement.cp_rank,
    )
    return Spec(args, part.meta, (grid_pages, grid_layers), part.device)


def run(part: PoolPart, device_locs: torch.Tensor, host_locs: torch.Tensor, placement: CpPlacement,
        num_ctas: int) -> None:
    """Launch on the device buffers' current CUDA stream (no sync), or under
    the interpreter for CPU tensors.

    The interpreter is never used on CUDA tensors, whatever TRITON_INTERPRET
    says: backups reach device layers through raw addresses in a table, which
    the interpreter would dereference on the CPU.
    """
    spec = specialise(part, device_locs, host_locs, placement, num_ctas)
    if spec.device.type != "cuda":
        kernel = _twin.kernel_for(True)
        with INTERPRETER_LOCK:
            kernel[spec.grid](*spec.args, **spec.meta)
        return
    kernel = _twin.kernel_for(False)
    with torch.cuda.device(spec.device):
        kernel[spec.grid](*spec.args, **spec.meta)
