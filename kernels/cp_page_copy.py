"""Triton kernels: masked per-rank page copies between SGLang host pools and
DSA device pools under CP shared KV.

One kernel, ``_copy_pages_kernel``, moves whole pages in either direction:

* backup (``d2h``, all layers): device layers are separate allocations, so the
  kernel reads their addresses from a small int64 table;
* load (``h2d``, one layer): the one device layer is passed directly.

The kernel takes LOGICAL ``device_locs``. It skips pages owned by other CP
ranks and translates owned ones to physical pages itself; the host page of
the k-th owned page is ``host_locs[k * page_size] // page_size``. Each program
finds k by counting owned pages ahead of its chunk in device memory, so the
launch needs no device-to-host sync and no extra torch kernels.

The grid is persistent-style: ``num_ctas`` programs each walk a contiguous
chunk of pages (and, for backups, a chunk of layers), so a handful of CTAs can
keep the host link busy without taking SMs from the forward pass.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys
import threading
from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from sglang_cp_hicache.kernels import _checks
from sglang_cp_hicache.kernels._checks import HostGeometry
from sglang_cp_hicache.layout import CpSharedKVLayout

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_NUM_CTAS",
    "backup_indexer_all_layers",
    "backup_kv_all_layers",
    "compile_offline",
    "load_indexer_one_layer",
    "load_kv_one_layer",
    "warmup",
]

# ----------------------------------------------------------------------------- constants
# CTAs per launch when the caller does not say. The copy is bound by the host
# link (PCIe Gen5 x16: ~55 GB/s per direction measured), not by SMs; SGLang's
# host-copy kernel reaches its link limit with 4 of 152 SMs, and copy kernels
# that take many SMs slow the forward pass (FIELD.md, "Transfer bandwidth").
# Unmeasured on our kernels yet: bench/bench_transfer.py sweeps it.
DEFAULT_NUM_CTAS = 4

# Bytes one CTA moves per loop iteration. A CTA's throughput over the host link
# is bytes-in-flight / latency (~1-2 us across PCIe), so 32 KiB in flight is
# ~16-32 GB/s per CTA; smaller blocks leave the link idle, larger ones only
# add masked lanes on 8 KiB indexer pages. The block is shrunk to the page's
# size when the page is smaller.
DEFAULT_BLOCK_BYTES = 32768

# Each thread holds 8 x 16-byte vectors per iteration: enough independent
# loads in flight per thread, 32 registers of data, no spills. num_warps is
# block_bytes / (32 threads * 128 B), clamped to [1, 8].
_BYTES_PER_THREAD = 128

# Widest global access on sm_90 is 16 bytes (ld.global.v4.b32 / v2.b64).
_VECTOR_BYTES = 16

# Pages scanned per step when a program counts the owned pages ahead of its
# chunk: one int64 location per page, 1024 of them is 8 KiB of loads in flight.
# Triton's interpreter reduces with a user combine function element by element
# in Python (~10 us each), so it scans 16 at a time instead.
_BLOCK_PAGES = 1024
_BLOCK_PAGES_INTERPRETED = 16

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


# ----------------------------------------------------------------------------- helpers
# The kernels use only triton.language builtins plus the helpers below, never
# the @triton.jit functions of triton.language.standard (tl.sum, tl.zeros,
# tl.cdiv, ...): those are compiled-or-interpreted once, when triton itself is
# imported, while the flavour of this file's kernels is chosen per launch (see
# _kernel_for). tests/test_kernels_compile.py and the interpreter tests pin it.
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _owned_pages_before(
    device_locs_ptr, end_page, cp_size, cp_rank,
    PAGE_SIZE: tl.constexpr, BLOCK_PAGES: tl.constexpr,
):
    """How many of pages [0, end_page) of device_locs this rank owns."""
    count = tl.full((), 0, tl.int64)
    for start in range(0, end_page, BLOCK_PAGES):
        pages = start + tl.arange(0, BLOCK_PAGES).to(tl.int64)
        in_range = pages < end_page
        locs = tl.load(device_locs_ptr + pages * PAGE_SIZE, mask=in_range, other=0)
        owned = ((locs // PAGE_SIZE) % cp_size == cp_rank) & in_range
        count += tl.reduce(owned.to(tl.int64), 0, _add)
    return count


@triton.jit
def _copy_page(
    dev_page_ptr, host_page_ptr, host_row_stride,
    ROWS: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr,
    HOST_ROWS_DENSE: tl.constexpr, TO_HOST: tl.constexpr,
):
    """Copy one page (ROWS rows of ROW words) between device and host.

    The device page is ROWS * ROW contiguous words. Host rows are either dense
    too (layer_first, page_first_direct, indexer) or host_row_stride apart
    (page_first KV, where the layers of a slot sit between its rows).
    """
    for start in tl.range(0, ROWS * ROW, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < ROWS * ROW
        if HOST_ROWS_DENSE:
            host_offs = offs.to(tl.int64)
        else:
            host_offs = (offs // ROW).to(tl.int64) * host_row_stride + offs % ROW
        if TO_HOST:
            words = tl.load(dev_page_ptr + offs, mask=mask)
            tl.store(host_page_ptr + host_offs, words, mask=mask)
        else:
            words = tl.load(host_page_ptr + host_offs, mask=mask)
            tl.store(dev_page_ptr + offs, words, mask=mask)


# ----------------------------------------------------------------------------- kernel
@triton.jit(
    do_not_specialize=[
        "num_pages", "num_listed_host_pages", "dev_num_pages", "host_num_pages",
        "layer_base", "num_layers", "pages_per_program", "layers_per_program",
        "host_page_stride_v", "host_layer_stride_v", "host_row_stride_v",
        "cp_size", "cp_rank",
    ],
    # Alignment is passed explicitly (ALIGN_BYTES, checked by the launcher), so
    # a sliced index tensor or an odd host view never triggers a recompile.
    do_not_specialize_on_alignment=["dev_ptr", "host_ptr", "device_locs_ptr", "host_locs_ptr"],
)
def _copy_pages_kernel(
    dev_ptr,                # DEV_PTR_TABLE: int64 byte addresses of each device layer;
                            # else the one device layer (words)
    host_ptr,               # host buffer (words), at its first page and layer
    device_locs_ptr,        # int64 logical token locs, whole pages
    host_locs_ptr,          # int64 host slots of the owned tokens, whole pages
    num_pages,              # pages in device_locs
    num_listed_host_pages,  # pages in host_locs
    dev_num_pages,          # physical pages per device layer (bound)
    host_num_pages,         # pages in the host buffer (bound)
    layer_base,             # host layer of device layer 0
    num_layers,             # device layers to copy
    pages_per_program, layers_per_program,
    host_page_stride_v, host_layer_stride_v, host_row_stride_v,  # in VEC-word units
    cp_size, cp_rank,
    PAGE_SIZE: tl.constexpr,     # tokens per page (for the location math)
    ROWS: tl.constexpr,          # rows per copied page: PAGE_SIZE for KV, 1 for indexer
    ROW: tl.constexpr,           # words per row
    VEC: tl.constexpr,           # words per 16 bytes when every address is 16-B aligned, else 1
    ALIGN_BYTES: tl.constexpr,   # VEC * word bytes: alignment of every base address and stride
    BLOCK: tl.constexpr,         # words per loop iteration (power of two)
    BLOCK_PAGES: tl.constexpr,
    HOST_ROWS_DENSE: tl.constexpr,
    DEV_PTR_TABLE: tl.constexpr,
    TO_HOST: tl.constexpr,
):
    pid_page = tl.program_id(0).to(tl.int64)
    pid_layer = tl.program_id(1).to(tl.int64)
    # Strides arrive in VEC-word units so the compiler can prove 16-byte
    # alignment of every address without specialising on their values.
    host_page_stride = host_page_stride_v.to(tl.int64) * VEC
    host_layer_stride = host_layer_stride_v.to(tl.int64) * VEC
    host_row_stride = host_row_stride_v.to(tl.int64) * VEC

    page_lo = pid_page * pages_per_program
    page_hi = tl.minimum(page_lo + pages_per_program, num_pages)
    layer_lo = pid_layer * layers_per_program
    layer_hi = tl.minimum(layer_lo + layers_per_program, num_layers)

    # k-th owned page of device_locs <-> k-th page of host_locs
    host_idx = _owned_pages_before(device_locs_ptr, page_lo, cp_size, cp_rank, PAGE_SIZE, BLOCK_PAGES)
    # Index loads are issued one page ahead (and table loads one layer ahead),
    # so their latency hides behind the previous copy instead of stalling it.
    loc = tl.load(device_locs_ptr + page_lo * PAGE_SIZE, mask=page_lo < page_hi, other=0)
    host_loc = tl.load(host_locs_ptr + host_idx * PAGE_SIZE, mask=host_idx < num_listed_host_pages, other=0)
    if DEV_PTR_TABLE:
        first_layer_addr = tl.load(dev_ptr + layer_lo, mask=layer_lo < layer_hi, other=0)
    for page in range(page_lo, page_hi):
        logical_page = loc // PAGE_SIZE
        host_page = host_loc // PAGE_SIZE
        owned = (logical_page % cp_size) == cp_rank
        listed = host_idx < num_listed_host_pages
        next_idx = host_idx + owned.to(tl.int64)
        loc = tl.load(device_locs_ptr + (page + 1) * PAGE_SIZE, mask=page + 1 < page_hi, other=0)
        host_loc = tl.load(host_locs_ptr + next_idx * PAGE_SIZE, mask=next_idx < num_listed_host_pages, other=0)
        phys_page = logical_page // cp_size
        # Out-of-range pages are skipped rather than written: a wild store
        # into pinned host memory corrupts the process. Debug mode raises.
        in_bounds = (logical_page >= 0) & (phys_page < dev_num_pages)
        in_bounds = in_bounds & (host_page >= 0) & (host_page < host_num_pages)
        if owned & listed & in_bounds:
            if DEV_PTR_TABLE:
                layer_addr = first_layer_addr
            for layer in range(layer_lo, layer_hi):
                if DEV_PTR_TABLE:
                    dev_layer_ptr = layer_addr.to(tl.pointer_type(host_ptr.dtype.element_ty))
                    layer_addr = tl.load(dev_ptr + layer + 1, mask=layer + 1 < layer_hi, other=0)
                else:
                    dev_layer_ptr = dev_ptr
                # The hint sits on the page addresses (a hint on a kernel
                # argument itself is dropped); the launcher checked it.
                dev_page_ptr = tl.multiple_of(dev_layer_ptr + phys_page * (ROWS * ROW), ALIGN_BYTES)
                host_page_ptr = tl.multiple_of(
                    host_ptr + host_page * host_page_stride + (layer_base + layer) * host_layer_stride,
                    ALIGN_BYTES,
                )
                _copy_page(dev_page_ptr, host_page_ptr, host_row_stride,
                           ROWS, ROW, BLOCK, HOST_ROWS_DENSE, TO_HOST)
        host_idx = next_idx


# ----------------------------------------------------------------------------- kernel flavours
# TRITON_INTERPRET is read when @triton.jit runs (i.e. when this module is
# imported), not when triton is imported. CPU tensors can only run under the
# interpreter and CUDA tensors want the compiled kernel, so whichever flavour
# this import did not produce is built from a second copy of this file,
# imported once with TRITON_INTERPRET forced to the other value.
_TWINS: dict[bool, object] = {}
_TWIN_LOCK = threading.Lock()


def _is_interpreted(kernel) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def _kernel_for(interpret: bool):
    """``_copy_pages_kernel`` compiled for the GPU, or run by Triton's interpreter."""
    if _is_interpreted(_copy_pages_kernel) == interpret:
        return _copy_pages_kernel
    with _TWIN_LOCK:
        twin = _TWINS.get(interpret)
        if twin is None:
            name = f"{__name__}__{'interpreted' if interpret else 'compiled'}"
            spec = importlib.util.spec_from_file_location(name, __file__)
            twin = importlib.util.module_from_spec(spec)
            saved = os.environ.get("TRITON_INTERPRET")
            os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
            try:
                sys.modules[name] = twin
                spec.loader.exec_module(twin)
            finally:
                if saved is None:
                    os.environ.pop("TRITON_INTERPRET", None)
                else:
                    os.environ["TRITON_INTERPRET"] = saved
            assert _is_interpreted(twin._copy_pages_kernel) == interpret
            _TWINS[interpret] = twin
    return twin._copy_pages_kernel


def _use_interpreter(device: torch.device) -> bool:
    """CPU tensors run under the interpreter, CUDA tensors always compiled.

    The interpreter is never used on CUDA tensors, whatever TRITON_INTERPRET
    says: backups reach device layers through raw addresses in a table, which
    the interpreter would dereference on the CPU.
    """
    return device.type != "cuda"


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
    align = g & -g if g else _VECTOR_BYTES  # largest power of two dividing all of them
    align = min(align, _VECTOR_BYTES)
    word = min(align, 8)
    return _WordPlan(word, align // word)


def _block_words(page_words: int, word_bytes: int, block_bytes: int) -> int:
    return max(1, min(triton.next_power_of_2(page_words), block_bytes // word_bytes))


def _num_warps(block_words: int, word_bytes: int) -> int:
    return max(1, min(8, block_words * word_bytes // (32 * _BYTES_PER_THREAD)))


_PTR_TABLES: dict[tuple, torch.Tensor] = {}
_PTR_TABLES_MAX = 64


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
        or block_bytes < _VECTOR_BYTES or block_bytes & (block_bytes - 1)
    ):
        raise ValueError(f"block_bytes must be a power of two >= {_VECTOR_BYTES}, got {block_bytes!r}")
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
    layout: CpSharedKVLayout,
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
    block = _block_words(geom.rows_per_page * row_words, words.word_bytes, block_bytes)
    host_w = plan.host.view(words.dtype)
    if plan.dev_ptr_table:
        dev_arg = _device_ptr_table(plan.dev_layers)
    else:
        dev_arg = plan.dev_layers[0].view(words.dtype)
    num_layers = len(plan.dev_layers)

    # Persistent-style grid: at most num_ctas programs; pages split first,
    # then layers, so a one-page backup of 61 layers still uses every CTA.
    num_pages = device_locs.numel() // layout.page_size
    grid_pages = min(num_pages, num_ctas)
    pages_per_program = triton.cdiv(num_pages, grid_pages)
    grid_pages = triton.cdiv(num_pages, pages_per_program)
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
        BLOCK=block,
        BLOCK_PAGES=_BLOCK_PAGES,
        HOST_ROWS_DENSE=geom.rows_per_page == 1 or geom.row_stride == geom.row_elems,
        DEV_PTR_TABLE=plan.dev_ptr_table,
        TO_HOST=plan.to_host,
        num_warps=_num_warps(block, words.word_bytes),
    )
    return _Spec(args, meta, (grid_pages, grid_layers), plan.dev_layers[0].device)


def _launch(
    plan: _Launch,
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    layout: CpSharedKVLayout,
    num_ctas: int,
    block_bytes: int,
) -> None:
    spec = _specialise(plan, device_locs, host_locs, layout, num_ctas, block_bytes)
    interpret = _use_interpreter(spec.device)
    kernel = _kernel_for(interpret)
    meta = dict(spec.meta, BLOCK_PAGES=_BLOCK_PAGES_INTERPRETED) if interpret else spec.meta
    with torch.cuda.device(spec.device) if spec.device.type == "cuda" else contextlib.nullcontext():
        kernel[spec.grid](*spec.args, **meta)


# ----------------------------------------------------------------------------- argument checks
def _prepare(
    *,
    dev_name: str,
    dev: torch.Tensor,
    host_name: str,
    host: torch.Tensor,
    host_layout: str,
    layout: CpSharedKVLayout,
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
    """Checks that read the indices: all of them in debug mode; without it,
    only the owned-token count, and only when the indices are on the CPU
    (free there; on a GPU it would be a sync)."""
    if _checks.debug_enabled():
        _checks.debug_check_indices(device_locs, host_locs, layout, dev_num_pages, host_num_pages)
    elif device_locs.device.type == "cpu":
        _checks.check_owned_count(device_locs, host_locs, layout)


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
    device_locs: torch.Tensor, host_locs: torch.Tensor, layout: CpSharedKVLayout,
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
    if host_locs.numel() == 0:
        return
    _check_indices(device_locs, host_locs, layout, dev_num_pages, geom.num_pages)
    plan = _Launch(tuple(layers), True, host, geom, 0, dev_num_pages, to_host=True)
    _launch(plan, device_locs, host_locs, layout, num_ctas, block_bytes)


def _load_one_layer(
    dev_name: str, device_layer, host_name: str, host: torch.Tensor, host_layout: str,
    layer_id: int, device_locs: torch.Tensor, host_locs: torch.Tensor, layout: CpSharedKVLayout,
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
    if host_locs.numel() == 0:
        return
    _check_indices(device_locs, host_locs, layout, dev_num_pages, geom.num_pages)
    plan = _Launch((dev,), False, host, geom, layer_id, dev_num_pages, to_host=False)
    _launch(plan, device_locs, host_locs, layout, num_ctas, block_bytes)


def backup_kv_all_layers(
    device_kv: Sequence[torch.Tensor],
    host_kv: torch.Tensor,
    host_layout: str,
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    layout: CpSharedKVLayout,
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
    layout: CpSharedKVLayout,
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
    layout: CpSharedKVLayout,
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
    layout: CpSharedKVLayout,
    *,
    num_ctas: int | None = None,
    block_bytes: int | None = None,
) -> None:
    """H2D: one layer's host indexer pages -> owned physical device pages. No sync."""
    _load_one_layer("device_index_layer", device_index_layer, "host_index", host_index, host_layout,
                    layer_id, device_locs, host_locs, layout, kv=False, num_ctas=num_ctas,
                    block_bytes=block_bytes)


# ----------------------------------------------------------------------------- warm-up and offline compile
def _warmup_plans(
    *,
    page_size: int,
    host_layout: str,
    num_layers: int,
    kv_dim: int | None,
    kv_dtype: torch.dtype | None,
    indexer_page_bytes: int | None,
    device: torch.device,
    pin_memory: bool,
) -> list[tuple[str, _Launch, torch.Tensor, CpSharedKVLayout]]:
    """One stand-in launch per operation a pool configuration uses.

    The kernel's specialisation depends only on constexprs derived from page
    size, row bytes, host layout, word size and alignment. For a contiguous
    host pool every stride is a multiple of the row size, so one host page and
    tiny device layers specialise exactly like the real pools (every int
    argument is do_not_specialize, every pointer do_not_specialize_on_alignment).
    """
    layout = CpSharedKVLayout(page_size, 1, 0)
    locs = torch.arange(page_size, dtype=torch.int64, device=device)
    plans = []
    if kv_dim is not None:
        if kv_dtype is None:
            raise ValueError("kv_dtype is required with kv_dim")
        dev = [torch.empty((page_size, 1, kv_dim), dtype=kv_dtype, device=device) for _ in range(num_layers)]
        shape = {
            "layer_first": (num_layers, page_size, 1, kv_dim),
            "page_first": (page_size, num_layers, 1, kv_dim),
            "page_first_direct": (1, num_layers, page_size, 1, kv_dim),
        }[host_layout]
        host = torch.empty(shape, dtype=kv_dtype, pin_memory=pin_memory)
        geom = _checks.host_kv_geometry("host_kv", host, host_layout, page_size, kv_dim)
        plans.append(("kv_d2h", _Launch(tuple(dev), True, host, geom, 0, 1, to_host=True), locs, layout))
        plans.append(("kv_h2d", _Launch((dev[0],), False, host, geom, 0, 1, to_host=False), locs, layout))
    if indexer_page_bytes is not None:
        dev = [torch.empty((1, indexer_page_bytes), dtype=torch.uint8, device=device) for _ in range(num_layers)]
        if host_layout == "layer_first":
            shape = (num_layers, 1, indexer_page_bytes)
        else:
            shape = (1, num_layers, 1, indexer_page_bytes)
        host = torch.empty(shape, dtype=torch.uint8, pin_memory=pin_memory)
        geom = _checks.host_index_geometry("host_index", host, host_layout, indexer_page_bytes)
        plans.append(("indexer_d2h", _Launch(tuple(dev), True, host, geom, 0, 1, to_host=True), locs, layout))
        plans.append(("indexer_h2d", _Launch((dev[0],), False, host, geom, 0, 1, to_host=False), locs, layout))
    return plans


def _check_pool_config(page_size, host_layout, num_layers, kv_dim, indexer_page_bytes) -> None:
    _checks.check_host_layout(host_layout)
    for name, value in (("page_size", page_size), ("num_layers", num_layers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    for name, value in (("kv_dim", kv_dim), ("indexer_page_bytes", indexer_page_bytes)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    if kv_dim is None and indexer_page_bytes is None:
        raise ValueError("give kv_dim (with kv_dtype) and/or indexer_page_bytes")


def warmup(
    *,
    page_size: int,
    host_layout: str,
    num_layers: int,
    kv_dim: int | None = None,
    kv_dtype: torch.dtype | None = None,
    indexer_page_bytes: int | None = None,
    device: torch.device | str | None = None,
    block_bytes: int | None = None,
) -> int:
    """Compile every kernel specialisation a pool configuration will use.

    Covers KV backup + load (when ``kv_dim``/``kv_dtype`` are given) and
    indexer backup + load (when ``indexer_page_bytes`` is given) for
    ``host_layout``. Compiles without launching anything. Returns how many
    kernels were compiled or found in Triton's caches; 0 (a no-op) when the
    device is not CUDA. Compiled binaries land in ``TRITON_CACHE_DIR``
    (default ``~/.triton/cache``), so later processes load them from disk.
    """
    _check_pool_config(page_size, host_layout, num_layers, kv_dim, indexer_page_bytes)
    _, block_bytes = _check_num_ctas(None, block_bytes)
    if device is None:
        if not torch.cuda.is_available():
            return 0
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    plans = _warmup_plans(
        page_size=page_size, host_layout=host_layout, num_layers=num_layers, kv_dim=kv_dim,
        kv_dtype=kv_dtype, indexer_page_bytes=indexer_page_bytes, device=device, pin_memory=True,
    )
    kernel = _kernel_for(False)
    compiled = 0
    with torch.cuda.device(device):
        for _, plan, locs, layout in plans:
            spec = _specialise(plan, locs, locs, layout, DEFAULT_NUM_CTAS, block_bytes)
            kernel.warmup(*spec.args, grid=spec.grid, **spec.meta)
            compiled += 1
    return compiled


_TRITON_TYPES = {torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.uint8: "u8"}


def compile_offline(
    target,
    *,
    page_size: int,
    host_layout: str,
    num_layers: int,
    kv_dim: int | None = None,
    kv_dtype: torch.dtype | None = None,
    indexer_page_bytes: int | None = None,
    block_bytes: int | None = None,
) -> dict:
    """Compile the specialisations of a pool configuration for ``target``
    (a ``triton.backends.compiler.GPUTarget``) without a GPU.

    Returns ``{"kv_d2h" | "kv_h2d" | "indexer_d2h" | "indexer_h2d": CompiledKernel}``;
    ``compiled.asm["ptx"]`` is the PTX. Used by the tests to check that the
    copy loops use 16-byte vector loads and stores on Hopper.
    """
    from triton.compiler import ASTSource

    _check_pool_config(page_size, host_layout, num_layers, kv_dim, indexer_page_bytes)
    _, block_bytes = _check_num_ctas(None, block_bytes)
    plans = _warmup_plans(
        page_size=page_size, host_layout=host_layout, num_layers=num_layers, kv_dim=kv_dim,
        kv_dtype=kv_dtype, indexer_page_bytes=indexer_page_bytes, device=torch.device("cpu"),
        pin_memory=False,
    )
    kernel = _kernel_for(False)
    names = kernel.arg_names
    out = {}
    for op, plan, locs, layout in plans:
        spec = _specialise(plan, locs, locs, layout, DEFAULT_NUM_CTAS, block_bytes)
        meta = dict(spec.meta)
        num_warps = meta.pop("num_warps")
        signature = {}
        for name, arg in zip(names, spec.args):
            if isinstance(arg, torch.Tensor):
                signature[name] = "*" + _TRITON_TYPES[arg.dtype]
            else:  # every int argument is do_not_specialize: typed by range only
                signature[name] = "i32" if -(2**31) <= arg < 2**31 else "i64"
        for name in meta:
            signature[name] = "constexpr"
        src = ASTSource(kernel, signature, meta)
        out[op] = triton.compile(src, target=target, options={"num_warps": num_warps})
    return out
